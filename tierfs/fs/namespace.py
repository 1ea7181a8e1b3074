"""The namespace of one mount: the `Tree` and its collaborators, put together in dependency
order, behind the one object `fs.fuse.operations` talks to.

Who owns what (doc/ARCHITECTURE.md):

* `Tree` (fs.tree.tree): nodes, handles, step state, the RAM store's references; the invariants.
* `Recovery` (fs.lifecycle.recovery): the RAM store put back in order at start, before the Tree is
  built.
* `FetchBack` (fs.lifecycle.fetch_back): bytes coming back from other tiers.
* `Eviction` (fs.lifecycle.eviction): steps leaving RAM once safe elsewhere.
* `OtherTiers` (fs.lifecycle.other_tiers): copies in the persistent tier and on peers; deletes.
* `ClusterWrites` (fs.lifecycle.cluster_writes): what this node's saves and commits record in the
  cluster, and the shards of a multi-node DCP step other nodes hold.
* `Commits` (fs.lifecycle.commits): when a step commits, and the commit.
* `QuietWatch` (fs.lifecycle.quiet_watch), `QuietCommits` (fs.lifecycle.quiet_commits): steps
  that commit once their saver is done; `AppendSnapshots` (fs.lifecycle.appends): loose
  files committed while they are still appended.
* `Verifier` (fs.lifecycle.verify): RAM objects checked before use; `tierfs verify`.

Everything outside `fs` comes in through the Protocols of `fs.model.ports`, given to `assemble`.

`Namespace` is the one way in for the FUSE face and the daemon: they call its methods, or
use its three faces (`view`, the tree read-only; `copies`, the other tiers' `StepCopies` port;
`verifier`), and never reach its collaborators (tests/test_structure.py checks it).

`Namespace` itself holds no state: each method is one file system call, spelled as the calls to
the collaborators it takes, so that a write, a commit and a read-back can be followed here.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from tierfs.fs.lifecycle.appends import AppendSnapshots
from tierfs.fs.lifecycle.background import Background
from tierfs.fs.lifecycle.cluster_writes import ClusterWrites
from tierfs.fs.lifecycle.commits import SAVER_WAIT, Commits
from tierfs.fs.lifecycle.deletes import DELETES_DIR, Cleaner, Deletes, DeleteWorker
from tierfs.fs.lifecycle.eviction import Eviction
from tierfs.fs.lifecycle.fetch_back import FetchBack
from tierfs.fs.lifecycle.foreground import Foreground
from tierfs.fs.lifecycle.kept_links import KeptLinks
from tierfs.fs.lifecycle.other_tiers import OtherTiers
from tierfs.fs.lifecycle.quiet_commits import QuietCommits
from tierfs.fs.lifecycle.quiet_watch import QuietWatch
from tierfs.fs.lifecycle.recovery import Recovery
from tierfs.fs.lifecycle.rename_commits import RenameCommits
from tierfs.fs.lifecycle.step_versions import StepVersions
from tierfs.fs.lifecycle.verify import Verifier
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import (
    DEFAULT_FILE_STEP_PATTERN,
    DEFAULT_STEP_PATTERN,
    FsError,
    Handle,
    Node,
    RemoteAttrs,
)
from tierfs.fs.store.ram_store import RamFull, RamStore
from tierfs.fs.tree import user_xattrs
from tierfs.fs.tree.tree import Tree
from tierfs.fs.tree.tree_view import TreeView

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tierfs import manifest as mf
    from tierfs.fs.lifecycle.quiet_commits import Outlook
    from tierfs.fs.model.latest_pins import Pin
    from tierfs.fs.model.links import LinkChanges
    from tierfs.fs.model.ports import (
        CommitSink,
        CopiesWait,
        EventSink,
        Liveness,
        PeerCopies,
        PersistCopies,
        ReadGate,
        ReadSource,
        SealedCollector,
        ShardsOnPeers,
        StepCopies,
        StoreCheck,
    )

DIRECT_WRITES_EVERY = 0.5  # seconds between updates of the RAM tier's usage by passthrough


class Core:
    """The tree of a RAM store, loaded, with what it reports to (made first: the cluster's
    clients ask it questions before the rest of the namespace exists)."""

    def __init__(self, store: RamStore, *, node_id: str = "local",
                 step_pattern: str = DEFAULT_STEP_PATTERN,
                 file_step_pattern: str = DEFAULT_FILE_STEP_PATTERN, commit_idle: float = 5.0,
                 delete_targets: list[str] | None = None,
                 background: Background | None = None,
                 liveness: Liveness | None = None) -> None:
        self.background = background or Background()  # the owner of background work
        self.liveness = liveness  # who is up in the cluster (None: a single node)
        self.watch = QuietWatch(commit_idle)
        self.deletes = Deletes(Path(store.root) / DELETES_DIR, delete_targets)
        self.tree = tree = Tree(store, self.watch, self.deletes, node_id=node_id,
                                step_pattern=step_pattern, file_step_pattern=file_step_pattern,
                                spawner=self.background, liveness=liveness)
        parts = tree.parts  # handed to the collaborators below, each the ones it uses
        # what peers, status and xattrs read of it
        self.view = TreeView(tree, holdings=parts.holdings, identity=parts.identity,
                             latest=parts.latest, recoverable=parts.recoverable,
                             residents=parts.residents, sealing=parts.sealing)
        # the tree's changes the other tiers drive
        self.versions = StepVersions(tree, dir_attributes=parts.dir_attributes,
                                     identity=parts.identity, latest=parts.latest,
                                     records=parts.records, residents=parts.residents,
                                     removals=parts.removals, sealing=parts.sealing,
                                     store=tree.store)
        self.recovered = Recovery(self.tree, self.deletes, identity=parts.identity,
                                  residents=parts.residents,
                                  records=parts.records).load()

    def learn_holders(self, step_node: Node, holders: dict[str, set[str]]) -> None:
        """Who holds these files of a committed step, as the cluster's records say (the peer
        clients learn it when the holders known here failed them)."""
        self.versions.set_file_holders(step_node, holders)

    def old_keys(self, key: str) -> list[str]:
        """The store keys a renamed step's object `key` may still be found under (its names
        before renames that have not reached the store: `Deletes.old_keys`)."""
        return self.deletes.old_keys(key)


class Namespace:
    """One mount's file system calls, each through the collaborator that owns its part."""

    def __init__(self, core: Core, sink: CommitSink, *,
                 read_sources: list[ReadSource] | None = None,
                 sealed: SealedCollector | None = None, persist: PersistCopies | None = None,
                 peers: PeerCopies | None = None, keep_ram: int = 3,
                 replicas: int = 0, events: EventSink,
                 commit_timeout: float = SAVER_WAIT, append_every: float = 0.0,
                 copies_wait: CopiesWait | None = None,
                 store_check: StoreCheck | None = None,
                 shards: ShardsOnPeers | None = None) -> None:
        self.tree = tree = core.tree
        parts = tree.parts  # handed to the collaborators below, each the ones it uses
        # the Tree's parts that the file system calls below use directly
        self._kernel_cache = parts.kernel_cache  # what the kernel already knows of a change
        self._dir_attributes = parts.dir_attributes  # directories tierfs made for other tiers
        self._renames = parts.renames
        self._cut_short = parts.cut_short  # files a write into failed (no room)
        self._attributes = parts.attributes  # chmod, chown, utime, truncate
        self._latest = parts.latest  # `latest`: which step a load through it reads
        self._copy_on_write = parts.copy_on_write  # committed objects are never written
        self._sealing = parts.sealing  # hash threads
        self.view = core.view
        self.versions = core.versions
        # links the store or another node keeps, made here
        self._kept_links = KeptLinks(tree, dir_attributes=parts.dir_attributes,
                                     identity=parts.identity, latest=parts.latest)
        self.events = events
        self.store = tree.store
        self.deletes = core.deletes
        self.background = core.background
        self.recovered = core.recovered  # what start-up found (lost copies?)
        sources = list(read_sources or [])
        self.fetch_back = FetchBack(tree, sources, self.background, records=sealed,
                                    recoverable=parts.recoverable, residents=parts.residents)
        self.eviction = Eviction(tree, core.versions, self.background,
                                 other_tiers=bool(sources), keep_ram=keep_ram,
                                 replicas=replicas, liveness=core.liveness, records=sealed,
                                 store_check=store_check, holdings=parts.holdings,
                                 recoverable=parts.recoverable, residents=parts.residents)
        self.cluster_writes = ClusterWrites(tree, core.versions, self.background, sealed, shards,
                                            manifests=parts.manifests, residents=parts.residents)
        if sealed is not None:
            core.watch.save_begun = self.cluster_writes.note_saving
        # what the other tiers' parts use of it is the StepCopies port (fs.model.ports)
        self.tiers = OtherTiers(tree, core.view, core.versions, self.eviction, self.deletes,
                                self.background, self.cluster_writes, sealed,
                                holdings=parts.holdings, identity=parts.identity,
                                recoverable=parts.recoverable, residents=parts.residents,
                                store=tree.store)
        self.commits = Commits(tree, self.eviction, self.fetch_back, self.cluster_writes,
                               self.tiers, sink, self.events, saver_wait=commit_timeout,
                               copies_wait=copies_wait, identity=parts.identity,
                               manifests=parts.manifests,
                               sealing=parts.sealing, cut_short=parts.cut_short,
                               store=tree.store)
        self.rename_commits = RenameCommits(tree, self.commits, self.fetch_back,
                                            identity=parts.identity, renames=parts.renames)
        self.quiet = QuietCommits(tree, core.watch, self.commits, cut_short=parts.cut_short,
                                  residents=parts.residents, manifests=parts.manifests)
        self.appends = AppendSnapshots(tree, core.watch, self.commits, self.eviction,
                                       append_every, records=parts.records,
                                       residents=parts.residents, store=tree.store)
        self.verifier = Verifier(tree, self.eviction, self.fetch_back, persist, peers,
                                 finish_pending=self.commits.finish_pending,
                                 store=tree.store, holdings=parts.holdings,
                                 residents=parts.residents)
        self.gate: ReadGate = self.verifier
        # when the mount's users last asked something (background work waits for a pause)
        self.foreground = Foreground(writing=tree.writing)

    # -- the FUSE session's start and end ----------------------------------------------------

    def session_started(self) -> None:
        """The kernel's session exists (after pyfuse3.init): invalidations may be sent."""
        self._kernel_cache.start()

    def session_ending(self) -> None:
        """Before the session goes: no more invalidations."""
        self._kernel_cache.stop()

    async def hold_hash_threads(self) -> None:
        """Take every hash thread (`Sealing.hold`): hashes observably late, for tests."""
        await self._sealing.hold()

    def release_hash_threads(self) -> None:
        """Give back the hash threads a test held (`Sealing.release`): the last commits, and
        the stop itself, wait for the hashes under way."""
        self._sealing.release()

    # -- lookups: the Tree's ---------------------------------------------------------------

    @property
    def root(self) -> Node:
        return self.tree.root

    @property
    def inode_count(self) -> int:
        return self.tree.inode_count

    def get(self, ino: int) -> Node:
        return self.tree.get(ino)

    def handle(self, fh: int) -> Handle:
        return self.tree.handle(fh)

    def child(self, parent: Node, name: bytes) -> Node:
        return self.tree.child(parent, name)

    def list_dir(self, node: Node) -> list[tuple[bytes, Node]]:
        return self.tree.list_dir(node)

    def remember(self, node: Node) -> None:
        self.tree.remember(node)

    def forget(self, ino: int, count: int) -> None:
        self.tree.forget(ino, count)

    def stat(self, node: Node) -> os.stat_result | RemoteAttrs:
        return self.tree.stat(node)

    def readlink(self, node: Node, pid: int | None = None) -> bytes:
        return self.tree.readlink(node, pid)

    # -- directories and entries -----------------------------------------------------------

    # The calls below are the kernel's requests, the job's changes (`_job_changes`).

    @contextlib.contextmanager
    def _job_changes(self, *directories: Node) -> Iterator[None]:
        """A change the kernel asked for in `directories`: it knows of it
        (`KernelCache.kernel_knows`) and keeps its own view of the entries up to date itself;
        and once made, the directories' attributes are the job's (`DirAttributes.changed_here`),
        not a commit's tierfs gave them before."""
        with self._kernel_cache.kernel_knows():
            yield
        for directory in directories:
            self._dir_attributes.changed_here(directory)

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        with self._job_changes(parent):
            return self.tree.mkdir(parent, name, mode, uid, gid)

    async def dir_made(self, node: Node) -> None:
        """After `mkdir`: a step directory made on a node of a cluster is answered once etcd
        knows this node writes its save (`ClusterWrites.saving_recorded`, bounded), so that
        a commit of the step that another node begins after this mkdir takes its files."""
        if node.is_dir and node.step is not None:
            await self.cluster_writes.saving_recorded(node)

    def mknod(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        with self._job_changes(parent):
            return self.tree.mknod(parent, name, mode, uid, gid)

    def symlink(self, parent: Node, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        with self._job_changes(parent):
            return self.tree.symlink(parent, name, target, uid, gid)

    def rmdir(self, parent: Node, name: bytes) -> None:
        with self._job_changes(parent):
            self.tree.rmdir(parent, name)

    async def unlink(self, parent: Node, name: bytes) -> None:
        with self._job_changes(parent):
            removed = self.tree.unlink(parent, name)
        if removed:
            await self.commits.run_pending_commits(parent)

    def check_special_destination(self, node: Node, new_parent: Node) -> None:
        self.tree.check_special_destination(node, new_parent)

    async def rename(self, old_parent: Node, old_name: bytes, new_parent: Node,
                     new_name: bytes, flags: int) -> None:
        while True:
            node = self._renames.check_rename(old_parent, old_name, new_name, flags)
            # Files only peers hold come here first (the store renames its own): under the new
            # name they are this node's to commit and serve, and the peers' copies go with the
            # old name. A step renamed here while other nodes held some of its files could not
            # commit at its new name (their holders were known by the old one): it stayed
            # `writing` here and the peers kept the old name.
            elsewhere = [file_node for file_node in tree_walk.walk_files(node)
                         if file_node.remote is not None and not file_node.remote.in_store]
            if not elsewhere:
                break
            for file_node in elsewhere:  # then check again: the awaits may have seen changes
                await self.fetch_back.make_resident(file_node, empty=False)
        with self._job_changes(old_parent, new_parent):
            moved = self._renames.rename(node, old_parent, old_name, new_parent, new_name,
                                         flags)
        if moved:
            await self.rename_commits.after_rename(node, old_parent)

    # -- files: a write ----------------------------------------------------------------------

    def create(self, parent: Node, name: bytes, mode: int, flags: int, uid: int,
               gid: int, pid: int = 0) -> tuple[Node, Handle]:
        with self._job_changes(parent):
            node, handle = self.tree.create(parent, name, mode, flags, uid, gid, pid)
        node.written_whole = True  # (`open` and `setattr` say so of a file emptied)
        return node, handle

    async def open(self, node: Node, flags: int) -> Handle:
        self.tree.check_openable(node)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        truncate = writable and bool(flags & os.O_TRUNC)
        if not writable and node.remote is None:
            await self.gate.before_read_open(node)  # may quarantine it: then it is remote
        if node.remote is not None:
            if not writable:
                return self.tree.open_remote(node)  # bytes come on demand: read()
            await self.fetch_back.make_resident(node, empty=truncate)
        if writable:
            await self.make_private(node, keep=not truncate)
        # The path is taken only now: the awaits above may have seen renames.
        handle = self.tree.open_backing(node, writable=writable, truncate=truncate)
        if truncate:
            self._cut_short.clear(node)  # written again from the start
        if writable:
            node.written_whole = truncate
        return handle

    def drop_setid(self, node: Node) -> None:
        """A writer that may not keep set-id bits opened `node` (`Attributes.drop_setid`)."""
        if self.tree.has_backing(node):
            self._attributes.drop_setid(node)

    def check_open(self, node: Node, pid: int) -> None:
        """`ESTALE` when this open starts a new load through an older `latest`
        (`VirtualLatest.check_open`): the kernel walks the path again."""
        self._latest.check_open(node, pid)

    def opening(self, node: Node, pid: int) -> Pin | None:
        """Process `pid` asks to open `node`: its `latest` pin, held while it waits
        (`VirtualLatest.opening`)."""
        return self._latest.opening(node, pid)

    def note_opened(self, handle: Handle, pid: int, pin: Pin | None) -> None:
        """Process `pid` opened `handle`; `pin` (from `opening`) lasts while it is open."""
        handle.pid, handle.pin = pid, pin

    def open_failed(self, pin: Pin | None) -> None:
        """The open that `opening` gave `pin` for failed: its load failed."""
        self._latest.load_failed(pin, opening=True)

    async def write(self, handle: Handle, offset: int, data: bytes) -> int:
        if not handle.active:
            self.tree.activate(handle)
        try:
            if self.tree.needs_room(handle, offset, len(data)):
                await self.eviction.make_room(len(data), sparing=handle.node)
            return self.tree.write(handle, offset, data)
        except RamFull:
            self._cut_short.note(handle.node, "the RAM tier is full")
            raise
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self._cut_short.note(handle.node, "the RAM dir's file system is full")
            raise

    async def expect_direct_writes(self, handle: Handle) -> None:
        """The kernel will write this handle's backing file without asking us (passthrough):
        count it as writing from now on. A full RAM tier is refused here, at open, because
        such writes cannot be refused one by one."""
        if not handle.writable:
            return
        await self.eviction.make_room(1, sparing=handle.node)
        if not handle.active:
            self.tree.activate(handle)

    def creates_now(self) -> bool:
        """Whether a file created now (`create`, then `expect_direct_writes`) waits for
        nothing: the RAM tier has room for its first byte. Else `make_room` may evict a step,
        wait for copies on their way elsewhere, or refuse the open with ENOSPC. Nothing else
        of a create waits: its writer's end, which may commit (a `.metadata`), comes at its
        FLUSH and RELEASE."""
        return self.store.room_for(1)

    def expect_direct_writes_now(self, handle: Handle) -> None:
        """`expect_direct_writes` of a handle created where `creates_now` found room."""
        if handle.writable and not handle.active:
            self.tree.activate(handle)

    def account_direct_writes(self) -> None:
        """Bring the RAM tier's accounting up to date with passthrough writes in progress."""
        self.tree.account_direct_writes()
        self.eviction.relieve_pressure()

    async def keep_accounting_direct_writes(self) -> None:
        """Passthrough writes bypass the daemon: the RAM tier's usage figures are brought up
        to date every DIRECT_WRITES_EVERY seconds."""
        while True:
            await trio.sleep(DIRECT_WRITES_EVERY)
            self.account_direct_writes()

    async def flush(self, handle: Handle, *, final: bool = False) -> None:
        """End of a close() (FLUSH), or of the open file (`final`, its RELEASE): seal what this
        handle wrote (Tree), then fire any commit it completes (Commits)."""
        if self._end_writer(handle, final):
            await self.commits.after_writer(handle.node)

    def flush_now(self, handle: Handle) -> bool:
        """`flush` of a close() with no await, where it needs none: the close of a file whose
        writer's end commits nothing (not a step's `.metadata`, no commit pending: most files
        of a step saved). False, having done nothing, for the others: `flush` does them."""
        if self.commits.commits_after_writer(handle.node):
            return False
        if self._end_writer(handle, False):
            self.commits.writer_done(handle.node)
        return True

    def releases_now(self, handle: Handle) -> bool:
        """Whether `release_now` may release `handle`: as `flush_now`, and the file is not a
        step of its own that its release commits."""
        node = handle.node
        return not (self.commits.commits_after_writer(node) or (
            handle.writable and self.commits.commits_after_release(node)))

    def release_now(self, handle: Handle) -> None:
        """`release` with no await, of a handle `releases_now` allows."""
        try:
            if self._end_writer(handle, True):
                self.commits.writer_done(handle.node)
        finally:
            self.tree.close(handle)

    def _end_writer(self, handle: Handle, final: bool) -> bool:
        ended = self.tree.end_writer(handle, final=final)
        if ended and handle.passthrough:  # its writes' errors went to the writer, not to us
            self._cut_short.note_if_full(handle.node, str(self.store.root))
        return ended

    async def release(self, handle: Handle) -> None:
        try:
            await self.flush(handle, final=True)
        finally:
            self.tree.close(handle)
        if handle.writable:
            await self.commits.after_release(handle.node)

    def fsync(self, handle: Handle) -> None:
        self.tree.fsync(handle)

    def fallocate(self, handle: Handle, mode: int, offset: int, length: int) -> None:
        """fallocate(2) through an open file (`fallocate -l`, `rsync --preallocate`, a saver
        that sizes its file first): done on the file's RAM copy, with its mode, as the
        kernel's writes through passthrough are, and the RAM tier's limit kept as for theirs
        (at the open, then by eviction)."""
        if not handle.writable or handle.fd < 0:
            raise FsError(errno.EBADF)
        if not handle.active:
            self.tree.activate(handle)
        self.tree.fallocate(handle, mode, offset, length)

    async def setattr(
        self, node: Node, handle: Handle | None, *, mode: int | None = None,
        uid: int | None = None, gid: int | None = None, size: int | None = None,
        atime_ns: int | None = None, mtime_ns: int | None = None,
    ) -> None:
        if node.virtual:
            raise FsError(errno.EROFS)
        if node.remote is not None:
            await self.fetch_back.make_resident(node, empty=size == 0)
        if size is not None and self.tree.has_backing(node):
            self._attributes.check_truncatable(node)
            await self.make_private(node, keep=size > 0)
            if size == 0:
                self._cut_short.clear(node)  # to be written again from the start
                node.written_whole = True
        elif self._changes_shared_file(node, mode, uid, gid, mtime_ns):
            await self.make_private(node, keep=True)  # the others keep their attributes
        self._attributes.setattr(node, handle, mode=mode, uid=uid, gid=gid, size=size,
                                 atime_ns=atime_ns, mtime_ns=mtime_ns)
        self._attributes_recorded(node, mode, uid, gid, mtime_ns)

    def setattr_now(self, node: Node, handle: Handle | None, *, mode: int | None,
                    uid: int | None, gid: int | None, atime_ns: int | None,
                    mtime_ns: int | None) -> bool:
        """`setattr` of anything but the size, with no await, where it needs none: False,
        having done nothing, for a file whose bytes are elsewhere (`setattr` brings it back
        first) or whose inode other files share (`setattr` copies it first). `tar x`,
        `cp -a` and `rsync -a` set a mode, an owner and times on every file."""
        if node.virtual:
            raise FsError(errno.EROFS)
        if node.remote is not None or self._changes_shared_file(node, mode, uid, gid,
                                                                mtime_ns):
            return False
        self._attributes.setattr(node, handle, mode=mode, uid=uid, gid=gid,
                                 atime_ns=atime_ns, mtime_ns=mtime_ns)
        self._attributes_recorded(node, mode, uid, gid, mtime_ns)
        return True

    def _changes_shared_file(self, node: Node, *changed: int | None) -> bool:
        """Whether a new mode, owner or mtime would change other files too: this file's inode
        is theirs as well (`CopyOnWrite.shared_with_files`)."""
        return changed != (None,) * len(changed) and node.is_file and \
            self._copy_on_write.shared_with_files(node)

    def _attributes_recorded(self, node: Node, *changed: int | None) -> None:
        """A file's new mode, owner or mtime reach its record in the cluster's records; a
        directory's are the job's from now on (`DirAttributes.changed_here`)."""
        if changed == (None,) * len(changed):
            return
        if node.is_file:
            self.cluster_writes.note_attributes(node)
        elif node.is_dir:
            self._dir_attributes.changed_here(node)

    async def make_private(self, node: Node, *, keep: bool) -> None:
        """Copy on write: a tree file shared with a committed object gets its own inode (its
        bytes kept, or empty) before anything may change it. The copy is made in a thread,
        after room is made for it (`Eviction`); `CopyOnWrite` swaps it in."""
        async with self._copy_on_write.lock(node):
            while True:
                shared = self._copy_on_write.shared_backing(node)
                if shared is None:
                    return
                path, st = shared
                size = st.st_size if keep else 0
                await self.eviction.make_room(size, sparing=node)
                copy = await trio.to_thread.run_sync(self.store.copy, path,
                                                     os.path.dirname(path), size)
                if self._copy_on_write.replace_shared(node, path, st, copy):
                    return

    # -- files: a read-back --------------------------------------------------------------------

    async def read(self, handle: Handle, offset: int, size: int) -> bytes:
        if handle.fd < 0 and handle.node.remote is not None:
            try:
                return await self.fetch_back.read_remote(handle.node, offset, size)
            except (FsError, OSError):
                self._latest.load_failed(handle.pin)
                raise
        return self.tree.read(handle, offset, size)

    # -- xattrs ------------------------------------------------------------------------------

    def xattr_names(self, node: Node) -> list[bytes]:
        return self.view.xattr_names(node)

    async def xattr(self, node: Node, name: bytes) -> bytes:
        return await self.view.xattr(node, name)

    def user_xattr_names(self, node: Node) -> list[bytes]:
        return user_xattrs.names(self.tree, node)

    def user_xattr(self, node: Node, name: bytes) -> bytes:
        return user_xattrs.get(self.tree, node, name)

    async def set_user_xattr(self, node: Node, name: bytes, value: bytes) -> None:
        if node.remote is not None:
            await self.fetch_back.make_resident(node, empty=False)  # as chmod does
        user_xattrs.set_value(self.tree, node, name, value)

    def remove_user_xattr(self, node: Node, name: bytes) -> None:
        user_xattrs.remove(self.tree, node, name)

    # -- what the daemon asks and tells the namespace ----------------------------------------
    # (besides `view`, the tree read-only, and `verifier`, `tierfs verify`'s checks)

    @property
    def copies(self) -> StepCopies:
        """The other tiers' port into the namespace: what they tell of a step's copies and
        ask of it (the uploader's steps, replication, catch-up, status)."""
        return self.tiers

    def may_catch_up(self, parent: Node, name: bytes) -> bool:
        """Whether `catch_up` would ask the cluster about `name` (else a LOOKUP of it that
        finds nothing fails at once)."""
        return self.tiers.may_catch_up(parent, name)

    async def catch_up(self, parent: Node, name: bytes) -> bool:
        """`name` is not in `parent`: whether it is now, a step another node committed a
        moment ago and this node had not heard of (`OtherTiers.catch_up`)."""
        return await self.tiers.catch_up(parent, name)

    async def fetch_whole(self, node: Node) -> None:
        """A read-only open of a file in another tier that passthrough will answer: a small
        one, or one of a step being loaded, comes whole into RAM first (`FetchBack`)."""
        await self.fetch_back.fetch_whole(node)

    def ram_bytes(self) -> tuple[int, int]:
        """The RAM tier's bytes used and its limit."""
        return self.store.used_bytes, self.store.limit_bytes

    def object_path(self, xxh3: str) -> str:
        """Where the RAM store keeps the object of hash `xxh3` (what an upload reads)."""
        return str(self.store.object_path(xxh3))

    def fetched_ahead(self) -> dict[str, int]:
        """Committed files brought back into RAM before their open asked for them."""
        return {"files": self.fetch_back.ahead_files, "bytes": self.fetch_back.ahead_bytes,
                "small_files": self.fetch_back.small_fetched}

    async def settle(self) -> None:
        """Commit now the steps whose savers are done (unmount, `tierfs umount`)."""
        await self.quiet.commit_quiet_steps()

    async def commit(self, relpath: str, timeout: float) -> mf.StepManifest:
        """`tierfs commit`: the step at `relpath` committed (`Commits.commit_path`)."""
        return await self.commits.commit_path(relpath, timeout)

    def commit_waits(self, relpath: str) -> str | None:
        """What a `tierfs commit` of `relpath` waits for now, if anything."""
        return self.commits.waiting_for(relpath)

    def commit_outlook(self, step_node: Node) -> Outlook:
        """When a step being written commits by itself (`QuietCommits.outlook`)."""
        return self.quiet.outlook(step_node)

    async def prefetch(self, relpath: str) -> int:
        """`tierfs prefetch`: the files under `relpath` brought into RAM; their bytes."""
        return await self.fetch_back.prefetch(relpath)

    def persisted(self, manifest: mf.StepManifest) -> None:
        """The uploader stored `manifest`'s step: marked so, and the deletes that waited for
        it (a rename's old name may leave the store now) go on."""
        self.tiers.mark_persisted(manifest)
        self.deletes.poke()

    def adopt_links(self, directory: str, links: dict[str, str]) -> int:
        """Make the symbolic links the persistent tier keeps for `directory` (a fresh RAM
        dir; an entry of that name here stays). The number made."""
        return self._kept_links.adopt(directory, links)

    def replace_links(self, directory: str, links: dict[str, str]) -> int:
        """Make `directory`'s kept links those another node of the cluster keeps
        (`KeptLinks.replace`). The number changed."""
        return self._kept_links.replace(directory, links)

    def store_lacks(self, step_node: Node, lacking: list[str], seen: str) -> None:
        """The persistent tier lacks these files of a step it held (`Eviction.store_lacks`)."""
        self.eviction.store_lacks(step_node, lacking, seen)

    def keep_ram(self) -> None:
        """Steps beyond --keep-ram that other tiers hold leave RAM (after an adoption)."""
        self.eviction.enforce_keep_ram()

    def lost_from_store(self) -> trio.MemoryReceiveChannel[mf.StepManifest]:
        """The steps the store was found to lack though they had reached it: to upload again."""
        return self.eviction.lost_from_store

    async def chunk_for_peer(self, xxh3: str, index: int) -> int | None:
        """An fd of this node's partial copy of `xxh3` once its chunk `index` is in, for a
        peer sent here for it (`FetchBack.chunk_for_peer`); None if not being fetched."""
        return await self.fetch_back.chunk_for_peer(xxh3, index)

    def deletes_status(self) -> dict[str, int]:
        """Deletes recorded, and those still owed to a tier, for `tierfs status`."""
        return self.deletes.status()

    def deletes_pending_in(self, target: str) -> list[str]:
        """The deleted (or renamed-away) steps `target` still holds, by path."""
        return sorted(t.path for t in self.deletes.pending() if target in t.pending)

    def delete_everywhere(self, targets: list[str]) -> None:
        """What a delete made from now on must clean (the store, etcd, the live peers)."""
        self.deletes.targets = targets

    def delete_worker(self, cleaners: dict[str, Cleaner],
                      wanted: Callable[[mf.StepManifest], bool] | None) -> DeleteWorker:
        """The worker that takes deleted steps out of the tiers (`cleaners`, by target)."""
        return DeleteWorker(self.deletes, cleaners,
                            lambda tomb: self.tiers.move_done(tomb, wanted))

    def link_changes(self) -> LinkChanges:
        """The directories whose symbolic links the persistent tier must learn."""
        return self.tree.links

    async def keep_committing(self) -> None:
        """The namespace's own background commits, until cancelled: retries of failed commits,
        quiet steps, and append snapshots if asked for."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.commits.keep_retrying)
            nursery.start_soon(self.quiet.run)
            if self.appends.append_every:
                nursery.start_soon(self.appends.run)
