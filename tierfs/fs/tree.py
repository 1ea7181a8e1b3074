"""The tree: inodes, directories, open files, step state and the RAM store's references.

The tree lives twice: as real files under the RAM store's `tree/` (the durable truth, so a crash
loses nothing written) and as `Node` objects in memory (inode numbers, lookup counts, open
handles, seals and step state). `Tree` alone changes either, and the RAM store's references to
committed objects, so it alone keeps them in step, with one part of its core beside it:
`fs.step_versions` (versions installed, joined, superseded or forgotten as the other tiers say,
and which tiers hold them), which changes the tree only through the primitives here (`attach`,
`detach`, `unlink_backing`...) and by the same rules. Its collaborators (`fs.residency`,
`fs.other_tiers`, `fs.commits`, `fs.quiet_commits`, `fs.recovery`, `fs.verify`) decide *when*
something changes and call those methods to change it. What only reads the tree is elsewhere:
`fs.tree_view` (peers' questions, status, xattrs), `fs.holders.Holdings` (who else holds a
step). It calls nothing outward but the ports it is given (`fs.ports`: `StepWatch`,
`DeleteLog`).

Invariants (S3QL-style note: where an `await` must not appear):

* A file is *sealed* after its last active writer flushes: its xxh3-128 is computed in the
  background (`fs.sealing`) and kept only if no writer became active meanwhile (`Node.gen` did
  not move) and the backing file did not change; a commit waits for the seals of its files.
* `write_manifest` runs without any `await` from the moment the commit re-checks the step (no
  active writer, every file sealed, same set of files; `fs.commits`) until the manifest is
  renamed into place and the in-memory state updated. A concurrent handler therefore sees
  either the old state or the new one, never a manifest that disagrees with the tree.
* Committed objects are never written: a tree file whose inode is shared with `objects/` is
  unshared (copied, or recreated empty for O_TRUNC) before it is opened for writing or truncated
  (`Namespace.make_private` copies, `replace_shared` swaps the copy in with no await).
* Order of a commit on disk: write manifest temp, fsync, link objects, rename. A crash before the
  rename leaves only unreferenced objects, which start-up removes; the step stays `writing`. A
  full RAM dir fails the first of these, before anything changed.
* Every other change here (a fetch adopted, a file evicted or quarantined, a step installed,
  superseded or forgotten) is one synchronous method: handlers see a file either before or
  after it, never half changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import AsyncIterator, Iterator

import trio

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs import append_layout
from tierfs.fs import links as symlinks
from tierfs.fs.fetch import Fetch, RemoteFile, apply_attributes
from tierfs.fs.holders import Holdings
from tierfs.fs.latest_pins import LatestPins
from tierfs.fs.long_paths import LONG_PATH, anchor_path
from tierfs.fs.nodes import (
    DEFAULT_FILE_STEP_PATTERN,
    DEFAULT_STEP_PATTERN,
    LATEST,
    NAME_MAX,
    OWN_LATEST_MARK,
    RENAME_NOREPLACE,
    ROOT_INODE,
    FsError,
    Handle,
    Node,
    RemoteAttrs,
    Seal,
    StepState,
    size_in_blocks,
)
from tierfs.fs.ports import DeleteLog, Liveness, Spawner, StepWatch
from tierfs.fs.ram_store import RamStore, allocated, is_reserved
from tierfs.fs.records import StepRecords
from tierfs.fs.recoverable import Recoverability
from tierfs.fs.sealing import Sealing
from tierfs.step_names import DEEPSPEED_STEP

log = logging.getLogger(__name__)

_DEEPSPEED_STEP = re.compile(os.fsencode(DEEPSPEED_STEP))



class Tree:
    """The tree of one mount; see the module docstring for its invariants."""

    def __init__(self, store: RamStore, watch: StepWatch, deletes: DeleteLog, *,
                 node_id: str = "local", step_pattern: str = DEFAULT_STEP_PATTERN,
                 file_step_pattern: str = DEFAULT_FILE_STEP_PATTERN,
                 spawner: Spawner | None = None, liveness: Liveness | None = None) -> None:
        self.store = store
        self.records = StepRecords()
        self.node_id = node_id
        self.holdings = Holdings(node_id)  # who else holds a committed step's files
        self.pattern = re.compile(step_pattern)
        self.file_pattern = re.compile(file_step_pattern)
        self._watch = watch
        self._deletes = deletes
        self.tree_path = os.fsencode(store.tree)
        self.root = Node(ROOT_INODE, stat.S_IFDIR, b"", None)
        self._inodes: dict[int, Node] = {ROOT_INODE: self.root}
        self._next_ino = ROOT_INODE + 1
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._latest: dict[int, Node] = {}
        self._latest_pins = LatestPins()
        self._released = trio.Event()
        self.sealing = Sealing(self.backing, spawner)  # seals hashed off the writer's path
        self._unshare_locks: dict[Node, trio.Lock] = {}
        self.fetching: set[Node] = set()  # nodes with a partial fetch (fs.residency)
        self.links = symlinks.LinkChanges()  # directories whose links the store must learn
        # which committed steps can be read whole now (their state, `latest`)
        self.recoverable = Recoverability(node_id, self.holdings.file_peers, liveness)

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
        if name == LATEST and self.shows_virtual_latest(parent):
            return self._latest_node(parent)
        raise FsError(errno.ENOENT)

    def list_dir(self, node: Node) -> list[tuple[bytes, Node]]:
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        entries = list(node.children.items())
        if self.shows_virtual_latest(node):
            # First, so that `rm -r` meets it while it still exists (its unlink is a no-op).
            entries.insert(0, (LATEST, self._latest_node(node)))
        return entries

    @property
    def inode_count(self) -> int:
        return len(self._inodes)

    @property
    def released(self) -> trio.Event:
        """Set (and replaced) whenever a writer of any file is done."""
        return self._released

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
        return b"/".join([anchor or self.tree_path, *reversed(parts)])

    def has_backing(self, node: Node) -> bool:
        try:
            self.backing(node)
        except FsError:
            return False
        return True

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
            st_size=entry.size, st_blocks=size_in_blocks(entry.size),
            st_atime_ns=entry.mtime_ns, st_mtime_ns=entry.mtime_ns, st_ctime_ns=entry.mtime_ns)

    def find_step(self, relpath: str) -> Node | None:
        node = self.root
        try:
            for part in relpath.split("/"):
                node = self.child(node, os.fsencode(part))
        except FsError:
            return None
        return node if self.step_of(node) is not None else None

    def records_path(self, step_node: Node) -> bytes:
        """Where a step's records (manifest, marks) are in the store: in a step directory, or
        for a single-file step in its records directory beside the file (made if missing)."""
        if step_node.is_dir:
            return self.backing(step_node)
        path = os.path.join(self.backing(step_node.parent), layout.records_name(step_node.name))
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        return path

    def data_dir(self, step: StepState) -> str:
        """The path its committed files are relative to (`layout.data_dir`)."""
        return layout.data_dir(step.manifest.path, step.manifest.single_file)
    def renamed_in_store(self, manifest: mf.StepManifest) -> bool:
        """Whether the files of this version are in the store under the old names of a rename
        not finished there (fs.deletes)."""
        data_dir = layout.data_dir(manifest.path, manifest.single_file)
        return bool(manifest.files) and all(
            self._deletes.old_keys(layout.object_key(data_dir, entry.name))
            for entry in manifest.files)

    def moves_may_settle(self) -> None:
        """Steps renamed just now committed at their new names: their old names may go."""
        self._deletes.poke()

    def node_at(self, relpath: str) -> Node | None:
        """The entry at `relpath`, None if there is none."""
        node = self.root
        for part in relpath.split("/") if relpath else ():
            children = node.children
            node = children.get(os.fsencode(part)) if children is not None else None
            if node is None:
                return None
        return node

    def find_dir(self, relpath: str) -> Node:
        """The directory at `relpath` (`""` or `.` is the root); ENOTDIR if it is not one."""
        node = self.root
        for part in (p for p in relpath.split("/") if p not in ("", ".")):
            node = self.child(node, os.fsencode(part))
        if not node.is_dir or node.virtual:
            raise FsError(errno.ENOTDIR, f"{relpath} is not a directory")
        return node

    @staticmethod
    def entry_node(step_node: Node, name: str) -> Node | None:
        """The file node of a manifest entry, if it is in the tree."""
        if step_node.is_file:
            return step_node if os.fsencode(name) == step_node.name else None
        node = step_node
        for part in name.split("/"):
            if node.children is None:
                return None
            node = node.children.get(os.fsencode(part))
            if node is None:
                return None
        return node if node.is_file else None

    def files_under(self, dir_node: Node, prefix: str = "") -> Iterator[tuple[str, Node]]:
        """Every file below `dir_node` with its path relative to it, in name order (a
        single-file step: the file itself, by its name)."""
        if dir_node.is_file:
            yield prefix + os.fsdecode(dir_node.name), dir_node
            return
        for name, node in sorted(dir_node.children.items()):
            rel = prefix + os.fsdecode(name)
            if node.is_file:
                yield rel, node
            elif node.is_dir:
                yield from self.files_under(node, rel + "/")

    @staticmethod
    def walk_files(dir_node: Node) -> Iterator[Node]:
        """Every file below `dir_node`, in no particular order (cheaper than `files_under`)."""
        if dir_node.is_file:
            yield dir_node
            return
        yield from Tree.walk_kind(dir_node, stat.S_IFREG)

    @staticmethod
    def walk_kind(dir_node: Node, kind: int) -> Iterator[Node]:
        """Every entry of this file type below the directory `dir_node`, in no order."""
        stack = [dir_node]
        while stack:
            for child in stack.pop().children.values():
                if child.children is not None:
                    stack.append(child)
                elif child.kind == kind:
                    yield child

    @staticmethod
    def dirs_under(node: Node) -> Iterator[Node]:
        """Every directory below `node`, parents before their children."""
        stack = [c for c in node.children.values() if c.is_dir]
        while stack:
            below = stack.pop()
            yield below
            stack.extend(c for c in below.children.values() if c.is_dir)

    @staticmethod
    def enclosing_steps(node: Node | None) -> Iterator[Node]:
        while node is not None:
            if node.step is not None:
                yield node
            node = node.parent

    @staticmethod
    def holds(step_node: Node, node: Node | None) -> bool:
        """Whether `node` is `step_node` or below it."""
        while node is not None:
            if node is step_node:
                return True
            node = node.parent
        return False

    def steps(self, under: Node | None = None) -> Iterator[Node]:
        """Every step (below `under`, itself included), depth first: step directories and
        single-file steps."""
        stack = [under or self.root]
        while stack:
            node = stack.pop()
            if node.step is not None:
                yield node  # nothing inside a step is a step
                continue
            stack.extend(c for c in node.children.values()
                         if c.children is not None or c.step is not None)

    @staticmethod
    def step_of(node: Node) -> StepState | None:
        """The node's step state if it is a step directory (see `step_number_at`)."""
        return node.step

    def step_number_at(self, parent: Node | None, name: bytes | str) -> int | None:
        """The step number of a directory `name` in `parent`: a step is a directory whose name
        matches the step pattern and that is not inside a step (whatever its name, a directory
        inside a step, such as Megatron's `mp_rank_00/`, is part of that step)."""
        if next(self.enclosing_steps(parent), None) is not None:
            return None
        return self.step_number(name)

    def single_file_step(self, parent: Node, name: bytes) -> StepState | None:
        """A regular file `name` in `parent` is a single-file step unless it is inside a step
        directory (then it is part of that step): a file step if its name carries a number
        (the file step pattern), else a loose file (no number). A name too long for its
        records directory beside it is a plain file, never persisted."""
        if (next(self.enclosing_steps(parent), None) is not None
                or len(layout.records_name(name)) > NAME_MAX):
            return None
        return StepState(self.step_number(name, self.file_pattern))

    def step_number(self, name: bytes | str, pattern: re.Pattern[str] | None = None
                    ) -> int | None:
        """The step number a directory name (or with the file pattern, a file name) carries,
        or None if it is not a step name."""
        match = (pattern or self.pattern).match(os.fsdecode(name))
        if match is None:
            return None
        try:
            return int(match.group(1))
        except (IndexError, TypeError, ValueError):
            return None

    def committed_step_holding(self, node: Node) -> StepState | None:
        for step_node in self.enclosing_steps(node):
            step = self.step_of(step_node)
            if step is not None:
                return step if step.committed else None
        return None

    def has_active_writers(self, dir_node: Node) -> bool:
        return any(node.active_writers for node in self.walk_files(dir_node))

    def busy(self, step_node: Node) -> bool:
        """A file of the step is open, or bytes of one are on their way in."""
        return any(n.handles or (n.fetch and n.fetch.busy) for n in self.walk_files(step_node))

    def has_partial_fetches(self, step_node: Node) -> bool:
        return any(self.holds(step_node, n) for n in self.fetching)

    def seal_describes_file(self, node: Node) -> bool:
        """Whether the node's seal still describes its backing file (see `Seal`)."""
        if node.seal is None:
            return False
        try:
            st = self.stat(node)
        except (FsError, OSError):
            return False
        return isinstance(st, os.stat_result) and node.seal.describes(st)

    def stale_seals(self, files: list[tuple[str, Node]]) -> list[Node]:
        """Files whose bytes may have changed behind their seal: only a file open for writing
        can change without the daemon seeing it (passthrough), so only those are looked at."""
        return [node for _rel, node in files
                if any(h.writable for h in node.handles) and not self.seal_describes_file(node)]

    # -- directories -----------------------------------------------------------------------

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        path = self._new_entry_path(parent, name)
        os.mkdir(path, mode & 0o7777)
        _chown(path, uid, gid)
        node = self.attach(parent, name, stat.S_IFDIR)
        number = self.step_number_at(parent, name)
        if number is not None:
            node.step = StepState(number)
            self._watch.step_started(node)
        self.mark_dirty(parent)
        return node

    def rmdir(self, parent: Node, name: bytes) -> None:
        node = self.existing_entry(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        path = self.backing(node)
        if node.step is not None:
            self._step_removed(node.step)
        self.remove_hidden(node, path)
        os.rmdir(path)
        self.detach(node)
        self.mark_dirty(parent)

    def _single_file_removed(self, node: Node) -> None:
        """A single-file step leaves its name (unlink, rename, replaced by a rename): its
        committed version is deleted from every tier, its records go."""
        if node.step is None or node.is_dir:
            return
        self._step_removed(node.step)
        self.remove_hidden(node, self.backing(node))
        node.step = None

    def _step_removed(self, step: StepState) -> None:
        """A step directory leaves the tree (rmdir, or a directory renamed over it). If it held
        a committed version (even one being re-saved), that version is deleted from every tier,
        and never listed again (fs.deletes)."""
        if step.manifest is not None:
            self._deletes.record(step.manifest.path, step.manifest.version,
                                 step.manifest.committed_ns)

    def symlink(self, parent: Node, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        path = self._new_entry_path(parent, name)
        os.symlink(target, path)
        _chown(path, uid, gid)
        self.mark_dirty(parent)
        node = self.attach(parent, name, stat.S_IFLNK)
        self.links.note(self.relpath(parent))
        return node

    def readlink(self, node: Node, pid: int | None = None) -> bytes:
        """A symbolic link's target; for `latest`, the one process `pid` sees (latest_pins)."""
        if node.virtual:
            parent = node.parent
            if self.owns_latest(parent):
                raise FsError(errno.ENOENT)  # removed, or a real `latest` came since
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
        node = self.attach(parent, name, kind)
        if kind == stat.S_IFREG:
            self.store.account_path(path)
            node.step = self.single_file_step(parent, name)
            self.mark_dirty(node)
        return node

    def check_special_destination(self, node: Node, new_parent: Node) -> None:
        """A FIFO or socket may not be renamed into a step directory either."""
        if node.kind in (stat.S_IFIFO, stat.S_IFSOCK):
            self._check_special_parent(new_parent)

    def _check_special_parent(self, parent: Node) -> None:
        if any(self.step_of(node) is not None for node in self.enclosing_steps(parent)):
            raise FsError(errno.EPERM, "FIFOs and sockets cannot be part of a step")

    # -- files -----------------------------------------------------------------------------

    def create(self, parent: Node, name: bytes, mode: int, flags: int, uid: int,
               gid: int, pid: int = 0) -> tuple[Node, Handle]:
        path = self._new_entry_path(parent, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode & 0o7777)
        try:
            _chown(path, uid, gid)
        except OSError:
            os.close(fd)
            raise
        node = self.attach(parent, name, stat.S_IFREG)
        node.step = self.single_file_step(parent, name)
        self.store.account_fd(fd)
        handle = self._new_handle(node, fd, writable=True, pid=pid)
        self.activate(handle)
        return node, handle

    @staticmethod
    def check_openable(node: Node) -> None:
        if node.virtual:
            raise FsError(errno.EROFS)
        if not node.is_file:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)

    def open_remote(self, node: Node) -> Handle:
        """A read-only handle of a file whose bytes come on demand (`Residency.read_remote`)."""
        return self._new_handle(node, -1, writable=False)

    def open_backing(self, node: Node, *, writable: bool, truncate: bool) -> Handle:
        """A handle on the node's backing file (private already if `writable`)."""
        fd = os.open(self.backing(node), (os.O_RDWR if writable else os.O_RDONLY))
        handle = self._new_handle(node, fd, writable)
        if truncate:
            os.ftruncate(fd, 0)
            self.store.account_fd(fd)
            self.activate(handle)
        return handle

    def read(self, handle: Handle, offset: int, size: int) -> bytes:
        """Bytes of a resident file (a handle opened while it was not resident reopens it)."""
        if handle.fd < 0:
            handle.fd = os.open(self.backing(handle.node), os.O_RDONLY)  # it became resident
        return os.pread(handle.fd, size, offset)

    def needs_room(self, handle: Handle, offset: int, length: int) -> bool:
        """Whether writing `length` bytes at `offset` may need more room than the tier has:
        not when every byte it covers is stored already (an overwrite inside a file without
        holes)."""
        if self.store.room_for(length):
            return False
        st = os.fstat(handle.fd)
        return offset + length > st.st_size or allocated(st) < st.st_size

    def write(self, handle: Handle, offset: int, data: bytes) -> int:
        """Write through an active handle (`activate` came first, before any wait for room)."""
        written = os.pwrite(handle.fd, data, offset)
        self.store.account_fd(handle.fd)
        return written

    def account_direct_writes(self) -> None:
        """Bring the RAM tier's accounting up to date with passthrough writes in progress."""
        for handle in self._handles.values():
            if handle.passthrough and handle.writable and handle.fd >= 0:
                self.store.account_fd(handle.fd)

    async def end_writer(self, handle: Handle, *, final: bool) -> bool:
        """End of a close() (FLUSH), or of the open file (`final`, its RELEASE): seal what this
        handle wrote. Whether a writer ended (then its step may commit: `fs.commits`)."""
        # The kernel writes passthrough files without us, and flushes at the close of every
        # duplicate descriptor (shell `>`, dd, forked children): writes through the other
        # duplicates may follow a flush. A seal that no longer describes the file is redone,
        # and so is any seal taken before the last of several closes. A seal still being
        # computed checks the file's inode, size and mtime around its hash itself.
        if handle.passthrough and handle.writable and not handle.active and (
                (final and handle.flushes > 1) or not (self.seal_describes_file(handle.node)
                                                       or self.sealing.pending(handle.node))):
            self.activate(handle)
        if not final:
            handle.flushes += 1
        if not handle.active:
            return False
        if handle.passthrough:
            self.store.account_fd(handle.fd)
        node = handle.node
        handle.active = False
        node.active_writers -= 1
        if node.active_writers == 0:
            self.sealing.start(node)  # off the writer's path: the close returns now
        self._released.set()
        self._released = trio.Event()
        return True

    def close(self, handle: Handle) -> None:
        """The open file is gone (RELEASE, after `end_writer`)."""
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

    @staticmethod
    def fsync(handle: Handle) -> None:
        if handle.fd >= 0:
            os.fsync(handle.fd)

    def unlink(self, parent: Node, name: bytes) -> bool:
        """Remove a file; False for the virtual `latest`, which no file stands behind."""
        if name == LATEST and parent.is_dir and LATEST not in parent.children:
            # The virtual `latest` goes for good: the directory's `latest` is its own from now
            # on, so that `rm latest` then `open("latest", "w")` makes a real file (a saver
            # writing its own tracker), and `rm -r run1` works.
            self.keep_own_latest(parent)
            return False
        node = self.existing_entry(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if node.kind == stat.S_IFLNK:
            self.links.note(self.relpath(parent))
        self._single_file_removed(node)
        if node.remote is None:
            self.unlink_backing(self.backing(node), node)
        self.drop_fetch(node)
        self.detach(node)
        self.mark_dirty(parent)
        return True

    def setattr(
        self, node: Node, handle: Handle | None, *, mode: int | None = None,
        uid: int | None = None, gid: int | None = None, size: int | None = None,
        atime_ns: int | None = None, mtime_ns: int | None = None,
    ) -> None:
        """Change attributes of a resident file (private already if `size` is given)."""
        # A change of metadata alone (utime moves the mtime a seal is checked against) keeps it.
        keeps_seal = size is None and node.is_file and self.seal_describes_file(node)
        target: bytes | int
        try:
            target = self.backing(node)
        except FsError:
            if handle is None:
                raise
            target = handle.fd
        if size is not None:
            self._truncate(node, handle, target, size)
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
        if node.is_file and size is None and (mode, uid, gid, mtime_ns) != (None,) * 4:
            # Mode, owner and mtime are committed state: the step commits again, as a
            # version with new attributes only (no byte goes anywhere again).
            self.mark_dirty(node)
            for step_node in self.enclosing_steps(node):
                step_node.step.attributes_changed = True

    @staticmethod
    def check_truncatable(node: Node) -> None:
        if not node.is_file:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)

    def _truncate(self, node: Node, handle: Handle | None, target: bytes | int,
                  size: int) -> None:
        self.check_truncatable(node)
        # A file grown by truncate stores nothing more (tmpfs keeps no holes): no room needed.
        if isinstance(target, bytes):
            os.truncate(target, size)
            self.store.account_path(target)
        else:
            os.ftruncate(target, size)
            self.store.account_fd(target)
        if handle is not None and handle.active:
            return
        node.gen += 1
        node.seal = None
        self.mark_dirty(node)

    # -- copy on write ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def unshare_lock(self, node: Node) -> AsyncIterator[None]:
        """One copy on write at a time per file: two writers of the same committed file must
        not each make a copy; writers of different files do not wait for each other."""
        lock = self._unshare_locks.setdefault(node, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._unshare_locks.pop(node, None)

    def shared_backing(self, node: Node) -> tuple[bytes, os.stat_result] | None:
        """The node's backing path and stat if its inode is shared with a committed object."""
        path = self.backing(node)
        st = os.lstat(path)
        return (path, st) if st.st_nlink > 1 else None

    def replace_shared(self, node: Node, path: bytes, st: os.stat_result, copy: bytes) -> bool:
        """Swap a private `copy` in for the shared inode `st` at `path`; False (the copy is
        removed) if a rename moved things meanwhile, and the caller tries again."""
        # No await here: the copy replaces the shared inode only if the node is still where
        # it was and still that inode.
        try:
            unchanged = (self.backing(node) == path and os.lstat(path).st_ino == st.st_ino)
        except (FsError, FileNotFoundError):
            unchanged = False
        if not unchanged:
            os.unlink(copy)
            return False
        os.rename(copy, path)
        backing_ino = self.store.account_path(path)
        for handle in node.handles:  # open handles follow the file to its new inode
            if handle.fd >= 0:
                fresh = os.open(path, os.O_RDWR if handle.writable else os.O_RDONLY)
                os.dup2(fresh, handle.fd)
                os.close(fresh)
                handle.backing_ino = backing_ino
        return True

    # -- rename ----------------------------------------------------------------------------

    def rename(self, node: Node, old_parent: Node, old_name: bytes, new_parent: Node,
               new_name: bytes, flags: int) -> bool:
        """Move `node` (the resident entry `old_name` of `old_parent`); False if it is there
        already. Step identities below it are the caller's next step (`Commits.renamed_dir`)."""
        if not new_parent.is_dir:
            raise FsError(errno.ENOTDIR)
        target = new_parent.children.get(new_name)
        if target is node:
            return False
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if node.is_dir and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if target.is_dir and not node.is_dir:
                raise FsError(errno.EISDIR)
            if target.is_dir and target.children:
                raise FsError(errno.ENOTEMPTY)
        if node.is_dir and self.holds(node, new_parent):
            raise FsError(errno.EINVAL)
        old_path = self.backing(node)
        new_path = os.path.join(self.backing(new_parent), new_name)
        old_rel = self.relpath(node)
        new_rel = layout.join(self.relpath(new_parent), os.fsdecode(new_name))
        link_dirs = self._dirs_with_links(node, old_rel)
        if target is not None and target.kind == stat.S_IFLNK:
            link_dirs.append(("", self.relpath(new_parent)))
        for _below, directory in link_dirs:  # their objects in the store go or change
            self.links.note(directory)
        if target is not None:
            if target.is_dir:
                if target.step is not None:
                    self._step_removed(target.step)
                self.remove_hidden(target, new_path)
            else:
                self._single_file_removed(target)
                if target.remote is None:
                    self._forget_backing_if_last(new_path, target)
        self._record_moves(node, new_rel)
        if not node.is_dir and node.step is not None:
            # a step at its new name (Commits.after_rename); the move is recorded
            self.remove_hidden(node, self.backing(node))
            node.step = None
        if new_name == LATEST:
            self.keep_own_latest(new_parent)  # `mv -T tmp latest`: a real `latest` from now on
        if node.remote is None or node.is_dir:  # a file only in the store has no bytes here
            os.rename(old_path, new_path)
        if target is not None:
            self.detach(target)
        self.mark_dirty(old_parent)
        del old_parent.children[old_name]
        node.name = new_name
        node.parent = new_parent
        new_parent.children[new_name] = node
        if node.is_file:
            node.step = self.single_file_step(new_parent, new_name)
            self.mark_dirty(node)
        else:
            self.mark_dirty(new_parent)
        for below, _directory in self._dirs_with_links(node, new_rel):
            self.links.note(layout.join(new_rel, below) if below else
                            (new_rel if node.is_dir else self.relpath(new_parent)))
        return True

    def _dirs_with_links(self, node: Node, at: str) -> list[tuple[str, str]]:
        """For a rename of `node` (at `at`): (the path below it, or "", the path) of every
        directory whose links it moves: the node's own directory if it is a link, else the
        directories at or below it holding links."""
        if node.kind == stat.S_IFLNK:
            return [("", at.rpartition("/")[0])]
        if not node.is_dir:
            return []
        found = []
        for directory in (node, *self.dirs_under(node)):
            if any(c.kind == stat.S_IFLNK for c in directory.children.values()):
                below = self.relpath(directory)[len(at) + 1:] if directory is not node else ""
                found.append((below, layout.join(at, below) if below else at))
        return found

    # -- symbolic links as committed state (fs.links) ----------------------------------------

    def adopt_links(self, directory: str, links: dict[str, str]) -> int:
        """Make the links the store keeps for `directory` (a fresh RAM dir); an entry of
        that name here stays. The number made."""
        parent = self.root
        for part in map(os.fsencode, directory.split("/") if directory else ()):
            child = parent.children.get(part)
            if child is not None and (not child.is_dir or child.step is not None):
                return 0  # a step directory holds no kept links
            if child is None:
                if self.step_number_at(parent, part) is not None:
                    return 0
                os.mkdir(os.path.join(self.backing(parent), part), 0o755)
                child = self.attach(parent, part, stat.S_IFDIR)
            parent = child
        made = 0
        for name, target in links.items():
            raw = os.fsencode(name)
            if raw in parent.children or (raw == LATEST and self.owns_latest(parent)):
                continue
            os.symlink(target, os.path.join(self.backing(parent), raw))
            self.attach(parent, raw, stat.S_IFLNK)
            made += 1
        return made

    def _record_moves(self, node: Node, new_path: str) -> None:
        """`node` moves to `new_path`: every committed step at or below it is renamed in every
        tier (fs.deletes: its old name leaves them once its new one is there). Recorded before
        the rename, so that no crash lets the old name come back."""
        if not node.is_dir and node.step is None:
            return  # a file inside a step: that step commits again
        old_path = self.relpath(node)
        for step_node in self.steps(under=node):
            manifest = step_node.step.manifest
            if manifest is None:
                continue
            at = self.relpath(step_node)
            moved_to = new_path + at[len(old_path):]
            self._deletes.record(at, manifest.version, manifest.committed_ns,
                                 moved_to=moved_to)

    def check_rename(self, old_parent: Node, old_name: bytes, new_name: bytes,
                     flags: int) -> Node:
        """The node a rename moves, after the checks that come before any await."""
        if flags & ~RENAME_NOREPLACE:
            raise FsError(errno.EINVAL)  # RENAME_EXCHANGE and friends: not supported
        node = self.existing_entry(old_parent, old_name)
        self._check_new_name(new_name)
        return node

    def become_step(self, node: Node, number: int) -> None:
        """A directory renamed onto a step name: a step being written (it commits once more)."""
        if node.step is None:
            node.step = StepState(number, self.records.read_manifest(self.backing(node)))
        node.step.number = number
        node.step.dirty = True  # whatever it held before, it is committed only once more
        self._watch.touch(node)

    def restep(self, node: Node, number: int | None) -> None:
        """After a rename above it: a directory with a step name and no step above becomes a
        step (a directory inside a step is part of that step)."""
        if number is not None and node.step is None:
            node.step = StepState(number, self.records.read_manifest(self.backing(node)))
            self._watch.touch(node)

    def stop_being_step(self, node: Node) -> None:
        """A directory (its files all resident) stops being a step: its files stay, its
        manifest goes."""
        self.remove_hidden(node, self.backing(node))
        node.step = None

    def become_single_file(self, node: Node, state: StepState) -> None:
        """A file moved (with a directory above it) to where it is a single-file step: one
        being written again, at its new path (it commits once more)."""
        if node.step is None:
            node.step = state
        node.step.number = state.number
        node.step.dirty = True
        self._watch.touch(node)

    def stop_being_single_file(self, node: Node) -> None:
        """A file (resident) moved into a step directory: part of that step from now on."""
        self.remove_hidden(node, self.backing(node))
        node.step = None

    # -- seals -----------------------------------------------------------------------------

    async def seal(self, node: Node) -> None:
        """Seal the node now, or join the hash of it already running (`fs.sealing`)."""
        await self.sealing.seal(node)

    def activate(self, handle: Handle) -> None:
        """First write since open or flush: the file is no longer sealed; its step is dirty."""
        handle.active = True
        node = handle.node
        node.active_writers += 1
        node.gen += 1
        node.seal = None
        self.mark_dirty(node)

    def written_behind_seal(self, node: Node) -> None:
        """The kernel wrote `node` through a passthrough descriptor after its seal: it counts as
        being written until that descriptor's next close."""
        for handle in node.handles:
            if handle.writable and handle.passthrough and not handle.active:
                self.activate(handle)
                return
        node.gen += 1
        node.seal = None

    # -- commit ------------------------------------------------------------------------------

    def write_manifest(self, step_node: Node, files: list[tuple[str, Node]],
                       copies: dict[Node, bytes]) -> mf.StepManifest:
        """The commit's change (see the module docstring: no await may come before it once
        the step is checked): the manifest on disk, the objects' references, the step state.
        Returns the old manifest if nothing changed since it. The private copies it makes
        committed objects leave `copies`; the caller removes the rest."""
        step = step_node.step
        old = step.manifest
        step_path = self.relpath(step_node)
        number = mf.NO_STEP if step.number is None else step.number
        entries = []
        paths: list[bytes | None] = []  # each file's backing path, made once (10,000 files)
        for rel, node in files:
            if node.remote is not None:  # held by other nodes (a multi-node step's shards)
                entries.append(dataclasses.replace(node.remote.entry, name=rel))
                paths.append(None)
                continue
            paths.append(path := self.backing(node))
            entries.append(mf.entry_from_stat(rel, node.seal.digest, os.lstat(path)))
        if step.number is None and step_node.is_file and files and files[0][1].remote is None:
            node = files[0][1]  # a loose file: appended, only its new bytes go (fs.append_layout)
            entries = [append_layout.lay_out(old, step_path, entries[0],
                                       copies.get(node) or self.backing(node))]
        if (old is not None and old.path == step_path and old.step == number
                and (old.same_entries(entries) if step.attributes_changed else
                     old.same_content(mf.StepManifest(step_path, 0, 1, "", 0, tuple(entries))))):
            step.attributes_changed = False
            step.dirty = False
            step.commit_pending = False
            return old
        manifest = mf.StepManifest(
            path=step_path, step=number, version=old.version + 1 if old else 1,
            node_id=self.node_id, committed_ns=time.time_ns(), files=tuple(entries),
            single_file=step_node.is_file,
        )
        manifest_path = os.path.join(self.records_path(step_node), mf.MANIFEST_NAME.encode())
        tmp = self.records.write_temp(manifest_path, mf.encode(manifest))  # may fail: ENOSPC
        for (_rel, node), entry, path in zip(files, entries, paths, strict=True):
            if path is not None:
                self.store.add_ref(entry.xxh3, path, copies.get(node))
                copies.pop(node, None)  # the object now, or removed by add_ref
        os.rename(tmp, manifest_path)
        self.drop_resident_refs(step)
        step.manifest = manifest
        step.resident = {rel for rel, node in files if node.remote is None}
        step.attributes_changed = False
        step.dirty = False
        step.commit_pending = False
        return manifest

    def unchanged_since_commit(self, step: StepState, rel: str, node: Node) -> bool:
        """Whether a file of a step being saved again is still exactly what its committed
        version holds: in RAM, sealed with that version's content, and still the committed
        object itself (its inode shared with it: a write would have made it private)."""
        entry = step.manifest.entry(rel) if step.manifest is not None else None
        if (entry is None or node.remote is not None or rel not in step.resident
                or node.seal is None or node.seal.digest.xxh3 != entry.xxh3):
            return False
        try:
            return self.shared_backing(node) is not None
        except (FsError, OSError):
            return False

    @staticmethod
    def leave_pending(step: StepState, reason: str | None) -> None:
        """The commit waits (`reason`, shown by status; None keeps the reason known)."""
        step.commit_pending = True
        if reason is not None:
            step.waiting_for = reason

    @staticmethod
    def note_waiting(step: StepState, reason: str | None) -> None:
        step.waiting_for = reason

    @staticmethod
    def note_dcp_files(step: StepState, key: tuple[int, int, int], names: set[str]) -> None:
        """The files a DCP `.metadata` (inode, size, mtime) names: pending commits ask again."""
        step.dcp_files = (key, names)

    def touch_enclosing(self, node: Node | None) -> None:
        """Its steps commit `commit_idle` seconds after this (fs.quiet_commits)."""
        for step_node in self.enclosing_steps(node):
            self._watch.touch(step_node)

    # -- fetches and residency ---------------------------------------------------------------

    def start_fetch(self, node: Node, fetch: Fetch) -> Fetch:
        node.fetch = fetch
        self.fetching.add(node)
        return fetch

    def drop_fetch(self, node: Node) -> None:
        if node.fetch is not None:
            node.fetch.discard()
            self._unset_fetch(node)

    def _unset_fetch(self, node: Node) -> None:
        node.fetch = None
        self.fetching.discard(node)

    def adopt_fetch(self, node: Node, fetch: Fetch, good: bool) -> bool:
        """A complete fetch, checked against its xxh3-128 (`good`), becomes the file's committed
        object. False if the node moved on meanwhile (unlinked or evicted)."""
        if node.fetch is not fetch or node.remote is None:
            return False
        self._unset_fetch(node)
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
        node.seal = Seal(mf.Digest.of(entry), fetch.backing_ino)
        step = self.committed_step_holding(node)
        if step is not None and entry.name not in step.resident:
            self.store.add_ref(entry.xxh3, path)
            step.resident.add(entry.name)
        return True

    def make_empty_resident(self, node: Node) -> None:
        """A non-resident file truncated to nothing: an empty file in RAM, as committed."""
        path = self.backing(node)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            apply_attributes(fd, node.remote.entry)  # its owner and mode, not the daemon's
        finally:
            os.close(fd)
        self.drop_fetch(node)
        node.remote = None
        self.mark_dirty(node)

    def evict_file(self, step: StepState, entry: mf.FileEntry, node: Node) -> int | None:
        """One file of a committed step leaves RAM unless it is in use; the bytes freed, or
        None if it stays or had nothing in RAM."""
        if node.handles or (node.fetch is not None and node.fetch.busy):
            return None  # open, or bytes on their way in: it stays (a later eviction takes it)
        in_ram = node.fetch is not None or node.remote is None
        freed = 0
        if node.fetch is not None:
            freed += node.fetch.stored_bytes
            self.drop_fetch(node)  # ranges read on demand leave with the step
        if node.remote is None:
            self.unlink_backing(self.backing(node), node)
            node.remote = RemoteFile(self.data_dir(step), entry, step.persisted)
            node.seal = None
            freed += entry.size
        if entry.name in step.resident:
            step.resident.discard(entry.name)
            self.store.drop_ref(entry.xxh3)
        return freed if in_ram else None

    def quarantine(self, ino: int, digest: str) -> list[tuple[mf.StepManifest, str]]:
        """Every committed file on the bad inode `ino` becomes non-resident (readers go through
        the other tiers from now on); the object goes (its bytes are kept aside by the caller).
        The files that did: (their step's manifest, name)."""
        gone: list[tuple[mf.StepManifest, str]] = []
        for step_node in list(self.steps()):
            step = step_node.step
            if not step.committed:
                continue
            for rel, node in list(self.files_under(step_node)):
                entry = step.manifest.entry(rel)
                if (entry is None or node.remote is not None or rel not in step.resident
                        or node.seal is None or node.seal.backing_ino != ino):
                    continue
                for handle in node.handles:
                    if handle.fd >= 0 and not handle.writable:
                        os.close(handle.fd)
                        handle.fd = -1
                        handle.backing_ino = 0
                self.unlink_backing(self.backing(node), node)
                node.remote = RemoteFile(self.data_dir(step), entry, step.persisted)
                node.seal = None
                step.resident.discard(entry.name)
                self.store.drop_ref(entry.xxh3)
                gone.append((step.manifest, entry.name))
        obj = self.store.object_path(digest)
        try:
            st = os.lstat(obj)
        except FileNotFoundError:
            return gone
        if st.st_ino == ino:  # still named by a step being re-saved: the bytes are bad anyway
            os.unlink(obj)
            if st.st_nlink == 1:
                self.store.forget_inode(ino)
        return gone

    def add_remote_files(self, step_node: Node, entries: list[mf.FileEntry],
                         step_path: str | None = None, *, in_store: bool = False) -> None:
        """Nodes for committed files whose bytes are in another tier (with their directories);
        `step_path` is the data dir (`layout.data_dir`) if the step's manifest is not yet its;
        `in_store`: the persistent tier holds them."""
        data_dir = step_path or self.data_dir(step_node.step)
        for entry in entries:
            parent, name = self._entry_parent(step_node, entry.name)
            node = parent.children.get(name)
            if node is None:
                node = self.attach(parent, name, stat.S_IFREG)
            # A file renamed before its new name reached the store: its old name holds it.
            moved = not in_store and bool(self._deletes.old_keys(
                layout.object_key(data_dir, entry.name)))
            node.remote = RemoteFile(data_dir, entry, in_store or moved)

    def _entry_parent(self, step_node: Node, relative: str) -> tuple[Node, bytes]:
        """The directory node (made if missing) and the name of a manifest entry."""
        if step_node.is_file:
            return step_node.parent, step_node.name
        *dirs, name = relative.split("/")
        parent = step_node
        for part in map(os.fsencode, dirs):
            child = parent.children.get(part)
            if child is None:
                os.makedirs(os.path.join(self.backing(parent), part), 0o755, exist_ok=True)
                child = self.attach(parent, part, stat.S_IFDIR)
            parent = child
        return parent, os.fsencode(name)

    def fill_from_objects(self, step_node: Node) -> None:
        """Files of this step that are not resident but whose objects are here become
        resident (a replica sent them)."""
        step = step_node.step
        for _rel, node in self.files_under(step_node):
            if node.remote is None or node.fetch is not None:
                continue
            entry = node.remote.entry
            obj = self.store.object_path(entry.xxh3)
            if not obj.exists():
                continue
            path = self.backing(node)
            tmp = self.store.tmp_path(os.path.dirname(path))
            os.link(obj, tmp)
            apply_attributes(tmp, entry)
            os.rename(tmp, path)
            node.remote = None
            node.seal = Seal(mf.Digest.of(entry),
                             os.lstat(path).st_ino)
            if entry.name not in step.resident:
                self.store.add_ref(entry.xxh3, path)
                step.resident.add(entry.name)

    def drop_resident_refs(self, step: StepState) -> None:
        if step.manifest is not None:
            for name in step.resident:
                self.store.drop_ref(step.manifest.entry(name).xxh3)
        step.resident = set()

    # -- `latest` --------------------------------------------------------------------------
    #
    # Two questions, kept apart: whether a directory shows the virtual `latest` link at all
    # (`shows_virtual_latest`: not where the name is the saver's own), and which step it names
    # (`_latest_target`).

    def shows_virtual_latest(self, dir_node: Node) -> bool:
        """Whether `dir_node` has the virtual `latest` link: it holds a committed step and its
        `latest` is not its own."""
        return not self.owns_latest(dir_node) and self._latest_target(dir_node) is not None

    @staticmethod
    def owns_latest(dir_node: Node) -> bool:
        """Whether `latest` in this directory belongs to the saver, never to tierfs: a real
        entry has the name, or had it once, or the virtual link was removed (all three
        recorded in the directory: `keep_own_latest`), or it holds DeepSpeed's step
        directories (`global_stepN`), beside which DeepSpeed writes its own `latest` file.

        The kernel decides alone what an open with O_CREAT of a name whose lookup found a
        symbolic link does: it follows the link (to a step directory: EISDIR). A lookup cannot
        tell a create from a read, so the link must be absent wherever a saver writes a
        `latest` of its own, before it does."""
        return (dir_node.own_latest or LATEST in dir_node.children
                or any(node.step is not None and _DEEPSPEED_STEP.match(name)
                       for name, node in dir_node.children.items()))

    def keep_own_latest(self, dir_node: Node) -> None:
        """From now on `latest` in this directory is its own (`owns_latest`), also after a
        restart: the mark is on disk before it counts. Not inside a step, where there is no
        virtual link."""
        if (dir_node.own_latest or not dir_node.is_dir
                or next(self.enclosing_steps(dir_node), None) is not None):
            return
        os.close(os.open(os.path.join(self.backing(dir_node), OWN_LATEST_MARK),
                         os.O_WRONLY | os.O_CREAT, 0o600))
        dir_node.own_latest = True

    def _latest_target(self, dir_node: Node) -> bytes | None:
        """The step the virtual `latest` of `dir_node` names: its committed step directory
        with the highest number that can be read whole now (None: none can)."""
        committed = [(node.step.number, name, node.step)
                     for name, node in dir_node.children.items()
                     if node.is_dir and node.step is not None and node.step.committed]
        if not committed:
            return None
        newest = max(committed, key=lambda found: found[:2])
        if self.recoverable.whole(newest[2]):
            return newest[1]  # as a rule: the newest step is whole
        for _number, name, step in sorted(committed, key=lambda found: found[:2],
                                          reverse=True):
            if self.recoverable.whole(step):
                return name
        return None

    def _is_committed_step(self, dir_node: Node, name: bytes) -> bool:
        node = dir_node.children.get(name)
        step = self.step_of(node) if node is not None and node.is_dir else None
        return step is not None and step.committed

    def note_opened(self, handle: Handle, pid: int) -> None:
        """Process `pid` opened `handle` (the commit names it while it waits for it): if it
        reached the file through its pinned `latest`, the pin lasts while the file is open."""
        handle.pid = pid
        step_node = next((n for n in self.enclosing_steps(handle.node.parent)
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

    # -- helpers ---------------------------------------------------------------------------

    def _new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def attach(self, parent: Node, name: bytes, kind: int) -> Node:
        node = Node(self._new_ino(), kind, name, parent)
        parent.children[name] = node
        self._inodes[node.ino] = node
        return node

    def detach(self, node: Node) -> None:
        if node.parent is not None and node.parent.children.get(node.name) is node:
            del node.parent.children[node.name]
        node.parent = None
        if node.is_dir:  # directories held open for long paths, in what leaves the tree
            for gone in (node, *self.dirs_under(node)):
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

    def _new_handle(self, node: Node, fd: int, writable: bool, pid: int = 0) -> Handle:
        handle = Handle(self._next_fh, node, fd, writable, pid)
        self._next_fh += 1
        self._handles[handle.fh] = handle
        node.handles.append(handle)
        return handle

    def mark_dirty(self, node: Node | None) -> None:
        for step_node in self.enclosing_steps(node):
            step_node.step.dirty = True
            self._watch.touch(step_node)

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
        if name == LATEST:
            self.keep_own_latest(parent)  # marked before the entry is made
        return os.path.join(self.backing(parent), name)

    def existing_entry(self, parent: Node, name: bytes) -> Node:
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        node = parent.children.get(name)
        if node is None:
            if name == LATEST and self.shows_virtual_latest(parent):
                raise FsError(errno.EROFS)
            raise FsError(errno.ENOENT)
        return node

    def unlink_backing(self, path: bytes, node: Node) -> None:
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

    def remove_hidden(self, dir_node: Node, path: bytes) -> None:
        """Remove tierfs's own entries of an otherwise empty directory (a deleted step), or
        the records directory of a single-file step (`path`: the file)."""
        step = dir_node.step
        if step is not None:
            self.drop_resident_refs(step)
            step.manifest = None
        elif dir_node.is_dir:  # a committed step renamed to a name that is not a step name
            manifest = self.records.read_manifest(path)
            for entry in manifest.files if manifest else ():
                if os.path.exists(os.path.join(path, os.fsencode(entry.name))):
                    self.store.drop_ref(entry.xxh3)
        if not dir_node.is_dir:
            shutil.rmtree(os.path.join(os.path.dirname(path), layout.records_name(
                os.path.basename(path))), ignore_errors=True)
            return
        for name in os.listdir(path):
            if is_reserved(name):
                hidden = os.path.join(path, name)
                if os.path.isdir(hidden) and not os.path.islink(hidden):
                    shutil.rmtree(hidden)  # a single-file step's records
                else:
                    os.unlink(hidden)


def _chown(path: bytes, uid: int, gid: int) -> None:
    if (uid, gid) != (os.geteuid(), os.getegid()):
        os.chown(path, uid, gid, follow_symlinks=False)

