"""The tree: inodes, directories, open files, step state and the RAM store's references.

The tree lives twice: as real files under the RAM store's `tree/` (the durable truth, so a crash
loses nothing written) and as `Node` objects in memory (inode numbers, lookup counts, open
handles, seals and step state). Only the tree's core changes either, and the RAM store's
references to committed objects, so it alone keeps them in step: `Tree` (the file system calls'
changes and the primitives: `attach`, `detach`, `unlink_backing`...) and its parts, which
change the tree only through those primitives (`fs.tree.tree_primitives`) and by the same rules:
`fs.tree.sealing` (seals), `fs.tree.copy_on_write`, `fs.tree.residents` (where committed files'
bytes are), `fs.tree.step_manifests` (the commit's change), `fs.tree.step_identity` (which nodes
are steps), `fs.tree.step_removals` (a step leaving its name), `fs.tree.virtual_latest` (each
directory's `latest`), `fs.tree.renames` (an entry moved, the steps it moves recorded),
`fs.tree.attributes` (chmod, chown, utime, truncate) and
`fs.lifecycle.step_versions` (versions the other tiers install, join, supersede or forget). Its
collaborators (`fs.lifecycle.fetch_back`, `fs.lifecycle.eviction`, `fs.lifecycle.other_tiers`,
`fs.lifecycle.commits`, `fs.lifecycle.quiet_commits`, `fs.lifecycle.recovery`,
`fs.lifecycle.verify`) decide *when* something changes. What only reads the tree is
elsewhere: `fs.model.tree_walk` (finding nodes), `fs.tree.node_attrs` (a node's
attributes in any tier), `fs.tree.tree_view` (peers' questions, status,
xattrs), `fs.tree.holders.Holdings` (who else holds a step). It calls nothing outward but the
ports it is given (`fs.model.ports`: `StepWatch`, `DeleteLog`).

Invariants (S3QL-style note: where an `await` must not appear):

* A file is *sealed* after its last active writer flushes: its xxh3-128 is computed in the
  background (`fs.tree.sealing`) and kept only if no writer became active meanwhile (`Node.gen` did
  not move) and the backing file did not change; a commit waits for the seals of its files.
* The commit's change (`StepManifests.write_manifest`) runs without any `await` from the
  moment the commit re-checks the step (`fs.lifecycle.commits`): handlers see the old state or
  the new.
* Committed objects are never written (`fs.tree.copy_on_write`).
* Every other change (a file created, renamed or removed, a fetch adopted, a file evicted, a
  step installed or forgotten) is one synchronous method: handlers see a file either before or
  after it, never half changed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from tierfs import layout
from tierfs.fs.model import links as symlinks
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import (
    DEFAULT_FILE_STEP_PATTERN,
    DEFAULT_STEP_PATTERN,
    LATEST,
    NAME_MAX,
    ROOT_INODE,
    FsError,
    Handle,
    Node,
    RemoteAttrs,
    StepState,
)
from tierfs.fs.store.long_paths import LONG_PATH, anchor_path
from tierfs.fs.store.ram_store import RamStore, allocated, fallocate, is_reserved
from tierfs.fs.tree.attributes import Attributes
from tierfs.fs.tree.copy_on_write import CopyOnWrite
from tierfs.fs.tree.cut_short import CutShort
from tierfs.fs.tree.dir_attributes import DirAttributes, times_kept
from tierfs.fs.tree.holders import Holdings
from tierfs.fs.tree.kernel_cache import KernelCache
from tierfs.fs.tree.node_attrs import node_attrs
from tierfs.fs.tree.records import StepRecords
from tierfs.fs.tree.recoverable import Recoverability
from tierfs.fs.tree.renames import Renames
from tierfs.fs.tree.residents import Residents
from tierfs.fs.tree.sealing import HASH_AT_COMMIT, Sealing
from tierfs.fs.tree.step_identity import StepIdentity
from tierfs.fs.tree.step_manifests import StepManifests
from tierfs.fs.tree.step_removals import StepRemovals
from tierfs.fs.tree.virtual_latest import VirtualLatest

if TYPE_CHECKING:
    from tierfs.fs.model.ports import DeleteLog, Liveness, Spawner, StepWatch

log = logging.getLogger(__name__)

# How long after a file began to be written the mount counts as saving (`Tree.writing`): a
# save opens its files one after another, while a file kept open for writing alone (a log)
# must not hold the hashes and uploads back for good.
SAVE_WINDOW = 30.0


@dataclass(frozen=True)
class TreeParts:
    """The Tree's parts, handed once to whoever builds its collaborators (`fs.namespace.Core`
    and `Namespace`), which give each collaborator the parts it uses: no one else takes a part
    through the Tree (tests/test_structure.py)."""

    records: StepRecords
    holdings: Holdings
    dir_attributes: DirAttributes
    kernel_cache: KernelCache
    recoverable: Recoverability
    sealing: Sealing
    copy_on_write: CopyOnWrite
    residents: Residents
    removals: StepRemovals
    manifests: StepManifests
    identity: StepIdentity
    latest: VirtualLatest
    renames: Renames
    attributes: Attributes
    cut_short: CutShort


class Tree:
    """The tree of one mount; see the module docstring for its invariants."""

    def __init__(self, store: RamStore, watch: StepWatch, deletes: DeleteLog, *,
                 node_id: str = "local", step_pattern: str = DEFAULT_STEP_PATTERN,
                 file_step_pattern: str = DEFAULT_FILE_STEP_PATTERN,
                 spawner: Spawner | None = None, liveness: Liveness | None = None) -> None:
        self.store = store
        self._records = StepRecords()
        self.node_id = node_id
        self._holdings = Holdings(node_id)  # who else holds a committed step's files
        self._watch = watch
        self._deletes = deletes
        self.tree_path = os.fsencode(store.tree)
        self.root = Node(ROOT_INODE, stat.S_IFDIR, b"", None)
        self._inodes: dict[int, Node] = {ROOT_INODE: self.root}
        self._next_ino = ROOT_INODE + 1
        self._handles: dict[int, Handle] = {}
        # Handles written (or, under passthrough, opened for writing) since their last close:
        # a save in progress, for which background hashes step aside (fs.tree.sealing).
        self._writers = 0
        self._writer_started = -math.inf  # time.monotonic() of the last one's first write
        # Bumped at every entry attached, detached or renamed: a commit that finds it as it
        # was when it listed a step's files needs no second walk to know they are the same.
        self.shape = 0
        self._next_fh = 1
        self._released = trio.Event()
        self.links = symlinks.LinkChanges()  # directories whose links the store must learn
        # directories made here for other tiers' steps, given the attributes recorded for them
        self._dir_attributes = DirAttributes()
        # what the kernel keeps of the tree, told of the changes it cannot see
        self._kernel_cache = KernelCache()
        # which committed steps can be read whole now (their state, `latest`)
        self._recoverable = Recoverability(node_id, self._holdings.file_peers, liveness)
        # The parts of the core, each changing the tree through the primitives here:
        # seals hashed off writers' path
        self._sealing = Sealing(self.backing, self.stat, spawner, settled=self.file_settled,
                                writing=self.writing)
        self._copy_on_write = CopyOnWrite(self, store=store)  # committed objects never change
        # where committed files' bytes are: fetched, evicted, quarantined
        self._residents = Residents(self, deletes, self._copy_on_write,
                                   dir_attributes=self._dir_attributes, store=store)
        # a step leaving its name: its delete recorded, tierfs's own entries of it removed
        self._removals = StepRemovals(self, deletes, residents=self._residents,
                                      records=self._records, store=store)
        self._manifests = StepManifests(self, self._residents, records=self._records,
                                       store=store)  # the commit's change
        # which directories and files are steps
        self._identity = StepIdentity(self, watch, step_pattern, file_step_pattern,
                                     records=self._records, removals=self._removals)
        # each directory's `latest` link
        self._latest = VirtualLatest(self.backing, self.attach_virtual, self._recoverable,
                                    self._identity.tracked_number)
        # renames: the entry moved, a target replaced, the steps moved recorded in every tier
        self._renames = Renames(self, deletes, self._identity, self._latest,
                                removals=self._removals)
        # chmod, chown, utime, truncate
        self._attributes = Attributes(self, self._sealing, store=store)
        self._cut_short = CutShort(self.relpath)  # files a write into failed (no room)
        self.parts = TreeParts(
            records=self._records, holdings=self._holdings, dir_attributes=self._dir_attributes,
            kernel_cache=self._kernel_cache, recoverable=self._recoverable,
            sealing=self._sealing, copy_on_write=self._copy_on_write, residents=self._residents,
            removals=self._removals, manifests=self._manifests, identity=self._identity,
            latest=self._latest, renames=self._renames, attributes=self._attributes,
            cut_short=self._cut_short)

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
        if name == LATEST and self._latest.shows(parent):
            return self._latest.node_in(parent)
        raise FsError(errno.ENOENT)

    def list_dir(self, node: Node) -> list[tuple[bytes, Node]]:
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        entries = list(node.children.items())
        if self._latest.shows(node):
            # First, so that `rm -r` meets it while it still exists (its unlink is a no-op).
            entries.insert(0, (LATEST, self._latest.node_in(node)))
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
        """Attributes of `node` (`fs.tree.node_attrs`: in any tier, or once its name is gone)."""
        return node_attrs(node, self.backing)

    def find_step(self, relpath: str) -> Node | None:
        node = self.root
        try:
            for part in relpath.split("/"):
                node = self.child(node, os.fsencode(part))
        except FsError:
            return None
        return node if node.step is not None else None

    def records_path(self, step_node: Node) -> bytes:
        """Where a step's records (manifest, marks) are in the store: in a step directory, or
        for a single-file step in its records directory beside the file (made if missing)."""
        if step_node.is_dir:
            return self.backing(step_node)
        parent = self.backing(step_node.parent)
        path = os.path.join(parent, layout.records_name(step_node.name))
        if not os.path.isdir(path):
            with times_kept(parent), contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        return path

    def data_dir(self, step: StepState) -> str:
        """The path its committed files are relative to (`layout.data_dir`)."""
        return layout.data_dir(step.manifest.path, step.manifest.single_file)

    def find_dir(self, relpath: str) -> Node:
        """The directory at `relpath` (`""` or `.` is the root); ENOTDIR if it is not one."""
        node = self.root
        for part in (p for p in relpath.split("/") if p not in ("", ".")):
            node = self.child(node, os.fsencode(part))
        if not node.is_dir or node.virtual:
            raise FsError(errno.ENOTDIR, f"{relpath} is not a directory")
        return node

    def steps(self, under: Node | None = None) -> Iterator[Node]:
        """Every step (below `under`, itself included), depth first: step directories and
        single-file steps."""
        return tree_walk.steps_under(under or self.root)

    # -- directories -----------------------------------------------------------------------

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        path = self._new_entry_path(parent, name)
        os.mkdir(path, mode & 0o7777)
        _chown(path, uid, gid)
        node = self.attach(parent, name, stat.S_IFDIR)
        number = self._identity.step_number_at(parent, name)
        if number is not None:
            node.step = StepState(number)
            self._watch.step_started(node)
            # quiet and still empty, it shows `empty` (fs.lifecycle.quiet_commits)
            self._watch.touch(node)
        self.mark_dirty(parent)
        return node

    def rmdir(self, parent: Node, name: bytes) -> None:
        node = self.existing_entry(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        path = self.backing(node)
        self._removals.directory_removed(node, path)
        os.rmdir(path)
        self.detach(node)
        self.mark_dirty(parent)

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
            return self._latest.readlink(node, pid)
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
            node.step = self._identity.single_file_step(parent, name)
            self.mark_dirty(node)
        return node

    def check_special_destination(self, node: Node, new_parent: Node) -> None:
        """A FIFO or socket may not be renamed into a step directory either."""
        if node.kind in (stat.S_IFIFO, stat.S_IFSOCK):
            self._check_special_parent(new_parent)

    def _check_special_parent(self, parent: Node) -> None:
        if any(node.step is not None for node in tree_walk.enclosing_steps(parent)):
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
        node.step = self._identity.single_file_step(parent, name)
        backing_ino = self.store.account_fd(fd)
        handle = self._new_handle(node, fd, writable=True, pid=pid, backing_ino=backing_ino)
        self.activate(handle)
        return node, handle

    @staticmethod
    def check_openable(node: Node) -> None:
        if node.virtual:
            raise FsError(errno.EROFS)
        if not node.is_file:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)

    def open_remote(self, node: Node) -> Handle:
        """A read-only handle of a file whose bytes come on demand (`FetchBack.read_remote`)."""
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

    def fallocate(self, handle: Handle, mode: int, offset: int, length: int) -> None:
        """fallocate(2) through an active handle."""
        fallocate(handle.fd, mode, offset, length)
        self.store.account_fd(handle.fd)

    def account_direct_writes(self) -> None:
        """Bring the RAM tier's accounting up to date with passthrough writes in progress."""
        for handle in self._handles.values():
            if handle.passthrough and handle.writable and handle.fd >= 0:
                self.store.account_fd(handle.fd)

    def end_writer(self, handle: Handle, *, final: bool) -> bool:
        """End of a close() (FLUSH), or of the open file (`final`, its RELEASE): seal what this
        handle wrote. Whether a writer ended (then its step may commit: `fs.lifecycle.commits`)."""
        # The kernel writes passthrough files without us, and flushes at the close of every
        # duplicate descriptor (shell `>`, dd, forked children): writes through the other
        # duplicates may follow a flush. A seal that no longer describes the file is redone,
        # and so is any seal taken before the last of several closes. A seal still being
        # computed checks the file's inode, size and mtime around its hash itself.
        if handle.passthrough and handle.writable and not handle.active and (
                (final and handle.flushes > 1) or not (self._sealing.describes_file(handle.node)
                                                       or self._sealing.pending(handle.node))):
            self.activate(handle)
        if not final:
            handle.flushes += 1
        if not handle.active:
            return False
        st = os.fstat(handle.fd) if handle.fd >= 0 else None
        if handle.passthrough and st is not None:
            self.store.account(st.st_ino, allocated(st))  # as `account_fd`, one fstat
        node = handle.node
        handle.active = False
        node.active_writers -= 1
        self._writers -= 1
        if node.active_writers == 0:  # a big file's hash is off the writer's path
            size = st.st_size if st is not None else None
            self._sealing.start(node, size=size, at_commit=(
                size is not None and size >= HASH_AT_COMMIT
                and tree_walk.in_a_step(node.parent)),
                opened=(handle.fd, st) if st is not None else None)
        self._released.set()
        self._released = trio.Event()
        return True

    def close(self, handle: Handle) -> None:
        """The open file is gone (RELEASE, after `end_writer`)."""
        del self._handles[handle.fh]
        if handle.active:  # its end_writer failed: it is not written any more all the same
            self._writers -= 1
        self._latest.closed(handle)
        node = handle.node
        node.handles.remove(handle)
        if handle.fd >= 0:
            orphaned = os.fstat(handle.fd).st_nlink == 0
            os.close(handle.fd)
            if orphaned and not any(h.backing_ino == handle.backing_ino
                                    for h in node.handles):
                self.store.forget_inode(handle.backing_ino)  # unlinked while open
        if handle.writable and node.seal is not None and not node.open_for_writing:
            self.file_settled(node)
        self._maybe_drop(node)

    def file_settled(self, node: Node) -> None:
        """`node` is sealed and no handle can write it any more: in a step, its seal takes the
        manifest entry it has now (the commit of 10,000 files stats and makes none), and a
        small file of a step directory becomes its committed object now
        (`RamStore.link_early`: its commit links nothing; a big file's commit hashes it
        anyway)."""
        seal = node.seal
        if seal is None or node.remote is not None:
            return
        try:
            path = self.backing(node)
            st = os.lstat(path)
        except (FsError, FileNotFoundError):
            return
        if not seal.describes(st):  # written since: its next seal settles it
            return
        name = tree_walk.path_in_step(node)
        node.seal = seal.restamped(st, name)
        if name is not None and node.step is None and seal.digest.size < HASH_AT_COMMIT:
            self.store.link_early(seal.digest.xxh3, path, st.st_ino)

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
            self._latest.keep_own(parent)
            return False
        node = self.existing_entry(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if node.kind == stat.S_IFLNK:
            self.links.note(self.relpath(parent))
        self._removals.single_file_removed(node)
        if node.remote is None:
            self.unlink_backing(self.backing(node), node)
        self._residents.drop_fetch(node)
        self.detach(node)
        self.mark_dirty(parent)
        return True

    # -- seals -----------------------------------------------------------------------------

    async def seal(self, node: Node) -> None:
        """Seal the node now, or join the hash of it already running (`fs.tree.sealing`)."""
        await self._sealing.seal(node)

    def writing(self) -> bool:
        """Whether a save is in progress: a file is being written and one began to be within
        SAVE_WINDOW (background work steps aside). A file held open for writing on its own (a
        log) stops counting after that, so hashes and uploads do not stay slow beside it. Read
        from hash threads: two plain reads, no lock needed for a hint."""
        return self._writers > 0 and time.monotonic() - self._writer_started < SAVE_WINDOW

    def activate(self, handle: Handle) -> None:
        """First write since open or flush: the file is no longer sealed; its step is dirty."""
        handle.active = True
        node = handle.node
        node.active_writers += 1
        self._writers += 1
        self._writer_started = time.monotonic()
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

    def attrs_changed(self, node: Node) -> None:
        """`node` now stands for other content (a newer version's file): its size, mode,
        owner or times may differ from what the kernel was told."""
        self._kernel_cache.attrs_changed(node)

    # -- helpers ---------------------------------------------------------------------------

    def _new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def attach_virtual(self, parent: Node, name: bytes) -> Node:
        """A symbolic link node not in the RAM store and not among `parent`'s children."""
        node = Node(self._new_ino(), stat.S_IFLNK, name, parent)
        node.virtual = True
        self._inodes[node.ino] = node
        return node

    def attach(self, parent: Node, name: bytes, kind: int) -> Node:
        node = Node(self._new_ino(), kind, name, parent)
        self.shape += 1
        parent.children[name] = node
        self._inodes[node.ino] = node
        self._kernel_cache.entry_added(parent)
        return node

    def detach(self, node: Node) -> None:
        if node.parent is not None and node.parent.children.get(node.name) is node:
            self.shape += 1
            del node.parent.children[node.name]
            self._kernel_cache.entry_gone(node.parent, node.name, node)
        node.parent = None
        if node.is_dir:  # directories held open for long paths, in what leaves the tree
            for gone in (node, *tree_walk.dirs_under(node)):
                if gone.anchor_fd >= 0:
                    os.close(gone.anchor_fd)
                    gone.anchor_fd = -1
        self._maybe_drop(node)

    def _maybe_drop(self, node: Node) -> None:
        if node.lookups or node.handles:
            return
        if node.virtual:
            self._latest.dropped(node)
            del self._inodes[node.ino]
        elif node.parent is None and node.ino in self._inodes:
            del self._inodes[node.ino]

    def _new_handle(self, node: Node, fd: int, writable: bool, pid: int = 0,
                    backing_ino: int | None = None) -> Handle:
        handle = Handle(self._next_fh, node, fd, writable, pid, backing_ino)
        self._next_fh += 1
        self._handles[handle.fh] = handle
        node.handles.append(handle)
        return handle

    def mark_dirty(self, node: Node | None, *, settled: bool = False) -> None:
        """`node` changed: its steps are written again (`settled`: `QuietWatch.touch`)."""
        for step_node in tree_walk.enclosing_steps(node):
            step_node.step.dirty = True
            step_node.step.empty = False
            # a new version begins (fs.model.pending_commits)
            if step_node.step.pending is not None:
                step_node.step.pending.superseded = True
            self._watch.touch(step_node, settled=settled)

    def check_new_name(self, name: bytes) -> None:
        """A name an entry may be made or renamed to (tierfs's own names are refused)."""
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
        self.check_new_name(name)
        if name in parent.children:
            raise FsError(errno.EEXIST)
        if name == LATEST:
            self._latest.keep_own(parent)  # marked before the entry is made
        return os.path.join(self.backing(parent), name)

    def existing_entry(self, parent: Node, name: bytes) -> Node:
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        node = parent.children.get(name)
        if node is None:
            if name == LATEST and self._latest.shows(parent):
                raise FsError(errno.EROFS)
            raise FsError(errno.ENOENT)
        return node

    def unlink_backing(self, path: bytes, node: Node) -> None:
        st = self.forget_backing_if_last(path, node)
        self.store.remove(path, st, in_background=not self._is_open(node, st))

    def forget_backing_if_last(self, path: bytes, node: Node) -> os.stat_result:
        """Space comes back when the last link goes, or at the last close if files are open."""
        st = os.lstat(path)
        if self.store.drop_early(st.st_ino):  # its object, linked early, goes with it
            st = os.lstat(path)
        if st.st_nlink == 1 and not self._is_open(node, st):
            self.store.forget_inode(st.st_ino)
        return st

    @staticmethod
    def _is_open(node: Node, st: os.stat_result) -> bool:
        return any(h.backing_ino == st.st_ino for h in node.handles)


def _chown(path: bytes, uid: int, gid: int) -> None:
    if (uid, gid) != (os.geteuid(), os.getegid()):
        os.chown(path, uid, gid, follow_symlinks=False)

