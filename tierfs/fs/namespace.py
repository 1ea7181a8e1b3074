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
* Order of a commit on disk: write manifest temp, fsync, link objects, rename. A crash before the
  rename leaves only unreferenced objects, which start-up removes; the step stays `writing`. A
  full RAM dir fails the first of these, before anything changed.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections.abc import Awaitable, Callable, Iterator

import trio

from tierfs import manifest as mf
from tierfs.fs.fetch import ReadSource
from tierfs.fs.latest_pins import LatestPins
from tierfs.fs.long_paths import LONG_PATH, anchor_path
from tierfs.fs.nodes import (
    DEFAULT_STEP_PATTERN,
    ENOATTR,
    LATEST,
    MANIFEST,
    METADATA,
    NAME_MAX,
    RENAME_NOREPLACE,
    ROOT_INODE,
    XATTR_RESERVED,
    XATTR_STATE,
    XATTR_TIERS,
    XATTR_XXH3,
    FsError,
    Handle,
    Node,
    RemoteAttrs,
    Seal,
    StepState,
    some_names,
)
from tierfs.fs.other_tiers import OtherTiers
from tierfs.fs.quiet_commits import QuietCommits
from tierfs.fs.ram_store import RamFull, RamStore, allocated, is_reserved
from tierfs.fs.recovery import Recovery
from tierfs.fs.residency import Residency
from tierfs.observe import Events

log = logging.getLogger(__name__)


