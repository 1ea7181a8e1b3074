"""The namespace: inodes, directories, open files, step directories, seal and commit.

The tree lives twice: as real files under the RAM store's `tree/` (the durable truth, so a crash
loses nothing written) and as `Node` objects in memory (inode numbers, lookup counts, open
handles, seals and step state). Every mutation goes through this class, which keeps both in
step; `fs.operations` only translates pyfuse3 calls into these methods.

Invariants (S3QL-style note: where an `await` must not appear):

* A file is *sealed* when its last active writer flushes: its xxh3-128 is computed in a thread
  and kept only if no writer became active meanwhile (`Node.gen` did not move).
* `_write_manifest` runs without any `await` from the moment the commit re-checks the step (no
  active writer, every file sealed, same set of files) until the manifest is renamed into place
  and the in-memory state updated. A concurrent handler therefore sees either the old state or
  the new one, never a manifest that disagrees with the tree.
* Committed objects are never written: a tree file whose inode is shared with `objects/` is
  unshared (copied, or recreated empty for O_TRUNC) before it is opened for writing or truncated.
* Order of a commit on disk: link objects, write manifest temp, fsync, rename. A crash before the
  rename leaves only unreferenced objects, which start-up removes; the step stays `writing`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import trio

from tierfs import manifest as mf
from tierfs.fs import dcp_metadata
from tierfs.fs.fetch import Fetch, FetchError, ReadSource, RemoteFile
from tierfs.fs.ram_store import RamStore, is_reserved

log = logging.getLogger(__name__)

ROOT_INODE = 1
LATEST = b"latest"
METADATA = b".metadata"
MANIFEST = mf.MANIFEST_NAME.encode()
PERSISTED_MARK = b".tierfs-persisted"  # "<version> persisted|retired": the persistent tier's state
REPLICAS_MARK = b".tierfs-replicas"  # "<version> <node id>...": peers that hold this version
PEERS_MARK = b".tierfs-peers"  # "<version> <node id>...": a step learned from peers that hold it
NAME_MAX = 255
DEFAULT_STEP_PATTERN = r"^(?:.*?[^0-9])?([0-9]+)$"

XATTR_STATE = b"user.tierfs.state"
XATTR_TIERS = b"user.tierfs.tiers"
XATTR_XXH3 = b"user.tierfs.xxh3"


class FsError(Exception):
    """A refusal with a POSIX errno; translated to FUSEError at the Operations boundary."""

    def __init__(self, errno_: int, message: str = "") -> None:
        super().__init__(message or os.strerror(errno_))
        self.errno = errno_


@dataclass(frozen=True)
class RemoteAttrs:
    """Attributes of a file whose bytes are not in RAM (from its manifest entry)."""

    st_mode: int
    st_nlink: int
    st_uid: int
    st_gid: int
    st_size: int
    st_blocks: int
    st_atime_ns: int
    st_mtime_ns: int
    st_ctime_ns: int


@dataclass(frozen=True)
class Seal:
    digest: mf.Digest
    backing_ino: int


class StepState:
    """What tierfs knows about one step directory beyond its files."""

    def __init__(self, number: int, manifest: mf.StepManifest | None = None) -> None:
        self.number = number
        self.manifest = manifest
        self.dirty = manifest is None
        self.commit_pending = False
        self.lock = trio.Lock()
        self.persisted_version = 0
        self.retired_version = 0
        # Manifest entries whose committed object is in RAM (and counted in the store's refs).
        self.resident: set[str] = {f.name for f in manifest.files} if manifest else set()
        self.replicas: set[str] = set()  # peers that acknowledged this version
        self.holders: set[str] = set()  # peers that told us (gossip) they hold this version

    @property
    def committed(self) -> bool:
        return self.manifest is not None and not self.dirty

    @property
    def state(self) -> str:
        return "committed" if self.committed else "writing"

    @property
    def persisted(self) -> bool:
        return self.committed and self.persisted_version == self.manifest.version

    @property
    def in_ram(self) -> bool:
        return self.manifest is None or len(self.resident) == len(self.manifest.files)


class Node:
    __slots__ = ("ino", "kind", "name", "parent", "children", "lookups", "handles",
                 "active_writers", "gen", "seal", "step", "virtual", "remote", "fetch")

    def __init__(self, ino: int, kind: int, name: bytes, parent: Node | None) -> None:
        self.ino = ino
        self.kind = kind
        self.name = name
        self.parent = parent
        self.children: dict[bytes, Node] | None = {} if kind == stat.S_IFDIR else None
        self.lookups = 0
        self.handles: list[Handle] = []
        self.active_writers = 0
        self.gen = 0
        self.seal: Seal | None = None
        self.step: StepState | None = None
        self.virtual = False
        # A committed file whose bytes are not in RAM: where they are, and the partial copy.
        self.remote: RemoteFile | None = None
        self.fetch: Fetch | None = None

    @property
    def is_dir(self) -> bool:
        return self.kind == stat.S_IFDIR

    @property
    def is_file(self) -> bool:
        return self.kind == stat.S_IFREG


class Handle:
    """An open file: the backing fd and whether it has written since its last flush."""

    __slots__ = ("fh", "node", "fd", "backing_ino", "writable", "active")

    def __init__(self, fh: int, node: Node, fd: int, writable: bool) -> None:
        self.fh = fh
        self.node = node
        self.fd = fd  # -1 while the node's bytes are fetched from another tier
        self.backing_ino = os.fstat(fd).st_ino if fd >= 0 else 0
        self.writable = writable
        self.active = False


class Namespace:
    def __init__(
        self,
        store: RamStore,
        commits: trio.MemorySendChannel[mf.StepManifest],
        *,
        node_id: str = "local",
        step_pattern: str = DEFAULT_STEP_PATTERN,
        keep_ram: int = 3,
        replicas: int = 0,
        read_sources: list[ReadSource] | None = None,
    ) -> None:
        self.store = store
        self.keep_ram = keep_ram
        self.replicas = replicas
        # Injected by the cluster wiring: which peers hold sealed copies of a step's files.
        self.collect_sealed: Callable[[str, set[str]], Awaitable[
            dict[str, tuple[str, mf.FileEntry]]]] | None = None
        self.read_sources = read_sources or []
        self.node_id = node_id
        self.pattern = re.compile(step_pattern)
        self._commits = commits
        self._tree = os.fsencode(store.tree)
        self.root = Node(ROOT_INODE, stat.S_IFDIR, b"", None)
        self._inodes: dict[int, Node] = {ROOT_INODE: self.root}
        self._next_ino = ROOT_INODE + 1
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._latest: dict[int, Node] = {}
        self._released = trio.Event()
        self._hash_limiter = trio.CapacityLimiter(2)
        self._unshare_lock = trio.Lock()

    # -- lookups ---------------------------------------------------------------------------

    def get(self, ino: int) -> Node:
        try:
            return self._inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    def child(self, parent: Node, name: bytes) -> Node:
        """The entry `name` of directory `parent`, including the virtual `latest`."""
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        node = parent.children.get(name)
        if node is not None:
            return node
        if name == LATEST and self._latest_target(parent) is not None:
            return self._latest_node(parent)
        raise FsError(errno.ENOENT)

    def list_dir(self, node: Node) -> list[tuple[bytes, Node]]:
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        entries = list(node.children.items())
        if LATEST not in node.children and self._latest_target(node) is not None:
            # First, so that `rm -r` meets it while it still exists (its unlink is a no-op).
            entries.insert(0, (LATEST, self._latest_node(node)))
        return entries

    @property
    def inode_count(self) -> int:
        return len(self._inodes)

    def remember(self, node: Node) -> None:
        """The kernel now holds one more reference to `node` (lookup count)."""
        node.lookups += 1

    def forget(self, ino: int, count: int) -> None:
        node = self._inodes.get(ino)
        if node is None or ino == ROOT_INODE:
            return
        node.lookups = max(0, node.lookups - count)
        self._maybe_drop(node)

    def backing(self, node: Node) -> bytes:
        """The node's path in the RAM store; ENOENT once it is unlinked."""
        parts = []
        while node.parent is not None:
            if node.virtual:
                raise FsError(errno.ENOENT)
            parts.append(node.name)
            node = node.parent
        if node is not self.root:
            raise FsError(errno.ENOENT)
        return b"/".join([self._tree, *reversed(parts)])

    def relpath(self, node: Node) -> str:
        return os.fsdecode(self.backing(node)[len(self._tree) + 1:])

    def stat(self, node: Node) -> os.stat_result | RemoteAttrs:
        """Attributes of `node` from its backing file (or an open handle once unlinked)."""
        if node.remote is not None:
            return self._remote_attrs(node)
        try:
            return os.lstat(self.backing(node))
        except FsError:
            if node.handles and node.handles[0].fd >= 0:
                return os.fstat(node.handles[0].fd)
            raise

    def _remote_attrs(self, node: Node) -> RemoteAttrs:
        entry = node.remote.entry
        parent = os.lstat(self.backing(node.parent)) if node.parent else None
        return RemoteAttrs(
            st_mode=stat.S_IFREG | entry.mode, st_nlink=1,
            st_uid=parent.st_uid if parent else 0, st_gid=parent.st_gid if parent else 0,
            st_size=entry.size, st_blocks=0, st_atime_ns=entry.mtime_ns,
            st_mtime_ns=entry.mtime_ns, st_ctime_ns=entry.mtime_ns)

    # -- directories -----------------------------------------------------------------------

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        path = self._new_entry_path(parent, name)
        os.mkdir(path, mode & 0o7777)
        _chown(path, uid, gid)
        node = self._attach(parent, name, stat.S_IFDIR)
        number = self.step_number(name)
        if number is not None:
            node.step = StepState(number)
            if parent.step is not None and parent.step.manifest is not None:
                self._remove_hidden(parent, self.backing(parent))  # now a run directory
        self._mark_dirty(parent)
        return node

    def rmdir(self, parent: Node, name: bytes) -> None:
        node = self._existing_entry(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        path = self.backing(node)
        self._remove_hidden(node, path)
        os.rmdir(path)
        self._detach(node)
        self._mark_dirty(parent)

    def symlink(self, parent: Node, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        path = self._new_entry_path(parent, name)
        os.symlink(target, path)
        _chown(path, uid, gid)
        self._mark_dirty(parent)
        return self._attach(parent, name, stat.S_IFLNK)

    def readlink(self, node: Node) -> bytes:
        if node.virtual:
            target = self._latest_target(node.parent)
            if target is None:
                raise FsError(errno.ENOENT)
            return target
        if node.kind != stat.S_IFLNK:
            raise FsError(errno.EINVAL)
        return os.readlink(self.backing(node))

    # -- files -----------------------------------------------------------------------------

    def create(self, parent: Node, name: bytes, mode: int, flags: int, uid: int,
               gid: int) -> tuple[Node, Handle]:
        path = self._new_entry_path(parent, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode & 0o7777)
        try:
            _chown(path, uid, gid)
        except OSError:
            os.close(fd)
            raise
        node = self._attach(parent, name, stat.S_IFREG)
        self.store.set_size(os.fstat(fd).st_ino, 0)
        handle = self._new_handle(node, fd, writable=True)
        self._activate(handle)
        return node, handle

    async def open(self, node: Node, flags: int) -> Handle:
        if node.virtual:
            raise FsError(errno.EROFS)
        if not node.is_file:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        truncate = writable and bool(flags & os.O_TRUNC)
        if node.remote is not None:
            if not writable:
                return self._new_handle(node, -1, writable)  # bytes come on demand: read()
            await self._make_resident(node, empty=truncate)
        if writable:
            await self._make_private(node, keep=not truncate)
        # The path is taken only now: the awaits above may have seen renames.
        fd = os.open(self.backing(node), (os.O_RDWR if writable else os.O_RDONLY))
        handle = self._new_handle(node, fd, writable)
        if truncate:
            os.ftruncate(fd, 0)
            self.store.set_size(handle.backing_ino, 0)
            self._activate(handle)
        return handle

    async def read(self, handle: Handle, offset: int, size: int) -> bytes:
        if handle.fd < 0:
            node = handle.node
            if node.remote is not None:
                return await self._read_remote(node, offset, size)
            handle.fd = os.open(self.backing(node), os.O_RDONLY)  # it became resident
        return os.pread(handle.fd, size, offset)

    def write(self, handle: Handle, offset: int, data: bytes) -> int:
        if not handle.active:
            self._activate(handle)
        self.store.grow(handle.backing_ino, offset + len(data))
        return os.pwrite(handle.fd, data, offset)

    async def flush(self, handle: Handle) -> None:
        """End of a close(): seal what this handle wrote, then fire any commit it completes."""
        if not handle.active:
            return
        node = handle.node
        handle.active = False
        node.active_writers -= 1
        if node.active_writers == 0:
            await self._seal(node)
        self._signal_released()
        await self._after_writer(node)

    async def release(self, handle: Handle) -> None:
        try:
            await self.flush(handle)
        finally:
            del self._handles[handle.fh]
            node = handle.node
            node.handles.remove(handle)
            if handle.fd >= 0:
                orphaned = os.fstat(handle.fd).st_nlink == 0
                os.close(handle.fd)
                if orphaned and not any(h.backing_ino == handle.backing_ino
                                        for h in node.handles):
                    self.store.forget_inode(handle.backing_ino)  # unlinked while open
            self._maybe_drop(node)

    def fsync(self, handle: Handle) -> None:
        if handle.fd >= 0:
            os.fsync(handle.fd)

    async def unlink(self, parent: Node, name: bytes) -> None:
        if name == LATEST and parent.is_dir and LATEST not in parent.children:
            # The virtual `latest` is derived, not stored: removing it is a no-op, so that
            # `rm -r run1` works; it names the newest committed step again on the next lookup.
            return
        node = self._existing_entry(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if node.remote is None:
            self._unlink_backing(self.backing(node), node)
        self._drop_fetch(node)
        self._detach(node)
        self._mark_dirty(parent)
        await self._run_pending_commits(parent)

    async def setattr(
        self, node: Node, handle: Handle | None, *, mode: int | None = None,
        uid: int | None = None, gid: int | None = None, size: int | None = None,
        atime_ns: int | None = None, mtime_ns: int | None = None,
    ) -> None:
        if node.virtual:
            raise FsError(errno.EROFS)
        if node.remote is not None:
            await self._make_resident(node, empty=size == 0)
        target: bytes | int
        try:
            target = self.backing(node)
        except FsError:
            if handle is None:
                raise
            target = handle.fd
        if size is not None:
            await self._truncate(node, handle, target, size)
        if mode is not None and node.kind != stat.S_IFLNK:
            os.chmod(target, mode & 0o7777)
        if uid is not None or gid is not None:
            os.chown(target, -1 if uid is None else uid, -1 if gid is None else gid,
                     follow_symlinks=False)
        if atime_ns is not None or mtime_ns is not None:
            st = os.lstat(target) if isinstance(target, bytes) else os.fstat(target)
            times = (st.st_atime_ns if atime_ns is None else atime_ns,
                     st.st_mtime_ns if mtime_ns is None else mtime_ns)
            if isinstance(target, bytes):
                os.utime(target, ns=times, follow_symlinks=False)
            else:
                os.utime(target, ns=times)

    async def _truncate(self, node: Node, handle: Handle | None, target: bytes | int,
                        size: int) -> None:
        if not node.is_file:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)
        if isinstance(target, bytes):
            await self._make_private(node, keep=size > 0)
            target = self.backing(node)
            self.store.set_size(os.lstat(target).st_ino, size)
            os.truncate(target, size)
        else:
            self.store.set_size(os.fstat(target).st_ino, size)
            os.ftruncate(target, size)
        if handle is not None and handle.active:
            return
        node.gen += 1
        node.seal = None
        self._mark_dirty(node.parent)

    # -- rename ----------------------------------------------------------------------------

    async def rename(self, old_parent: Node, old_name: bytes, new_parent: Node,
                     new_name: bytes, flags: int) -> None:
        if flags & ~_RENAME_NOREPLACE:
            raise FsError(errno.EINVAL)  # RENAME_EXCHANGE and friends: not supported
        node = self._existing_entry(old_parent, old_name)
        self._check_new_name(new_name)
        if node.remote is not None:
            await self._make_resident(node, empty=False)
        if not new_parent.is_dir:
            raise FsError(errno.ENOTDIR)
        target = new_parent.children.get(new_name)
        if target is node:
            return
        if target is not None:
            if flags & _RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if node.is_dir and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if target.is_dir and not node.is_dir:
                raise FsError(errno.EISDIR)
            if target.is_dir and target.children:
                raise FsError(errno.ENOTEMPTY)
        if node.is_dir and self._is_ancestor(node, new_parent):
            raise FsError(errno.EINVAL)
        old_path = self.backing(node)
        new_path = os.path.join(self.backing(new_parent), new_name)
        if target is not None:
            if target.is_dir:
                self._remove_hidden(target, new_path)
            elif target.remote is None:
                self._forget_backing_if_last(new_path, target)
        os.rename(old_path, new_path)
        if target is not None:
            self._detach(target)
        self._mark_dirty(old_parent)
        del old_parent.children[old_name]
        node.name = new_name
        node.parent = new_parent
        new_parent.children[new_name] = node
        self._mark_dirty(new_parent)
        if (node.is_dir and node.step is not None and new_parent.step is not None
                and new_parent.step.manifest is not None):
            self._remove_hidden(new_parent, self.backing(new_parent))  # now a run directory
        if node.is_dir:
            await self._renamed_dir(node)
        elif new_name == METADATA and self.step_of(new_parent) is not None:
            await self._commit_quietly(new_parent)
        await self._run_pending_commits(old_parent)

    async def _renamed_dir(self, node: Node) -> None:
        """A directory renamed onto a step name commits it (the `mv tmp step_N` idiom); one
        renamed away from a step name stops being a step; steps moved along with it commit
        again so that their manifests name where they are now."""
        number = self.step_number(node.name)
        if number is None:
            if node.step is not None:
                await self._demote(node)
                node.step = None
        else:
            if node.step is None:
                node.step = StepState(number, self._read_manifest(self.backing(node)))
            node.step.number = number
            node.step.dirty = True  # whatever it held before, it is committed only once more
            if self.step_of(node) is not None:
                await self._commit_quietly(node)
        for step_node in list(self.steps(under=node)):
            manifest = step_node.step.manifest
            if step_node is not node and manifest and manifest.path != self.relpath(step_node):
                await self._commit_quietly(step_node)

    async def _demote(self, node: Node) -> None:
        """A committed directory that stops being a step keeps its files, not its manifest."""
        for _rel, child in list(self._files_under(node)):
            if child.remote is not None:
                await self._make_resident(child, empty=False)
        self._remove_hidden(node, self.backing(node))

    # -- steps and commit ------------------------------------------------------------------

    async def commit(self, step_node: Node, *, wait_for_writers: bool) -> mf.StepManifest | None:
        """Commit `step_node` now; with writers still open either wait or leave it pending.

        Returns the manifest in force after the commit, or None when left pending.
        """
        step = self.step_of(step_node)
        if step is None:
            raise FsError(errno.EINVAL, "not a step directory")
        started = time.monotonic()
        async with step.lock:
            while True:
                released = self._released
                if self._has_active_writers(step_node):
                    if not wait_for_writers:
                        step.commit_pending = True
                        log.info("commit of %s waits for open writers", self.relpath(step_node))
                        return None
                    await released.wait()
                    continue
                if not await self._pull_missing_dcp_files(step_node):
                    step.commit_pending = True  # retried by retry_pending_commits
                    return None
                files = list(self._files_under(step_node))
                for _rel, node in files:
                    if node.remote is not None:
                        await self._make_resident(node, empty=False)
                    if node.seal is None:
                        await self._seal(node)
                copies = await self._copies_of_open_files(files)
                # From here to the end of _write_manifest there is no await (see module doc).
                if (self._has_active_writers(step_node)
                        or self.step_of(step_node) is not step or step_node.parent is None
                        or files != list(self._files_under(step_node))
                        or any(node.seal is None or node.remote for _rel, node in files)
                        or any(node.gen != gen for node, (_copy, gen) in copies.items())):
                    for copy, _gen in copies.values():
                        self.store.discard(copy)
                    if self.step_of(step_node) is not step or step_node.parent is None:
                        return None  # renamed away or removed while it was being sealed
                    continue
                old = step.manifest
                manifest = self._write_manifest(step_node, files,
                                                {n: c for n, (c, _g) in copies.items()})
                step.commit_pending = False
                break
        if manifest is not old:
            log.info("committed %s v%d: %d files, %d bytes in %.3f s", manifest.path,
                     manifest.version, len(manifest.files), manifest.total_bytes,
                     time.monotonic() - started)
            await self._commits.send(manifest)
        return manifest

    async def commit_path(self, relpath: str) -> mf.StepManifest:
        """`tierfs commit PATH`: commit the step directory at `relpath`, waiting for writers."""
        node = self.root
        for part in (p for p in relpath.split("/") if p not in ("", ".")):
            node = self.child(node, os.fsencode(part))
        if not node.is_dir or node.virtual:
            raise FsError(errno.ENOTDIR, f"{relpath} is not a directory")
        if self.step_of(node) is None:
            raise FsError(errno.EINVAL,
                          f"{relpath} is not a step directory (its name does not match "
                          f"--step-pattern {self.pattern.pattern!r}, or it holds step "
                          "directories itself)")
        manifest = await self.commit(node, wait_for_writers=True)
        assert manifest is not None
        return manifest

    async def _copies_of_open_files(self, files: list[tuple[str, Node]]
                                    ) -> dict[Node, tuple[bytes, int]]:
        """Private copies, for the objects, of files that a handle could still write into."""
        copies = {}
        for _rel, node in files:
            if any(h.writable for h in node.handles) and \
                    not self.store.object_path(node.seal.digest.xxh3).exists():
                gen = node.gen
                self.store.check_room(node.seal.digest.size)
                copy = await trio.to_thread.run_sync(
                    self.store.copy, self.backing(node), os.fsencode(self.store.objects),
                    node.seal.digest.size)
                self.store.account(os.lstat(copy).st_ino, node.seal.digest.size)
                copies[node] = (copy, gen)
        return copies

    def _write_manifest(self, step_node: Node, files: list[tuple[str, Node]],
                        copies: dict[Node, bytes]) -> mf.StepManifest:
        step = step_node.step
        old = step.manifest
        step_path = self.relpath(step_node)
        dir_path = self.backing(step_node)
        entries = []
        for rel, node in files:
            st = os.lstat(self.backing(node))
            digest = node.seal.digest
            entries.append(mf.FileEntry(rel, digest.size, digest.xxh3, st.st_mtime_ns,
                                        st.st_mode & 0o7777, digest.chunks))
        if (old is not None and old.path == step_path and old.step == step.number
                and old.same_content(mf.StepManifest(step_path, 0, 1, "", 0, tuple(entries)))):
            for copy in copies.values():
                self.store.discard(copy)
            step.dirty = False
            return old
        manifest = mf.StepManifest(
            path=step_path, step=step.number, version=old.version + 1 if old else 1,
            node_id=self.node_id, committed_ns=time.time_ns(), files=tuple(entries),
        )
        encoded = mf.encode(manifest)
        for (_rel, node), entry in zip(files, entries, strict=True):
            self.store.add_ref(entry.xxh3, self.backing(node), copies.pop(node, None))
        self._write_file_atomically(os.path.join(dir_path, MANIFEST), encoded)
        self._drop_resident_refs(step)
        step.manifest = manifest
        step.resident = {entry.name for entry in entries}
        step.dirty = False
        return manifest

    async def _commit_quietly(self, step_node: Node) -> None:
        """Commit triggered as a side effect of a user's call: failures are logged, not raised."""
        try:
            await self.commit(step_node, wait_for_writers=False)
        except (OSError, FsError) as exc:
            log.error("commit of %s failed: %s", self.relpath(step_node), exc)

    async def _after_writer(self, node: Node) -> None:
        """A writer of `node` is done: a `.metadata` closed after writing, or a pending commit
        whose last writer this was, commits its step now."""
        parent = node.parent
        if parent is None:
            return
        if node.name == METADATA and self.step_of(parent) is not None:
            await self._commit_quietly(parent)
        await self._run_pending_commits(parent)

    async def _run_pending_commits(self, dir_node: Node | None) -> None:
        for step_node in list(self._enclosing_steps(dir_node)):
            if step_node.step.commit_pending and not self._has_active_writers(step_node):
                await self._commit_quietly(step_node)

    async def _seal(self, node: Node) -> None:
        """Hash the node's content in a thread; keep the seal only if nothing wrote meanwhile."""
        gen = node.gen
        try:
            fd = os.open(self.backing(node), os.O_RDONLY)
        except FsError:
            return
        try:
            digest = await trio.to_thread.run_sync(mf.hash_fd, fd, limiter=self._hash_limiter)
            backing_ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        if node.gen == gen and node.active_writers == 0:
            node.seal = Seal(digest, backing_ino)

    def _has_active_writers(self, dir_node: Node) -> bool:
        return any(node.active_writers for _rel, node in self._files_under(dir_node))

    def _files_under(self, dir_node: Node, prefix: str = "") -> Iterator[tuple[str, Node]]:
        for name, node in sorted(dir_node.children.items()):
            rel = prefix + os.fsdecode(name)
            if node.is_file:
                yield rel, node
            elif node.is_dir:
                yield from self._files_under(node, rel + "/")

    def _enclosing_steps(self, node: Node | None) -> Iterator[Node]:
        while node is not None:
            if node.step is not None:
                yield node
            node = node.parent

    def _mark_dirty(self, node: Node | None) -> None:
        for step_node in self._enclosing_steps(node):
            step_node.step.dirty = True

    def step_of(self, node: Node) -> StepState | None:
        """The node's step state if it is a step directory. A directory whose name matches but
        that holds step directories itself (`run1/step_100`) is a run directory, not a step."""
        if node.step is None or any(c.step is not None for c in node.children.values()):
            return None
        return node.step

    def step_number(self, name: bytes | str) -> int | None:
        """The step number a directory name carries, or None if it is not a step name."""
        match = self.pattern.match(os.fsdecode(name))
        if match is None:
            return None
        try:
            return int(match.group(1))
        except (IndexError, TypeError, ValueError):
            return None

    def _latest_target(self, dir_node: Node) -> bytes | None:
        best: tuple[int, bytes] | None = None
        for name, node in dir_node.children.items():
            step = self.step_of(node) if node.is_dir else None
            if step is not None and step.committed:
                key = (node.step.number, name)
                if best is None or key > best:
                    best = key
        return None if best is None else best[1]

    def _latest_node(self, dir_node: Node) -> Node:
        node = self._latest.get(dir_node.ino)
        if node is None:
            node = Node(self._new_ino(), stat.S_IFLNK, LATEST, dir_node)
            node.virtual = True
            self._latest[dir_node.ino] = node
            self._inodes[node.ino] = node
        return node

    # -- status and xattrs -----------------------------------------------------------------

    def steps(self, under: Node | None = None) -> Iterator[Node]:
        """Every step directory (below `under`, itself included), depth first."""
        stack = [under or self.root]
        while stack:
            node = stack.pop()
            if self.step_of(node) is not None:
                yield node
            stack.extend(c for c in node.children.values() if c.is_dir)

    def step_status(self, step_node: Node) -> dict[str, object]:
        step = step_node.step
        if step.committed:
            files, size = len(step.manifest.files), step.manifest.total_bytes
        else:
            sizes = [self.stat(n).st_size for _rel, n in self._files_under(step_node)]
            files, size = len(sizes), sum(sizes)
        ram_bytes = size if not step.committed else sum(
            step.manifest.entry(name).size for name in step.resident)
        return {
            "path": self.relpath(step_node), "step": step.number, "state": step.state,
            "ram_bytes": ram_bytes,
            "version": step.manifest.version if step.manifest else 0,
            "files": files, "bytes": size, "ram": step.in_ram,
            "replicas": self._peer_holders(step),
            "persisted": step.persisted,
        }

    def xattr_names(self, node: Node) -> list[bytes]:
        if node.virtual:
            return []
        names = []
        if node.is_dir and self.step_of(node) is not None:
            names += [XATTR_STATE, XATTR_TIERS]
        elif node.is_file:
            names.append(XATTR_TIERS)
            if node.seal is not None or node.active_writers == 0:
                names.append(XATTR_XXH3)
        return names

    async def xattr(self, node: Node, name: bytes) -> bytes:
        if name not in self.xattr_names(node):
            raise FsError(_ENOATTR)
        if name == XATTR_STATE:
            return node.step.state.encode()
        if name == XATTR_TIERS:
            if node.is_dir:
                step = self.step_of(node)
                return self._tiers(step, step.in_ram).encode()
            step = self._committed_step_holding(node)
            if step is None:
                return b"ram"
            return self._tiers(step, node.remote is None).encode()
        if node.remote is not None:
            return node.remote.entry.xxh3.encode()
        if node.seal is None:
            await self._seal(node)  # sealed before a restart; the hash is recomputed once
        if node.seal is None:
            raise FsError(_ENOATTR)
        return node.seal.digest.xxh3.encode()

    # -- residency: committed files whose bytes live in another tier ------------------------

    async def _read_remote(self, node: Node, offset: int, size: int) -> bytes:
        fetch = self._fetch_of(node)
        try:
            data = await fetch.read(self.read_sources, offset, size)
        except FetchError as exc:
            log.error("read of %s failed: %s", self.relpath(node), exc)
            raise FsError(errno.EIO) from None
        if fetch.complete and node.fetch is fetch:
            await self._adopt(node, fetch)
        return data

    def _fetch_of(self, node: Node) -> Fetch:
        if node.fetch is None:
            node.fetch = Fetch(self.store, node.remote)
        return node.fetch

    def _drop_fetch(self, node: Node) -> None:
        if node.fetch is not None:
            node.fetch.discard()
            node.fetch = None

    async def _make_resident(self, node: Node, *, empty: bool) -> None:
        """Bring a non-resident file into RAM before it changes: whole, or as an empty file."""
        if node.remote is None:
            return
        if empty:
            path = self.backing(node)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             node.remote.entry.mode))
            self._drop_fetch(node)
            node.remote = None
            self._mark_dirty(node.parent)
            return
        fetch = self._fetch_of(node)
        try:
            await fetch.fill(self.read_sources)
        except FetchError as exc:
            log.error("fetch of %s failed: %s", self.relpath(node), exc)
            raise FsError(errno.EIO) from None
        if node.fetch is fetch:
            await self._adopt(node, fetch)
        if node.remote is not None:
            raise FsError(errno.EIO)

    async def _adopt(self, node: Node, fetch: Fetch) -> None:
        """A complete fetch that matches its xxh3-128 becomes the file's committed object."""
        good = await fetch.verify()
        if node.fetch is not fetch or node.remote is None:
            return  # unlinked or evicted meanwhile
        node.fetch = None
        if not good:
            fetch.discard()
            raise FsError(errno.EIO)
        path = self.backing(node)
        tmp = self.store.tmp_path(os.path.dirname(path))
        os.link(fetch.path, tmp)
        os.rename(tmp, path)
        os.close(fetch.fd)
        os.unlink(fetch.path)
        entry = node.remote.entry
        node.remote = None
        node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks), fetch.backing_ino)
        step = self._committed_step_holding(node)
        if step is not None and entry.name not in step.resident:
            self.store.add_ref(entry.xxh3, path)
            step.resident.add(entry.name)
        log.info("%s is back in RAM (%d bytes, verified)", self.relpath(node), entry.size)

    def enforce_keep_ram(self) -> None:
        """Evict steps beyond the newest `keep_ram` of each run directory that are safe
        elsewhere: persisted, or (for the node that wrote them) held by `replicas` peers. A
        replica this node holds for another leaves only once persisted: so the last copy in
        the cluster never leaves RAM unless it is persisted."""
        by_run: dict[int, list[Node]] = {}
        for node in self.steps():
            by_run.setdefault(node.parent.ino, []).append(node)
        for step_nodes in by_run.values():
            committed = sorted((n for n in step_nodes if n.step.committed),
                               key=lambda n: n.step.number, reverse=True)
            for node in committed[self.keep_ram:]:
                if self._safe_elsewhere(node.step) and not self._busy(node) and (
                        node.step.resident or self._has_partial_fetches(node)):
                    self._evict(node)

    def _safe_elsewhere(self, step: StepState) -> bool:
        if step.persisted:
            return True
        owned = step.manifest.node_id == self.node_id
        return owned and self.replicas > 0 and len(step.replicas) >= self.replicas

    def _busy(self, step_node: Node) -> bool:
        return any(n.handles or (n.fetch and n.fetch.busy)
                   for _rel, n in self._files_under(step_node))

    def _evict(self, step_node: Node) -> None:
        """Drop a persisted step's bytes from RAM; it stays listed and readable.

        Tree files go first, objects second: a crash in between leaves objects that start-up
        links back (resident), or none (the step is read from the persistent tier)."""
        step = step_node.step
        manifest = step.manifest
        freed = 0
        for rel, node in self._files_under(step_node):
            if node.fetch is not None:
                freed += sum(node.fetch.present) * mf.CHUNK_SIZE
                self._drop_fetch(node)  # ranges read on demand leave with the step
            entry = manifest.entry(rel)
            if entry is not None and node.remote is None:
                self._unlink_backing(self.backing(node), node)
                node.remote = RemoteFile(manifest.path, entry)
                node.seal = None
                freed += entry.size
        self._drop_resident_refs(step)
        log.info("evicted %s v%d from RAM (%d bytes); it stays readable from %s",
                 self.relpath(step_node), manifest.version, freed,
                 "the persistent tier" if step.persisted else
                 "peers " + ", ".join(sorted(step.replicas)))

    async def prefetch(self, relpath: str) -> int:
        """`tierfs prefetch`: bring every file of a committed step into RAM; bytes fetched."""
        step_node = self.find_step(relpath)
        if step_node is None or not step_node.step.committed:
            raise FsError(errno.EINVAL, f"{relpath} is not a committed step")
        fetched = 0
        for _rel, node in list(self._files_under(step_node)):
            if node.remote is not None:
                size = node.remote.entry.size
                await self._make_resident(node, empty=False)
                fetched += size
        return fetched

    def _has_partial_fetches(self, step_node: Node) -> bool:
        return any(n.fetch is not None for _rel, n in self._files_under(step_node))

    def _drop_resident_refs(self, step: StepState) -> None:
        if step.manifest is not None:
            for name in step.resident:
                self.store.drop_ref(step.manifest.entry(name).xxh3)
        step.resident = set()

    # -- the persistent tier's view --------------------------------------------------------

    def find_step(self, relpath: str) -> Node | None:
        node = self.root
        try:
            for part in relpath.split("/"):
                node = self.child(node, os.fsencode(part))
        except FsError:
            return None
        return node if node.is_dir and self.step_of(node) is not None else None

    def is_current(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is still the committed version of its step (worth uploading)."""
        node = self.find_step(manifest.path)
        return node is not None and node.step.manifest is manifest

    def committed_manifests(self) -> list[mf.StepManifest]:
        """Committed steps in RAM whose version has not reached the persistent tier."""
        found = []
        for node in self.steps():
            step = node.step
            if step.committed and not step.persisted and step.in_ram and \
                    step.manifest.node_id == self.node_id and \
                    step.retired_version != step.manifest.version:
                found.append(step.manifest)
        return sorted(found, key=lambda m: (m.step, m.path))

    def mark_persisted(self, manifest: mf.StepManifest) -> None:
        node = self.find_step(manifest.path)
        if node is not None and node.step.manifest is manifest:
            self._write_persist_mark(node, manifest.version, "persisted")
            node.step.persisted_version = manifest.version
            self.enforce_keep_ram()

    def mark_retired(self, relpath: str) -> None:
        """Retention removed the step from the persistent tier: never upload it again."""
        node = self.find_step(relpath)
        if node is None or node.step.manifest is None:
            return
        if not node.step.in_ram and not node.step.dirty:
            self._forget_step(node)  # both policies let it go: it is gone from tierfs
            return
        version = node.step.manifest.version
        self._write_persist_mark(node, version, "retired")
        node.step.persisted_version = 0
        node.step.retired_version = version

    def _forget_step(self, step_node: Node) -> None:
        for _rel, node in list(self._files_under(step_node)):
            if node.remote is None:
                self._unlink_backing(self.backing(node), node)
            self._drop_fetch(node)
            self._detach(node)
        self._drop_resident_refs(step_node.step)
        shutil.rmtree(self.backing(step_node))
        self._detach_tree(step_node)
        log.info("%s left the last tier that held it", os.fsdecode(step_node.name))

    def _detach_tree(self, node: Node) -> None:
        for child in list((node.children or {}).values()):
            self._detach_tree(child)
        self._detach(node)

    def _write_persist_mark(self, node: Node, version: int, state: str) -> None:
        path = os.path.join(self.backing(node), PERSISTED_MARK)
        self._write_file_atomically(path, f"{version} {state}\n".encode())

    def _write_file_atomically(self, path: bytes, data: bytes) -> None:
        tmp = path + b".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)

    def _persist_mark(self, dir_path: bytes) -> tuple[int, str] | None:
        try:
            with open(os.path.join(dir_path, PERSISTED_MARK)) as f:
                version_text, state = f.read().split()
            return int(version_text), state
        except (FileNotFoundError, ValueError):
            return None

    def _apply_persist_mark(self, step: StepState, dir_path: bytes) -> None:
        mark = self._persist_mark(dir_path)
        if step.manifest is None or mark is None or mark[0] != step.manifest.version:
            return
        if mark[1] == "persisted":
            step.persisted_version = mark[0]
        elif mark[1] == "retired":
            step.retired_version = mark[0]

    def _apply_node_marks(self, step: StepState, dir_path: bytes) -> None:
        if step.manifest is not None:
            version = step.manifest.version
            step.replicas = self._read_node_list(dir_path, REPLICAS_MARK, version) or set()
            step.holders = self._read_node_list(dir_path, PEERS_MARK, version) or set()

    @staticmethod
    def _read_node_list(dir_path: bytes, mark: bytes, version: int) -> set[str] | None:
        """The node ids a mark file records for `version`, or None if it records none."""
        try:
            with open(os.path.join(dir_path, mark)) as f:
                recorded, *nodes = f.read().split()
        except (FileNotFoundError, ValueError):
            return None
        return set(nodes) if recorded == str(version) else None

    def _write_node_list(self, step_node: Node, mark: bytes, nodes: set[str]) -> None:
        line = " ".join([str(step_node.step.manifest.version), *sorted(nodes)])
        self._write_file_atomically(os.path.join(self.backing(step_node), mark), line.encode())

    def _peer_holders(self, step: StepState) -> list[str]:
        """Other nodes known to hold the committed version: replicas of ours, or the owner."""
        if not step.committed:
            return []
        known = step.replicas | step.holders
        if step.manifest.node_id != self.node_id:
            known = known | {step.manifest.node_id}
        return sorted(known - {self.node_id})

    def _tiers(self, step: StepState, in_ram: bool) -> str:
        tiers = ["ram"] if in_ram else []
        tiers += [f"peer:{peer}" for peer in self._peer_holders(step)]
        if step.persisted:
            tiers.append("persist")
        return ",".join(tiers)

    def _committed_step_holding(self, node: Node) -> StepState | None:
        for step_node in self._enclosing_steps(node if node.is_dir else node.parent):
            step = self.step_of(step_node)
            if step is not None:
                return step if step.committed else None
        return None

    # -- start-up: recovery and loading ----------------------------------------------------

    def load(self) -> None:
        """Rebuild the namespace from the RAM store after a restart or a crash.

        Committed steps are put back exactly as their manifests say (uncommitted writes into a
        committed step are dropped); files of persisted steps that left RAM come back as
        non-resident; leftovers of interrupted saves, fetches and commits are removed.
        """
        started = time.monotonic()
        tmp_removed = self.store.remove_tmp_files()
        recovered = self._recover_committed_steps()
        self._load_dir(self.root, self._tree, recovered)
        for manifest, resident in recovered.values():
            for entry in manifest.files:
                if entry.name in resident:
                    self.store.count_ref(entry.xxh3)
        garbage = self.store.collect_garbage()
        self.store.scan_usage()
        log.info("loaded RAM store %s: %d committed steps, %d bytes; removed %d temporary "
                 "files and %d unreferenced objects in %.2f s", self.store.root, len(recovered),
                 self.store.used_bytes, tmp_removed, garbage, time.monotonic() - started)

    def _recover_committed_steps(self) -> dict[bytes, tuple[mf.StepManifest, set[str]]]:
        recovered: dict[bytes, tuple[mf.StepManifest, set[str]]] = {}
        for dirpath, dirs, files in os.walk(self._tree):
            if MANIFEST not in files:
                continue
            if (self.step_number(os.path.basename(dirpath)) is None
                    or any(self.step_number(d) is not None for d in dirs)):
                # Not a step (any more): its files are plain files, its manifest is stale.
                os.unlink(os.path.join(dirpath, MANIFEST))
                continue
            manifest = self._read_manifest(dirpath)
            if manifest is None:
                continue
            held_elsewhere = (
                self._persist_mark(dirpath) == (manifest.version, "persisted")
                or self._read_node_list(dirpath, PEERS_MARK, manifest.version) is not None)
            try:
                resident = self._restore_step(dirpath, manifest, held_elsewhere)
            except OSError as exc:
                log.error("cannot restore step %s v%d (%s); its manifest is set aside",
                          manifest.path, manifest.version, exc)
                self._set_aside(dirpath)
                continue
            if resident is not None:
                recovered[dirpath] = (manifest, resident)
        return recovered

    def _set_aside(self, dir_path: bytes) -> None:
        manifest_path = os.path.join(dir_path, MANIFEST)
        os.rename(manifest_path, manifest_path + b".damaged")

    def _read_manifest(self, dir_path: bytes) -> mf.StepManifest | None:
        path = os.path.join(dir_path, MANIFEST)
        try:
            with open(path, "rb") as f:
                return mf.decode(f.read())
        except FileNotFoundError:
            return None
        except mf.ManifestError as exc:
            log.error("unreadable manifest %s set aside: %s", os.fsdecode(path), exc)
            os.rename(path, path + b".damaged")
            return None

    def _restore_step(self, dir_path: bytes, manifest: mf.StepManifest,
                      persisted: bool) -> set[str] | None:
        """Put the tree of a committed step back as its manifest says; return the names whose
        objects are in RAM, or None if the step is damaged (a file neither here nor persisted).
        """
        resident = set()
        for entry in manifest.files:
            try:
                size = os.lstat(self.store.object_path(entry.xxh3)).st_size
            except FileNotFoundError:
                size = -1
            if size == entry.size:
                resident.add(entry.name)
            elif not persisted:
                log.error("committed step %s v%d is damaged: object of %s is missing or has "
                          "the wrong size; its manifest is set aside", manifest.path,
                          manifest.version, entry.name)
                self._set_aside(dir_path)
                return None
        restored = removed = 0
        wanted = {os.fsencode(name) for name in resident}
        for dirpath, dirs, files in os.walk(dir_path):
            dirs[:] = [d for d in dirs if self.step_number(d) is None]
            for name in files:
                full = os.path.join(dirpath, name)
                if (not is_reserved(name) and stat.S_ISREG(os.lstat(full).st_mode)
                        and os.path.relpath(full, dir_path) not in wanted):
                    os.unlink(full)  # written after the commit: not part of the step
                    removed += 1
        for entry in manifest.files:
            if entry.name not in resident:
                continue
            path = os.path.join(dir_path, os.fsencode(entry.name))
            obj = os.fsencode(self.store.object_path(entry.xxh3))
            try:
                if os.path.samefile(path, obj):
                    continue
            except FileNotFoundError:
                pass
            self._clear_way(dir_path, os.fsencode(entry.name))
            tmp = self.store.tmp_path(os.path.dirname(path))
            os.link(obj, tmp)
            os.rename(tmp, path)
            restored += 1
        if restored or removed:
            log.warning("step %s v%d put back as committed: %d files restored, %d uncommitted "
                        "files removed", manifest.path, manifest.version, restored, removed)
        return resident

    @staticmethod
    def _clear_way(dir_path: bytes, relative: bytes) -> None:
        """Make room for a committed file at `relative`: what was put in its place or in the
        place of one of its directories after the commit goes."""
        current = dir_path
        *parents, name = relative.split(b"/")
        for part in parents:
            current = os.path.join(current, part)
            if os.path.lexists(current) and not os.path.isdir(current):
                os.unlink(current)
            os.makedirs(current, exist_ok=True)
        target = os.path.join(current, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)

    def _load_dir(self, dir_node: Node, path: bytes,
                  recovered: dict[bytes, tuple[mf.StepManifest, set[str]]]) -> None:
        with os.scandir(path) as entries:
            for entry in entries:
                if is_reserved(entry.name):
                    continue
                st = entry.stat(follow_symlinks=False)
                kind = stat.S_IFMT(st.st_mode)
                if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
                    continue
                node = self._attach(dir_node, entry.name, kind)
                if kind == stat.S_IFDIR:
                    self._load_dir(node, entry.path, recovered)
                    number = self.step_number(entry.name)
                    if number is not None:
                        manifest, resident = recovered.get(entry.path, (None, set()))
                        node.step = StepState(number, manifest)
                        node.step.resident = resident
                        self._apply_persist_mark(node.step, entry.path)
                        self._apply_node_marks(node.step, entry.path)
                        self._seal_from_manifest(node)

    def _seal_from_manifest(self, step_node: Node) -> None:
        step = step_node.step
        if step.manifest is None:
            return
        for rel, node in self._files_under(step_node):
            entry = step.manifest.entry(rel)
            if entry is not None:
                ino = os.lstat(self.backing(node)).st_ino
                node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks), ino)
        self._add_remote_files(step_node, [e for e in step.manifest.files
                                           if e.name not in step.resident])

    def _add_remote_files(self, step_node: Node, entries: list[mf.FileEntry],
                          step_path: str | None = None) -> None:
        """Nodes for committed files whose bytes are in another tier (with their directories)."""
        manifest_path = step_path or step_node.step.manifest.path
        for entry in entries:
            *dirs, name = entry.name.split("/")
            parent = step_node
            for part in map(os.fsencode, dirs):
                child = parent.children.get(part)
                if child is None:
                    os.makedirs(os.path.join(self.backing(parent), part), exist_ok=True)
                    child = self._attach(parent, part, stat.S_IFDIR)
                parent = child
            node = parent.children.get(os.fsencode(name))
            if node is None:
                node = self._attach(parent, os.fsencode(name), stat.S_IFREG)
            node.remote = RemoteFile(manifest_path, entry)

    def adopt_persisted(self, manifest: mf.StepManifest) -> bool:
        """Show a step found in the persistent tier (a fresh node, or one that left RAM).

        A step this node already has, in any state, is left as it is. Returns whether the step
        was added."""
        node = self.find_step(manifest.path)
        if node is not None:
            step = node.step
            if (step.manifest is not None and step.manifest.version == manifest.version
                    and step.manifest.same_content(manifest) and not step.persisted):
                self._write_persist_mark(node, manifest.version, "persisted")
                step.persisted_version = manifest.version
            return False
        step_node = self._install_step(manifest, "the persistent tier")
        if step_node is None:
            return False
        self._write_persist_mark(step_node, manifest.version, "persisted")
        step_node.step.persisted_version = manifest.version
        self._add_remote_files(step_node, list(manifest.files))
        return True

    def adopt_replica(self, manifest: mf.StepManifest, sender: str) -> bool:
        """Install a replica whose files a peer has sent and this node has verified (they are
        committed objects here already). A step this node already has is left as it is."""
        existing = self.find_step(manifest.path)
        if existing is not None:
            step = existing.step
            if step.manifest is not None and step.manifest.version == manifest.version:
                self._fill_from_objects(existing)  # e.g. a multi-node DCP step held in part
            return False
        step_node = self._install_step(manifest, f"node {sender}")
        if step_node is None:
            return False
        # The manifest is on disk first: a crash from here on is repaired by _restore_step.
        step = step_node.step
        for entry in manifest.files:
            *dirs, name = entry.name.split("/")
            parent = step_node
            for part in map(os.fsencode, dirs):
                child = parent.children.get(part)
                if child is None:
                    os.makedirs(os.path.join(self.backing(parent), part), exist_ok=True)
                    child = self._attach(parent, part, stat.S_IFDIR)
                parent = child
            path = os.path.join(self.backing(parent), os.fsencode(name))
            tmp = self.store.tmp_path(os.path.dirname(path))
            os.link(self.store.object_path(entry.xxh3), tmp)
            os.chmod(tmp, entry.mode)
            os.rename(tmp, path)
            node = self._attach(parent, os.fsencode(name), stat.S_IFREG)
            node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks),
                             os.lstat(path).st_ino)
            self.store.add_ref(entry.xxh3, path)
            step.resident.add(entry.name)
        log.info("holding a replica of %s v%d from %s (%d files, %d bytes)", manifest.path,
                 manifest.version, sender, len(manifest.files), manifest.total_bytes)
        return True

    def _fill_from_objects(self, step_node: Node) -> None:
        """Files of this step that are not resident but whose objects are here become
        resident (a replica sent them)."""
        step = step_node.step
        for _rel, node in self._files_under(step_node):
            if node.remote is None or node.fetch is not None:
                continue
            entry = node.remote.entry
            obj = self.store.object_path(entry.xxh3)
            if not obj.exists():
                continue
            path = self.backing(node)
            tmp = self.store.tmp_path(os.path.dirname(path))
            os.link(obj, tmp)
            os.rename(tmp, path)
            node.remote = None
            node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks),
                             os.lstat(path).st_ino)
            if entry.name not in step.resident:
                self.store.add_ref(entry.xxh3, path)
                step.resident.add(entry.name)

    def _install_step(self, manifest: mf.StepManifest, source: str) -> Node | None:
        """The directories of a step committed elsewhere, and its manifest, written first."""
        parent = self.root
        for part in map(os.fsencode, manifest.path.split("/")):
            child = parent.children.get(part)
            if child is None:
                os.mkdir(os.path.join(self.backing(parent), part), 0o755)
                child = self._attach(parent, part, stat.S_IFDIR)
                number = self.step_number(part)
                if number is not None:
                    child.step = StepState(number)
            elif not child.is_dir:
                log.warning("step %s from %s is hidden by a file here", manifest.path, source)
                return None
            parent = child
        step = self.step_of(parent)
        if step is None or step.manifest is not None or parent.children:
            log.warning("step %s from %s does not fit this namespace (step pattern, or a "
                        "directory of that name in use)", manifest.path, source)
            return None
        self._write_file_atomically(os.path.join(self.backing(parent), MANIFEST),
                                    mf.encode(manifest))
        step.manifest = manifest
        step.dirty = False
        step.resident = set()
        return parent

    # -- replicas (the owner's view) --------------------------------------------------------

    def replica_holders(self, manifest: mf.StepManifest) -> set[str]:
        """Peers known to hold this version (replicas, the writer, gossip)."""
        node = self.find_step(manifest.path)
        if node is None or node.step.manifest is not manifest:
            return set()
        return set(self._peer_holders(node.step))

    def mark_replicated(self, manifest: mf.StepManifest, peer: str) -> None:
        node = self.find_step(manifest.path)
        if node is not None and node.step.manifest is manifest:
            node.step.replicas.add(peer)
            self._write_node_list(node, REPLICAS_MARK, node.step.replicas)
            self.enforce_keep_ram()

    def held_manifests(self) -> list[mf.StepManifest]:
        """Committed steps whose files are all in this node's RAM, whoever wrote them."""
        return [manifest for manifest, _holders in self.holdings()]

    def owned_manifests(self) -> list[mf.StepManifest]:
        """Committed steps this node made and holds (not replicas it holds for others)."""
        return sorted((n.step.manifest for n in self.steps()
                       if n.step.committed and n.step.in_ram
                       and n.step.manifest.node_id == self.node_id),
                      key=lambda m: (m.step, m.path))

    # -- the cluster's view (gossip) ----------------------------------------------------------

    def holdings(self) -> list[tuple[mf.StepManifest, list[str]]]:
        """Committed steps whose files are all in this node's RAM, with who else holds them."""
        return [(n.step.manifest, [self.node_id, *self._peer_holders(n.step)])
                for n in self.steps() if n.step.committed and n.step.in_ram]

    def learn(self, manifest: mf.StepManifest, holders: list[str]) -> None:
        """A peer holds this committed step: list it here, readable from those holders."""
        others = set(holders) - {self.node_id}
        node = self.find_step(manifest.path)
        if node is not None:
            step = node.step
            if step.manifest is not None and step.manifest.version == manifest.version \
                    and not others <= step.holders:
                step.holders |= others
                if not step.in_ram:
                    self._write_node_list(node, PEERS_MARK, step.holders)
            elif not step.committed:
                self._join_cluster_commit(node, manifest, others)
            return
        step_node = self._install_step(manifest, f"node {', '.join(sorted(others))}")
        if step_node is None:
            return
        step_node.step.holders = others
        self._write_node_list(step_node, PEERS_MARK, others)
        self._add_remote_files(step_node, list(manifest.files))
        log.info("%s v%d is in the cluster (held by %s)", manifest.path, manifest.version,
                 ", ".join(sorted(others)))

    def _join_cluster_commit(self, step_node: Node, manifest: mf.StepManifest,
                             others: set[str]) -> None:
        """Another node committed this step (multi-node DCP) while ranks here wrote some of
        its files: if every file here is sealed with the content the manifest names, this
        node's copy is committed as the same version; otherwise it stays `writing`."""
        step = step_node.step
        local = list(self._files_under(step_node))
        for rel, node in local:
            entry = manifest.entry(rel)
            if (entry is None or node.remote is not None or node.seal is None
                    or node.active_writers or node.seal.digest.xxh3 != entry.xxh3):
                log.warning("%s here differs from the version %s committed: kept as writing",
                            self.relpath(step_node), ", ".join(sorted(others)))
                return
        self._write_file_atomically(os.path.join(self.backing(step_node), MANIFEST),
                                    mf.encode(manifest))
        self._drop_resident_refs(step)
        for rel, node in local:
            self.store.add_ref(manifest.entry(rel).xxh3, self.backing(node))
        step.manifest = manifest
        step.resident = {rel for rel, _node in local}
        step.dirty = False
        step.commit_pending = False
        step.holders = others
        self._write_node_list(step_node, PEERS_MARK, others)
        self._add_remote_files(step_node, [e for e in manifest.files
                                           if e.name not in step.resident])
        log.info("%s v%d committed on %s; this node holds %d of its files", manifest.path,
                 manifest.version, ", ".join(sorted(others)), len(local))

    def holders_of(self, step_path: str) -> list[str]:
        node = self.find_step(step_path)
        if node is None:
            return []
        return sorted((node.step.holders | set(self._peer_holders(node.step)))
                      - {self.node_id})

    # -- multi-node DCP: the files a step's ranks wrote on other nodes -----------------------

    def sealed_files(self, step_path: str, names: list[str]) -> list[mf.FileEntry]:
        """Which of these files of `step_path` this node holds sealed (for a peer's commit)."""
        step_node = self.find_step(step_path)
        if step_node is None:
            return []
        found = []
        wanted = set(names)
        for rel, node in self._files_under(step_node):
            if (rel in wanted and node.remote is None and node.seal is not None
                    and node.active_writers == 0):
                st = os.lstat(self.backing(node))
                digest = node.seal.digest
                found.append(mf.FileEntry(rel, digest.size, digest.xxh3, st.st_mtime_ns,
                                          st.st_mode & 0o7777, digest.chunks))
        return found

    def sealed_path(self, step_path: str, name: str, xxh3: str) -> bytes | None:
        """The RAM store path of a sealed file with exactly this content, if held here."""
        step_node = self.find_step(step_path)
        if step_node is None:
            return None
        for rel, node in self._files_under(step_node):
            if (rel == name and node.remote is None and node.seal is not None
                    and node.seal.digest.xxh3 == xxh3 and node.active_writers == 0):
                return self.backing(node)
        return None

    async def _pull_missing_dcp_files(self, step_node: Node) -> bool:
        """Before a multi-node DCP step commits here, bring in the shards other nodes' ranks
        wrote (as `.metadata` lists them). False while some are not found sealed anywhere."""
        if self.collect_sealed is None or METADATA not in step_node.children:
            return True
        try:
            with open(self.backing(step_node.children[METADATA]), "rb") as f:
                expected = dcp_metadata.shard_files(f.read())
        except (OSError, FsError, dcp_metadata.MetadataError) as exc:
            log.info("commit of %s uses the files at hand: %s", self.relpath(step_node), exc)
            return True
        local = {rel for rel, _node in self._files_under(step_node)}
        missing = expected - local
        if not missing:
            return True
        step_path = self.relpath(step_node)
        found = await self.collect_sealed(step_path, missing)
        if set(found) != missing:
            log.info("commit of %s waits for %s from other nodes", step_path,
                     ", ".join(sorted(missing - set(found))))
            return False
        if self.find_step(step_path) is not step_node:
            return False
        for name, (peer, entry) in found.items():
            if name not in {rel for rel, _n in self._files_under(step_node)}:
                step_node.step.holders.add(peer)
                self._add_remote_files(step_node, [entry], step_path)
        log.info("commit of %s pulls %d files written on %s", step_path, len(found),
                 ", ".join(sorted({peer for peer, _e in found.values()})))
        return True

    async def retry_pending_commits(self) -> None:
        """Commits left pending (writers, or shards not yet found on other nodes) try again."""
        for step_node in list(self.steps()):
            if step_node.step.commit_pending and not self._has_active_writers(step_node):
                await self._commit_quietly(step_node)

    # -- helpers ---------------------------------------------------------------------------

    def _new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def _attach(self, parent: Node, name: bytes, kind: int) -> Node:
        node = Node(self._new_ino(), kind, name, parent)
        parent.children[name] = node
        self._inodes[node.ino] = node
        return node

    def _detach(self, node: Node) -> None:
        if node.parent is not None and node.parent.children.get(node.name) is node:
            del node.parent.children[node.name]
        node.parent = None
        self._maybe_drop(node)

    def _maybe_drop(self, node: Node) -> None:
        if node.lookups or node.handles:
            return
        if node.virtual:
            self._latest.pop(node.parent.ino, None)
            del self._inodes[node.ino]
        elif node.parent is None and node.ino in self._inodes:
            del self._inodes[node.ino]

    def _new_handle(self, node: Node, fd: int, writable: bool) -> Handle:
        handle = Handle(self._next_fh, node, fd, writable)
        self._next_fh += 1
        self._handles[handle.fh] = handle
        node.handles.append(handle)
        return handle

    def _activate(self, handle: Handle) -> None:
        """First write since open or flush: the file is no longer sealed; its step is dirty."""
        handle.active = True
        node = handle.node
        node.active_writers += 1
        node.gen += 1
        node.seal = None
        self._mark_dirty(node.parent)

    def _signal_released(self) -> None:
        self._released.set()
        self._released = trio.Event()

    def _check_new_name(self, name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if is_reserved(name) or b"/" in name or name in (b"", b".", b".."):
            raise FsError(errno.EPERM, "name reserved by tierfs")
        try:
            name.decode("utf-8")  # manifests and object keys are UTF-8
        except UnicodeDecodeError:
            raise FsError(errno.EILSEQ, "names must be UTF-8") from None

    def _new_entry_path(self, parent: Node, name: bytes) -> bytes:
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        self._check_new_name(name)
        if name in parent.children:
            raise FsError(errno.EEXIST)
        return os.path.join(self.backing(parent), name)

    def _existing_entry(self, parent: Node, name: bytes) -> Node:
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        node = parent.children.get(name)
        if node is None:
            if name == LATEST and self._latest_target(parent) is not None:
                raise FsError(errno.EROFS)
            raise FsError(errno.ENOENT)
        return node

    def _is_ancestor(self, ancestor: Node, node: Node | None) -> bool:
        while node is not None:
            if node is ancestor:
                return True
            node = node.parent
        return False

    async def _make_private(self, node: Node, *, keep: bool) -> None:
        """Copy on write: a tree file shared with a committed object gets its own inode (its
        bytes kept, or empty) before anything may change it."""
        # One at a time: two writers of the same committed file must not each make a copy.
        async with self._unshare_lock:
            while True:
                path = self.backing(node)
                st = os.lstat(path)
                if st.st_nlink <= 1:
                    return
                size = st.st_size if keep else 0
                self.store.check_room(size)
                copy = await trio.to_thread.run_sync(self.store.copy, path,
                                                     os.path.dirname(path), size)
                # No await from here: the copy replaces the shared inode only if the node is
                # still where it was and still that inode (a rename may have moved things).
                try:
                    unchanged = (self.backing(node) == path
                                 and os.lstat(path).st_ino == st.st_ino)
                except (FsError, FileNotFoundError):
                    unchanged = False
                if not unchanged:
                    os.unlink(copy)
                    continue
                os.rename(copy, path)
                backing_ino = os.lstat(path).st_ino
                self.store.account(backing_ino, size)
                for handle in node.handles:  # open handles follow the file to its new inode
                    if handle.fd >= 0:
                        fresh = os.open(path, os.O_RDWR if handle.writable else os.O_RDONLY)
                        os.dup2(fresh, handle.fd)
                        os.close(fresh)
                        handle.backing_ino = backing_ino
                return

    def _unlink_backing(self, path: bytes, node: Node) -> None:
        self._forget_backing_if_last(path, node)
        os.unlink(path)

    def _forget_backing_if_last(self, path: bytes, node: Node) -> None:
        """Space comes back when the last link goes, or at the last close if files are open."""
        st = os.lstat(path)
        if st.st_nlink == 1 and not any(h.backing_ino == st.st_ino for h in node.handles):
            self.store.forget_inode(st.st_ino)

    def _remove_hidden(self, dir_node: Node, path: bytes) -> None:
        """Remove tierfs's own entries of an otherwise empty directory (a deleted step)."""
        step = dir_node.step
        if step is not None:
            self._drop_resident_refs(step)
            step.manifest = None
        else:  # a committed step renamed to a name that is not a step name
            manifest = self._read_manifest(path)
            for entry in manifest.files if manifest else ():
                if os.path.exists(os.path.join(path, os.fsencode(entry.name))):
                    self.store.drop_ref(entry.xxh3)
        for name in os.listdir(path):
            if is_reserved(name):
                os.unlink(os.path.join(path, name))


def _chown(path: bytes, uid: int, gid: int) -> None:
    if (uid, gid) != (os.geteuid(), os.getegid()):
        os.chown(path, uid, gid, follow_symlinks=False)


_RENAME_NOREPLACE = 1
_ENOATTR = errno.ENODATA