class Namespace(Recovery, Residency, OtherTiers, QuietCommits):
    """The tree of one mount; see the module docstring for its invariants."""

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
        commit_idle: float = 5.0,
        events: Events | None = None,
    ) -> None:
        self.store = store
        self.events = events or Events()  # the commit's event line and metrics
        self.commit_idle = commit_idle  # see fs.quiet_commits
        self._quiet: dict[Node, float] = {}
        self._quiet_wake = trio.Event()
        self.keep_ram = keep_ram
        self.replicas = replicas
        # Injected by the cluster wiring: which peers hold sealed copies of a step's files.
        self.collect_sealed: Callable[[str, set[str]], Awaitable[
            dict[str, tuple[str, mf.FileEntry]]]] | None = None
        self.read_sources = read_sources or []
        # Injected by the daemon (fs.verify): RAM objects from before a restart are hashed
        # before their first read.
        self.before_read_open: Callable[[Node], Awaitable[None]] | None = None
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
        self._latest_pins = LatestPins()
        self._released = trio.Event()
        self._hash_limiter = trio.CapacityLimiter(2)
        self._unshare_lock = trio.Lock()
        self._evictions: dict[StepState, trio.Event] = {}  # see Residency
        self._fetching: set[Node] = set()
        self._pressure_relief = False

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
        """The node's path in the RAM store; ENOENT once it is unlinked. A path that would be
        long starts at a deep directory held open (see `long_paths`)."""
        parts = []
        length = 0
        anchor = None
        while node.parent is not None:
            if node.virtual:
                raise FsError(errno.ENOENT)
            if anchor is None:
                if length > LONG_PATH and node.is_dir:
                    anchor = self._anchor(node)
                else:
                    parts.append(node.name)
                    length += len(node.name) + 1
            node = node.parent
        if node is not self.root:
            raise FsError(errno.ENOENT)
        return b"/".join([anchor or self._tree, *reversed(parts)])

    def _anchor(self, dir_node: Node) -> bytes:
        """A path to `dir_node` through a descriptor it keeps open (it follows renames; it is
        closed when the directory goes)."""
        if dir_node.anchor_fd < 0:
            dir_node.anchor_fd = os.open(self.backing(dir_node), os.O_PATH | os.O_DIRECTORY)
        return anchor_path(dir_node.anchor_fd)

    def relpath(self, node: Node) -> str:
        parts = []
        while node.parent is not None:
            if node.virtual:
                raise FsError(errno.ENOENT)
            parts.append(node.name)
            node = node.parent
        if node is not self.root:
            raise FsError(errno.ENOENT)
        return os.fsdecode(b"/".join(reversed(parts)))

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
        uid, gid = entry.uid, entry.gid
        if uid == mf.NO_OWNER or gid == mf.NO_OWNER:  # a manifest from before owners
            parent = os.lstat(self.backing(node.parent)) if node.parent else None
            uid, gid = (parent.st_uid, parent.st_gid) if parent else (0, 0)
        return RemoteAttrs(
            st_mode=stat.S_IFREG | entry.mode, st_nlink=1, st_uid=uid, st_gid=gid,
            st_size=entry.size, st_blocks=0, st_atime_ns=entry.mtime_ns,
            st_mtime_ns=entry.mtime_ns, st_ctime_ns=entry.mtime_ns)

    # -- directories -----------------------------------------------------------------------

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        path = self._new_entry_path(parent, name)
        os.mkdir(path, mode & 0o7777)
        _chown(path, uid, gid)
        node = self._attach(parent, name, stat.S_IFDIR)
        number = self.step_number_at(parent, name)
        if number is not None:
            node.step = StepState(number)
            self._next_step_started(node)
        self._mark_dirty(parent)
        return node

    def rmdir(self, parent: Node, name: bytes) -> None:
        node = self._existing_entry(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        path = self.backing(node)
        if node.step is not None:
            self.step_removed(node.step)  # a deleted step leaves every tier (fs.deletes)
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

    def readlink(self, node: Node, pid: int | None = None) -> bytes:
        """A symbolic link's target; for `latest`, the one process `pid` sees (latest_pins)."""
        if node.virtual:
            parent = node.parent
            target = self._latest_target(parent)
            if pid is not None:
                target = self._latest_pins.resolve(
                    pid, parent.ino, target, lambda name: self._is_committed_step(parent, name))
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
        self.store.account_fd(fd)
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
        if not writable and node.remote is None and self.before_read_open is not None:
            await self.before_read_open(node)  # may quarantine it: then it is remote
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
            self.store.account_fd(fd)
            self._activate(handle)
        return handle

    async def read(self, handle: Handle, offset: int, size: int) -> bytes:
        if handle.fd < 0:
            node = handle.node
            if node.remote is not None:
                return await self._read_remote(node, offset, size)
            handle.fd = os.open(self.backing(node), os.O_RDONLY)  # it became resident
        return os.pread(handle.fd, size, offset)

    async def write(self, handle: Handle, offset: int, data: bytes) -> int:
        if not handle.active:
            self._activate(handle)
        if not self.store.room_for(len(data)) and _may_allocate(handle.fd, offset, len(data)):
            await self.make_room(len(data), sparing=handle.node)
        written = os.pwrite(handle.fd, data, offset)
        self.store.account_fd(handle.fd)
        return written

    async def expect_direct_writes(self, handle: Handle) -> None:
        """The kernel will write this handle's backing file without asking us (passthrough):
        count it as writing from now on. A full RAM tier is refused here, at open, because
        such writes cannot be refused one by one."""
        if not handle.writable:
            return
        await self.make_room(1, sparing=handle.node)
        if not handle.active:
            self._activate(handle)

    def account_direct_writes(self) -> None:
        """Bring the RAM tier's accounting up to date with passthrough writes in progress."""
        for handle in self._handles.values():
            if handle.passthrough and handle.writable and handle.fd >= 0:
                self._account_direct(handle)
        self.relieve_pressure()

    def _account_direct(self, handle: Handle) -> None:
        self.store.account_fd(handle.fd)

    async def flush(self, handle: Handle, *, final: bool = False) -> None:
        """End of a close() (FLUSH), or of the open file (`final`, its RELEASE): seal what this
        handle wrote, then fire any commit it completes."""
        # The kernel writes passthrough files without us, and flushes at the close of every
        # duplicate descriptor (shell `>`, dd, forked children): writes through the other
        # duplicates may follow a flush. A seal that no longer describes the file is redone,
        # and so is any seal taken before the last of several closes.
        if handle.passthrough and handle.writable and not handle.active and (
                (final and handle.flushes > 1) or not self._seal_describes_file(handle.node)):
            self._activate(handle)
        if not final:
            handle.flushes += 1
        if not handle.active:
            return
        if handle.passthrough:
            self._account_direct(handle)
        node = handle.node
        handle.active = False
        node.active_writers -= 1
        if node.active_writers == 0:
            await self._seal(node)
        self._signal_released()
        await self._after_writer(node)

    async def release(self, handle: Handle) -> None:
        try:
            await self.flush(handle, final=True)
        finally:
            del self._handles[handle.fh]
            if handle.pin is not None:
                self._latest_pins.closed(handle.pin)
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
        # A change of metadata alone (utime moves the mtime a seal is checked against) keeps it.
        keeps_seal = size is None and node.is_file and self._seal_describes_file(node)
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
        if keeps_seal:
            node.seal = node.seal.restamped(self.stat(node))

    async def _truncate(self, node: Node, handle: Handle | None, target: bytes | int,
                        size: int) -> None:
        if not node.is_file:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)
        # A file grown by truncate stores nothing more (tmpfs keeps no holes): no room needed.
        if isinstance(target, bytes):
            await self._make_private(node, keep=size > 0)
            target = self.backing(node)
            os.truncate(target, size)
            self.store.account_path(target)
        else:
            os.ftruncate(target, size)
            self.store.account_fd(target)
        if handle is not None and handle.active:
            return
        node.gen += 1
        node.seal = None
        self._mark_dirty(node.parent)

    # -- rename ----------------------------------------------------------------------------

    async def rename(self, old_parent: Node, old_name: bytes, new_parent: Node,
                     new_name: bytes, flags: int) -> None:
        if flags & ~RENAME_NOREPLACE:
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
            if flags & RENAME_NOREPLACE:
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
                if target.step is not None:
                    self.step_removed(target.step)
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
        if node.is_dir:
            await self._renamed_dir(node)
        elif new_name == METADATA and self.step_of(new_parent) is not None:
            await self._commit_for_saver(new_parent)
        await self._run_pending_commits(old_parent)

    async def _renamed_dir(self, node: Node) -> None:
        """A directory renamed onto a step name commits it (the `mv tmp step_N` idiom); one
        renamed away from a step name, or into a step, stops being a step (its files are
        then files of the step it is in); steps moved along with it commit again so that
        their manifests name where they are now."""
        number = self.step_number_at(node.parent, node.name)
        if number is None:
            if node.step is not None:
                await self._demote(node)
                node.step = None
        else:
            if node.step is None:
                node.step = StepState(number, self._read_manifest(self.backing(node)))
            node.step.number = number
            node.step.dirty = True  # whatever it held before, it is committed only once more
            self._touch(node)
        for below in list(self._dirs_under(node)):
            await self._restep(below)
        if node.step is not None:
            await self._commit_quietly(node)
        for step_node in list(self.steps(under=node)):
            manifest = step_node.step.manifest
            if step_node is not node and manifest and manifest.path != self.relpath(step_node):
                await self._commit_quietly(step_node)

    def _dirs_under(self, node: Node) -> Iterator[Node]:
        """Every directory below `node`, parents before their children."""
        stack = [c for c in node.children.values() if c.is_dir]
        while stack:
            below = stack.pop()
            yield below
            stack.extend(c for c in below.children.values() if c.is_dir)

    async def _restep(self, node: Node) -> None:
        """After a rename above it: `node` is a step exactly when its name is a step name and
        no directory above it is a step (a directory inside a step is part of that step)."""
        number = self.step_number_at(node.parent, node.name)
        if number is None and node.step is not None:
            await self._demote(node)
            node.step = None
        elif number is not None and node.step is None:
            node.step = StepState(number, self._read_manifest(self.backing(node)))
            self._touch(node)

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
        try:
            manifest, old = await self._commit_locked(step_node, step, wait_for_writers)
        except (OSError, RamFull) as exc:
            # Retried (retry_pending_commits) until it succeeds; `status` shows why it waits.
            step.commit_pending = True
            step.waiting_for = "space: " + ("the RAM tier is full" if isinstance(exc, RamFull)
                                            else exc.strerror or str(exc))
            raise
        if manifest is None:
            return None
        step.waiting_for = None
        if manifest is not old:
            self.events.committed(manifest, time.monotonic() - started)
            await self._commits.send(manifest)
        return manifest

    async def _commit_locked(self, step_node: Node, step: StepState, wait_for_writers: bool
                             ) -> tuple[mf.StepManifest | None, mf.StepManifest | None]:
        """The commit itself: (the manifest in force after it, the one before), or (None, _)
        when it is left pending."""
        async with step.lock:
            while True:
                released = self._released
                if self._has_active_writers(step_node):
                    if not wait_for_writers:
                        step.commit_pending = True
                        step.waiting_for = "open writers"
                        log.info("commit of %s waits for open writers", self.relpath(step_node))
                        return None, None
                    await released.wait()
                    continue
                if not await self._pull_missing_dcp_files(step_node):
                    step.commit_pending = True  # retried by retry_pending_commits
                    step.waiting_for = "files named by its .metadata"
                    return None, None
                files = list(self._files_under(step_node))
                for _rel, node in files:
                    if node.remote is not None:
                        await self._make_resident(node, empty=False)
                    if node.seal is None:
                        await self._seal(node)
                copies = await self._copies_of_open_files(files)
                # From here to the end of _write_manifest there is no await (see module doc).
                stale = self._stale_seals(files)
                for node in stale:
                    self._written_behind_seal(node)
                if (stale or self._has_active_writers(step_node)
                        or self.step_of(step_node) is not step or step_node.parent is None
                        or files != list(self._files_under(step_node))
                        or any(node.seal is None or node.remote for _rel, node in files)
                        or any(node.gen != gen for node, (_copy, gen) in copies.items())):
                    for copy, _gen in copies.values():
                        self.store.discard(copy)
                    if self.step_of(step_node) is not step or step_node.parent is None:
                        return None, None  # renamed away or removed while it was being sealed
                    continue
                old = step.manifest
                manifest = self._write_manifest(step_node, files,
                                                {n: c for n, (c, _g) in copies.items()})
                step.commit_pending = False
                return manifest, old

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
        if manifest is None:
            missing = await self.missing_dcp_files(node)
            if missing:
                raise FsError(errno.EAGAIN, f"{relpath} is not complete: its .metadata names "
                              f"{len(missing)} files that are not there yet "
                              f"({some_names(missing)}); it "
                              "commits by itself when they are")
            raise FsError(errno.EAGAIN, f"{relpath} could not commit yet (see the log)")
        return manifest

    async def _copies_of_open_files(self, files: list[tuple[str, Node]]
                                    ) -> dict[Node, tuple[bytes, int]]:
        """Private copies, for the objects, of files that a handle could still write into."""
        copies = {}
        for _rel, node in files:
            if any(h.writable for h in node.handles) and \
                    not self.store.object_path(node.seal.digest.xxh3).exists():
                gen = node.gen
                await self.make_room(node.seal.digest.size)
                copy = await trio.to_thread.run_sync(
                    self.store.copy, self.backing(node), os.fsencode(self.store.objects),
                    node.seal.digest.size)
                self.store.account_path(copy)
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
            entries.append(mf.entry_from_stat(rel, node.seal.digest,
                                              os.lstat(self.backing(node))))
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
        manifest_path = os.path.join(dir_path, MANIFEST)
        tmp = self._write_temp_file(manifest_path, mf.encode(manifest))  # may fail: ENOSPC
        for (_rel, node), entry in zip(files, entries, strict=True):
            self.store.add_ref(entry.xxh3, self.backing(node), copies.pop(node, None))
        os.rename(tmp, manifest_path)
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
            log.error("commit of %s failed: %s", os.fsdecode(step_node.name), exc)
        except Exception:  # a bug must not take the file system down with it
            log.exception("commit of %s failed", os.fsdecode(step_node.name))

    async def _commit_for_saver(self, step_node: Node) -> None:
        """Commit triggered by the saver's own call (`.metadata` closed after writing or renamed
        into place): a failure is that call's error, so the save fails instead of returning
        success for a step that did not commit. The commit is retried meanwhile."""
        try:
            await self.commit(step_node, wait_for_writers=False)
        except RamFull:
            log.error("commit of %s failed: the RAM tier is full; retried when space frees",
                      self.relpath(step_node))
            raise FsError(errno.ENOSPC) from None
        except OSError as exc:
            log.error("commit of %s failed: %s; retried when it can succeed",
                      self.relpath(step_node), exc.strerror or exc)
            raise FsError(exc.errno or errno.EIO) from None

    async def _after_writer(self, node: Node) -> None:
        """A writer of `node` is done: a `.metadata` closed after writing, or a pending commit
        whose last writer this was, commits its step now."""
        parent = node.parent
        if parent is None:
            return
        self._touch_enclosing(parent)  # its step commits `commit_idle` seconds after this
        if node.name == METADATA and self.step_of(parent) is not None:
            await self._commit_for_saver(parent)
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
            before = os.fstat(fd)
            digest = await trio.to_thread.run_sync(mf.hash_fd, fd, limiter=self._hash_limiter)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        seal = Seal(digest, after.st_ino, after.st_mtime_ns)
        if (node.gen == gen and node.active_writers == 0 and seal.describes(before)
                and seal.describes(after)):
            node.seal = seal

    def _seal_describes_file(self, node: Node) -> bool:
        """Whether the node's seal still describes its backing file (see `Seal`)."""
        if node.seal is None:
            return False
        try:
            st = self.stat(node)
        except (FsError, OSError):
            return False
        return isinstance(st, os.stat_result) and node.seal.describes(st)

    def _stale_seals(self, files: list[tuple[str, Node]]) -> list[Node]:
        """Files whose bytes may have changed behind their seal: only a file open for writing
        can change without the daemon seeing it (passthrough), so only those are looked at."""
        return [node for _rel, node in files
                if any(h.writable for h in node.handles) and not self._seal_describes_file(node)]

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
            self._touch(step_node)

    def step_of(self, node: Node) -> StepState | None:
        """The node's step state if it is a step directory (see `step_number_at`)."""
        return node.step

    def step_number_at(self, parent: Node | None, name: bytes | str) -> int | None:
        """The step number of a directory `name` in `parent`: a step is a directory whose name
        matches the step pattern and that is not inside a step (whatever its name, a directory
        inside a step, such as Megatron's `mp_rank_00/`, is part of that step)."""
        if next(self._enclosing_steps(parent), None) is not None:
            return None
        return self.step_number(name)

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

    def _is_committed_step(self, dir_node: Node, name: bytes) -> bool:
        node = dir_node.children.get(name)
        step = self.step_of(node) if node is not None and node.is_dir else None
        return step is not None and step.committed

    def note_opened(self, handle: Handle, pid: int) -> None:
        """Process `pid` opened `handle`: if it reached the file through its pinned `latest`,
        the pin lasts while the file is open."""
        step_node = next((n for n in self._enclosing_steps(handle.node.parent)
                          if self.step_of(n) is not None), None)
        if step_node is not None and step_node.parent is not None:
            handle.pin = self._latest_pins.opened(pid, step_node.parent.ino, step_node.name)

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
            if node.step is not None:
                yield node  # nothing inside a step is a step
                continue
            stack.extend(c for c in node.children.values() if c.children is not None)

    def step_status(self, step_node: Node) -> dict[str, object]:
        """One step's line of `tierfs status`: cheap whatever the step's size (no disk access
        for committed steps; a step being written costs one lstat per unsealed file)."""
        step = step_node.step
        if step.committed:
            manifest = step.manifest
            files, size = len(manifest.files), manifest.total_bytes
            ram_bytes = size if step.in_ram else sum(
                manifest.entry(name).size for name in step.resident)
        else:
            sizes = [self._status_size(n) for n in self._walk_files(step_node)]
            files, size = len(sizes), sum(sizes)
            ram_bytes = size
        return {
            "path": self.relpath(step_node), "step": step.number, "state": step.state,
            "ram_bytes": ram_bytes,
            "version": step.manifest.version if step.manifest else 0,
            "files": files, "bytes": size, "ram": step.in_ram,
            "replicas": self._peer_holders(step),
            "persisted": step.persisted,
            "waiting_for": step.waiting_for if step.commit_pending or not step.committed else None,
        }

    def _status_size(self, node: Node) -> int:
        if node.remote is not None:
            return node.remote.entry.size
        if node.seal is not None and not node.active_writers:
            return node.seal.digest.size
        try:
            return self.stat(node).st_size
        except (FsError, FileNotFoundError):
            return 0  # removed meanwhile

    @staticmethod
    def _walk_files(dir_node: Node) -> Iterator[Node]:
        """Every file below `dir_node`, in no particular order (cheaper than `_files_under`)."""
        stack = [dir_node]
        while stack:
            for child in stack.pop().children.values():
                if child.children is not None:
                    stack.append(child)
                elif child.kind == stat.S_IFREG:
                    yield child

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
            raise FsError(ENOATTR)
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
        if not self._seal_describes_file(node):
            await self._seal(node)  # sealed before a restart, or written behind its seal
        if node.seal is None:
            raise FsError(ENOATTR)
        return node.seal.digest.xxh3.encode()

    # -- user xattrs: kept on the RAM tier's file, not step data ----------------------------

    def user_xattr_names(self, node: Node) -> list[bytes]:
        target = self._user_xattr_target(node)
        if target is None:
            return []
        return [name for name in map(os.fsencode, os.listxattr(target))
                if name.startswith(b"user.") and not name.startswith(XATTR_RESERVED)]

    def user_xattr(self, node: Node, name: bytes) -> bytes:
        target = self._user_xattr_target(node)
        if target is None:
            raise FsError(ENOATTR)
        return os.getxattr(target, name)

    async def set_user_xattr(self, node: Node, name: bytes, value: bytes) -> None:
        if node.remote is not None:
            await self._make_resident(node, empty=False)  # as chmod does
        target = self._user_xattr_target(node)
        if target is None:
            raise FsError(errno.ENOTSUP)
        os.setxattr(target, name, value)

    def remove_user_xattr(self, node: Node, name: bytes) -> None:
        target = self._user_xattr_target(node)
        if target is None:
            raise FsError(ENOATTR)
        os.removexattr(target, name)

    def _user_xattr_target(self, node: Node) -> bytes | int | None:
        """Where a node's user xattrs live: its backing file or directory, the fd of an open
        handle once it is unlinked, or nowhere (a file whose bytes are in another tier, the
        virtual `latest`). They are not in the manifest, so no other tier keeps them."""
        if node.virtual or node.remote is not None or not (node.is_file or node.is_dir):
            return None
        try:
            return self.backing(node)
        except FsError:
            for handle in node.handles:
                if handle.fd >= 0:
                    return handle.fd
            raise

    # -- FIFOs and sockets: local to this node's RAM tier, never in a step -------------------

    def mknod(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        """A regular file (empty, not open), a FIFO or a socket; no device nodes. FIFOs and
        sockets are not step data (no manifest entry, no upload, no replica), so they are
        refused inside step directories, where they could only stand in a commit's way."""
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK):
            raise FsError(errno.EPERM, "device nodes are not supported")
        if kind != stat.S_IFREG:
            self._check_special_parent(parent)
        path = self._new_entry_path(parent, name)
        os.mknod(path, kind | (mode & 0o7777))
        os.chmod(path, mode & 0o7777)  # whatever the daemon's umask
        _chown(path, uid, gid)
        node = self._attach(parent, name, kind)
        if kind == stat.S_IFREG:
            self.store.account_path(path)
            self._mark_dirty(parent)
        return node

    def check_special_destination(self, node: Node, new_parent: Node) -> None:
        """A FIFO or socket may not be renamed into a step directory either."""
        if node.kind in (stat.S_IFIFO, stat.S_IFSOCK):
            self._check_special_parent(new_parent)

    def _check_special_parent(self, parent: Node) -> None:
        if any(self.step_of(node) is not None for node in self._enclosing_steps(parent)):
            raise FsError(errno.EPERM, "FIFOs and sockets cannot be part of a step")


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
        if node.is_dir:  # directories held open for long paths, in what leaves the tree
            for gone in (node, *self._dirs_under(node)):
                if gone.anchor_fd >= 0:
                    os.close(gone.anchor_fd)
                    gone.anchor_fd = -1
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

    def _written_behind_seal(self, node: Node) -> None:
        """The kernel wrote `node` through a passthrough descriptor after its seal: it counts as
        being written until that descriptor's next close."""
        for handle in node.handles:
            if handle.writable and handle.passthrough and not handle.active:
                self._activate(handle)
                return
        node.gen += 1
        node.seal = None

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
                await self.make_room(size, sparing=node)
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
                backing_ino = self.store.account_path(path)
                for handle in node.handles:  # open handles follow the file to its new inode
                    if handle.fd >= 0:
                        fresh = os.open(path, os.O_RDWR if handle.writable else os.O_RDONLY)
                        os.dup2(fresh, handle.fd)
                        os.close(fresh)
                        handle.backing_ino = backing_ino
                return

    def _unlink_backing(self, path: bytes, node: Node) -> None:
        st = self._forget_backing_if_last(path, node)
        self.store.remove(path, st, in_background=not self._is_open(node, st))

    def _forget_backing_if_last(self, path: bytes, node: Node) -> os.stat_result:
        """Space comes back when the last link goes, or at the last close if files are open."""
        st = os.lstat(path)
        if st.st_nlink == 1 and not self._is_open(node, st):
            self.store.forget_inode(st.st_ino)
        return st

    @staticmethod
    def _is_open(node: Node, st: os.stat_result) -> bool:
        return any(h.backing_ino == st.st_ino for h in node.handles)

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


def _may_allocate(fd: int, offset: int, length: int) -> bool:
    """Whether writing `length` bytes at `offset` may make the file store more: not when
    every byte it covers is stored already (an overwrite inside a file without holes)."""
    st = os.fstat(fd)
    return offset + length > st.st_size or allocated(st) < st.st_size


def _chown(path: bytes, uid: int, gid: int) -> None:
    if (uid, gid) != (os.geteuid(), os.getegid()):
        os.chown(path, uid, gid, follow_symlinks=False)


