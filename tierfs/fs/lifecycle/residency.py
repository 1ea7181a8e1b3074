"""Residency: committed files whose bytes live in another tier, brought back on demand
(verified) or on request (prefetch), and steps leaving RAM once they are safe elsewhere: under
--keep-ram, and under RAM pressure before any write is refused.

`Residency` decides what to fetch and what to evict, and when; the `Tree` makes each change
(`adopt_fetch`, `evict_file`, ...). In a cluster, a copy of a step not persisted leaves RAM
only after the cluster's file records stopped counting this node as its holder
(`SealedCollector.leave_files`, which refuses unless the record lists K + 1 other live
holders: no eviction leaves a file with fewer than K + 1 copies, and the records never say
there are more copies than there are of a file that exists nowhere else). A persisted step's
copies leave only once the store is seen to hold them at that moment (`StoreCheck`: a listing
of the step's objects, not the mark written when it was uploaded); a step the store was found
to lack is no longer counted as persisted, and goes up again (`lost_from_store`). Then they
leave at once, and the records are told in the background (best effort: the persistent tier
holds the file, so a holder counted too many is no loss). A copy found bad
(`copies_lost`) leaves the records in the background too, as a lost copy (the other holders
restore it). The tiers it reads from are `ReadSource`s (peers first, then the persistent
tier), and its background work runs under the `Spawner` it is given.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs.fs.lifecycle.step_loads import StepLoads
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import METADATA, FsError, Node, StepState, some_names
from tierfs.fs.model.ports import (
    Liveness,
    ReadSource,
    SealedCollector,
    Spawner,
    StoreCheck,
    StoreLoss,
    TierError,
)
from tierfs.fs.store.fetch import WHOLE_IN_FLIGHT, Fetch, FetchError, GivenBytes, Slots
from tierfs.fs.store.ram_store import RamFull

if TYPE_CHECKING:
    from tierfs.fs.tree.holders import Holdings
    from tierfs.fs.tree.recoverable import Recoverability
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.tree import Tree

log = logging.getLogger(__name__)

# Eviction works in slices of EVICT_SLICE seconds, each followed by a pause as long: the
# FUSE loop answers in between, and the threads that relay requests to it get the GIL. The
# first slice of a background eviction is longer, so that most steps leave RAM at once.
EVICT_SLICE = 0.002
FIRST_SLICE = 0.02
# After etcd did not take a copy's leave of the records, no other is tried for this long (the
# copies stay in RAM): a write waiting for room does not wait one etcd timeout per step.
LEAVE_PAUSE = 5.0
# After the store could not say what it holds, no copy leaves RAM on its word for this long:
# a write waiting for room does not wait for one failed listing per step.
STORE_PAUSE = 5.0
# A file this small is fetched whole before a read-only open returns (then read by
# passthrough): three chunks take ~25 ms from a peer on loopback. A larger one would keep its
# reader waiting for bytes it may never read (one tensor of a multi-GB shard).
WHOLE_AT_OPEN = 3 * mf.CHUNK_SIZE
# A small file fetched back brings the other small files of its step with it (`_fetch_small`):
# savers that write a file per tensor or per parameter group make steps of thousands of small
# files, read back one after another, and one request per file, each waited for at its open,
# made such a read-back ~400x slower than tmpfs. Only files up to SMALL_FILE bytes come, at
# most SMALL_STEP_BYTES per go, and none of a step written on several nodes: each rank of a
# multi-node DCP load reads only its own shards, and another rank's must not come to every
# node. SMALL_IN_FLIGHT requests are on their way at once (the store's worker threads, the
# peers' pooled connections).
SMALL_FILE = 1 << 20
SMALL_STEP_BYTES = 64 << 20
# How long a write that needs room waits for a committed step on its way to the store or the
# peers (hashed after its commit, then sent) to become safe there and leave RAM, before it is
# refused with ENOSPC; each step that gets there starts the wait anew.
ROOM_WAIT = 30.0
SMALL_IN_FLIGHT = 16
# A source that can (a peer, `fetch.FilesSource`) is asked for this many of them at once, in
# one request: one request per file made a peer's read-back of a step of 10,000 small files
# 3.5x slower than the store's out of its packs.
SMALL_AT_ONCE = 512
SMALL_AT_ONCE_BYTES = 4 << 20


class Residency:
    """Files whose bytes are in another tier: fetched back, prefetched, evicted."""

    def __init__(self, tree: Tree, versions: StoreLoss, read_sources: list[ReadSource],
                 background: Spawner, *,
                 keep_ram: int = 3, replicas: int = 0,
                 liveness: Liveness | None = None,
                 records: SealedCollector | None = None,
                 store_check: StoreCheck | None = None, holdings: Holdings,
                 recoverable: Recoverability, residents: Residents) -> None:
        self.tree = tree
        self._holdings = holdings
        self._recoverable = recoverable
        self._residents = residents
        # The cluster's file records (None on a single node): a copy leaves them, then RAM.
        self.records = records
        self._leaves_paused_until = 0.0  # trio time: etcd did not take the last leave
        # The persistent tier, asked before a copy leaves RAM on its word (None: the store's
        # word is its mark, as in tests without a store).
        self.store_check = store_check
        self._store_paused_until = 0.0  # trio time: the store did not answer the last check
        self.versions = versions  # the tree's changes of versions (a version evicted...)
        # Committed versions the store was found to lack, all of whose files are here: the
        # daemon hands them to its uploader again.
        self._lost_send, self.lost_from_store = \
            trio.open_memory_channel[mf.StepManifest](math.inf)
        self.liveness = liveness  # who is up: a dead peer's copy does not count
        self.store = tree.store
        self.read_sources = read_sources
        self.background = background
        self.keep_ram = keep_ram
        self.replicas = replicas
        self._evictions: dict[StepState, trio.Event] = {}  # steps leaving RAM now
        self._safer = trio.Event()  # set, then renewed, whenever a step gets safe elsewhere
        self._room_stalled = False  # a wait for room saw no step get safe in ROOM_WAIT
        self._pressure_relief = False  # whether a background relief runs
        self.loads = StepLoads()  # steps being loaded whole (DCP), for fetch_whole
        # Steps whose small files are on their way (`_fetch_small`), and the manifests whose
        # small files could not all come (no room, a failure): not tried again for each open.
        self._small_running: set[StepState] = set()
        self._small_given_up: weakref.WeakKeyDictionary[StepState, mf.StepManifest] = \
            weakref.WeakKeyDictionary()
        self.small_fetched = 0  # files brought in by `_fetch_small` (status, tests)
        self._reading_ahead: set[StepState] = set()  # steps with a `_read_ahead` running
        # Their chunks in flight, which give way to an open waiting for a file (`fetch_whole`).
        self._ahead_slots: dict[StepState, Slots] = {}
        # Fetches a read-ahead started (before any open of their file), and the files and
        # bytes they brought into RAM, verified (status `fetched_ahead`, tests, the bench).
        self._ahead: weakref.WeakSet[Fetch] = weakref.WeakSet()
        self.ahead_files = 0
        self.ahead_bytes = 0

    # -- coming back -----------------------------------------------------------------------

    async def read_remote(self, node: Node, offset: int, size: int) -> bytes:
        """Bytes of a non-resident file, checked by block or chunk; a file read to its end
        stays in RAM, and one read back to back from its start is filled whole in the
        background (`fill_behind`)."""
        fetch = self._fetch_of(node)
        self._fetch_small(node)
        try:
            data = await fetch.read(self.read_sources, offset, size)
        except FetchError as exc:
            log.error("read of %s failed: %s", self.tree.relpath(node), self._unreachable(node)
                      or exc)
            raise FsError(errno.EIO) from None
        if fetch.complete and node.fetch is fetch:
            self._adopt(node, fetch)
        elif fetch.wants_whole and not fetch.filling and \
                self.store.room_for(fetch.missing_bytes):
            self.fill_behind(node, fetch)
            self._read_through(node)
        return data

    def _read_through(self, node: Node) -> None:
        """`node` is read back to back from its first byte (`cp -r`, `torch.load`): its step
        counts as being loaded (the next files' opens fetch them whole), and its next files of
        the same writer are read ahead (`_read_ahead`)."""
        step_node = next(tree_walk.enclosing_steps(node), None)
        if step_node is None or step_node.is_file or node.remote is None:
            return
        self.loads.read_through(step_node.step)
        self._read_ahead(node, node.remote.entry.name)

    def fill_behind(self, node: Node, fetch: Fetch) -> None:
        """Fetch the rest of a file being read sequentially, WHOLE_IN_FLIGHT chunks at a time,
        while its reader goes on; whole and verified, it is the file's object again, and opens
        from then on use passthrough. Only into free room (the caller checks): a fill never
        makes a copy leave RAM. A failure leaves it to the reads (which report it)."""
        fetch.filling = True

        async def fill() -> None:
            try:
                await fetch.fill(self.read_sources, WHOLE_IN_FLIGHT)
                self._adopt(node, fetch)
            except (FetchError, RamFull) as exc:
                log.info("%s is read range by range: %s", self.tree.relpath(node),
                         exc or "no room in RAM")
            finally:
                fetch.filling = False

        self.background.spawn(fill)

    def _fetch_of(self, node: Node) -> Fetch:
        if node.fetch is not None:
            return node.fetch
        return self._residents.start_fetch(node, Fetch(self.store, node.remote,
                                             spawn=self.background.spawn))

    async def chunk_for_peer(self, xxh3: str, index: int) -> int | None:
        """A peer was sent here for chunk `index` of the file with content `xxh3`, which this
        node is fetching: an fd of the partial copy once the chunk is in (`Fetch.relay_chunk`),
        or None."""
        fetch = next((node.fetch for node in self._residents.fetching
                      if node.fetch is not None and node.fetch.remote.entry.xxh3 == xxh3),
                     None)
        return None if fetch is None else await fetch.relay_chunk(index)

    async def make_resident(self, node: Node, *, empty: bool) -> None:
        """Bring a non-resident file into RAM before it changes: whole, or as an empty file."""
        if node.remote is None:
            return
        if empty:
            self._residents.make_empty_resident(node)
            return
        fetch = self._fetch_of(node)
        try:
            await fetch.fill(self.read_sources, WHOLE_IN_FLIGHT)
        except FetchError as exc:
            log.error("fetch of %s failed: %s", self.tree.relpath(node), self._unreachable(node)
                      or exc)
            raise FsError(errno.EIO) from None
        if node.fetch is fetch:
            self._adopt(node, fetch)
        if node.remote is not None:
            raise FsError(errno.EIO)

    async def fetch_whole(self, node: Node) -> None:
        """Before a read-only open that passthrough will answer (of any file: nothing to do
        for one in RAM but a step's `.metadata`): bring a small non-resident
        file (up to WHOLE_AT_OPEN bytes), or any file of a step being loaded (`StepLoads`: its
        `.metadata` was opened), into RAM (each chunk checked, then the whole), so that its
        reads go to the RAM store, not through the daemon.
        Concurrent opens share the fetch. Another large file is not waited for: its reads
        fetch what they touch first, and it comes in whole in the background once read
        sequentially from its start (`read_remote`). The file stays non-resident (read range
        by range through the daemon) if the RAM tier has no room for it, or a chunk cannot be
        fetched verified (the read that needs it gets EIO)."""
        if node.name == METADATA:  # in RAM or not: a multi-node step's other shards are not
            step_node = next(tree_walk.enclosing_steps(node), None)
            if step_node is not None:
                self.loads.opened(step_node, node)
        if node.remote is None:
            return
        if node.remote.entry.size > WHOLE_AT_OPEN and not self._being_loaded(node):
            return
        fetch = self._fetch_of(node)
        if not self.store.room_for(fetch.missing_bytes):
            return
        self._fetch_small(node)
        try:
            # the step's read-ahead, if one runs, gives way: its reader waits for this file
            with self._ahead_slots_of(node):
                await fetch.fill(self.read_sources, WHOLE_IN_FLIGHT)
        except (FetchError, RamFull) as exc:
            log.info("%s is read range by range: %s", self.tree.relpath(node),
                     exc or "no room in RAM")
            return
        self._adopt(node, fetch)
        if self._being_loaded(node):  # once this file is in: it has the bandwidth first
            self._read_ahead(node, fetch.remote.entry.name)

    def _fetch_small(self, node: Node) -> None:
        """`node`, a small file (up to SMALL_FILE bytes) of a committed step, is being fetched
        back: its step's other small files not in RAM come too, in the background, up to
        SMALL_STEP_BYTES in manifest order from the one after it (then from the start),
        SMALL_IN_FLIGHT at a time, each verified as any fetch is (its chunk, then its
        xxh3-128) and shared with a reader that opens it meanwhile. Only into free room: this
        never makes a copy leave RAM. One go per step at a time; a go that leaves small files
        behind (no room, a failure) is not started again for the same version."""
        if node.remote is None or node.remote.entry.size > SMALL_FILE:
            return
        step_node = next(tree_walk.enclosing_steps(node), None)
        if step_node is None or step_node.is_file:
            return
        step = step_node.step
        manifest = step.manifest
        if not step.committed or manifest is None or step in self._small_running \
                or self._small_given_up.get(step) is manifest:
            return
        # A multi-node step (its files written on several nodes, as the cluster's records
        # say): each rank reads its own shards, however small; none comes unasked.
        several_writers = len(set(step.file_writers.values())) > 1
        wanted = None if several_writers else self._small_files(step_node, node)
        if wanted is None:  # not again at every open of this version
            self._small_given_up[step] = manifest
        if not wanted:
            return
        self._small_running.add(step)
        where = self.tree.relpath(step_node)

        async def fetch_all() -> None:
            limiter = trio.CapacityLimiter(SMALL_IN_FLIGHT)
            complete = True
            fetched = 0
            nursery: trio.Nursery

            async def one(sibling: Node, given: dict[str, memoryview]) -> None:
                nonlocal complete, fetched
                async with limiter:
                    if sibling.remote is None or step_node.step is not step \
                            or step.manifest is not manifest:
                        return  # in RAM already, or the step moved on
                    fetch = self._fetch_of(sibling)
                    if not self.store.room_for(fetch.missing_bytes):
                        complete = False
                        return
                    came = given.get(sibling.remote.entry.name)
                    sources = self.read_sources if came is None else \
                        [GivenBytes(came, "peers"), *self.read_sources]
                    try:
                        await fetch.fill(sources, 1)
                        # EIO if the whole does not match
                        if self._adopt(sibling, fetch, quiet=True):
                            self.small_fetched += 1
                            fetched += 1
                    except (FetchError, RamFull, FsError) as exc:
                        log.debug("%s did not come with its step's small files: %s",
                                  self.tree.relpath(sibling), exc or "no room in RAM")
                        complete = False
                        if isinstance(exc, FetchError):  # no tier answers: the reads will say
                            nursery.cancel_scope.cancel()

            try:
                async with trio.open_nursery() as nursery:
                    for batch in _at_once(wanted):  # in order: the limiter lets them go first come
                        given = await self._read_files(batch)
                        for sibling in batch:
                            nursery.start_soon(one, sibling, given)
            finally:
                self._small_running.discard(step)
                log.info("%d small files of %s came back to RAM with one read of them "
                         "(verified)", fetched, where)
            if not complete:
                self._small_given_up[step] = manifest

        self.background.spawn(fetch_all)

    async def _read_files(self, files: list[Node]) -> dict[str, memoryview]:
        """The bytes of these small files of one step, unchecked, from the first source that
        gives many at once (`fetch.FilesSource`); none if no source can."""
        remotes = [node.remote for node in files if node.remote is not None]
        if not remotes:
            return {}
        for source in self.read_sources:
            read_files = getattr(source, "read_files", None)
            if read_files is None:
                continue
            try:
                given: dict[str, memoryview] = await read_files(
                    remotes[0].step_path, [remote.entry for remote in remotes
                                           if remote.step_path == remotes[0].step_path])
            except TierError:
                continue
            if given:
                return given
        return {}

    def _read_ahead(self, node: Node, name: str) -> None:
        """`node` (`name` in its step), a file of a step being loaded (`StepLoads`), came
        whole for its open: the step's other large files not in RAM that the same node wrote
        come now, in the background, in manifest order from the one after it (the order of
        the step's listing, and of its inode numbers, which `cp -r` sorts by here; DCP's
        shards), each fetched as `fetch_whole` does (verified, shared with an open of it
        meanwhile), WHOLE_IN_FLIGHT chunks in flight over them all: the next file starts once
        every chunk of the one before is on its way, so the pipe does not drain at each
        file's end. So the next file's bytes come while the loader reads this one (DCP reads
        a file, then opens the next). Only the writer's files: each
        node of a multi-node load reads the shards its own ranks wrote, and another node's
        must not come to every node (a node that wrote nothing here, a fresh one, reads
        ahead the files of the writer of the file it opened; in a cluster it asks the
        records who that is, and reads nothing ahead if they do not say). Only into free
        room; the
        read-ahead stops at the first file that does not fit or does not come. Each file
        comes as any fetch does: WHOLE_IN_FLIGHT chunks at a time over the peers' pooled
        connections, each received, checked and written into the RAM tier's partial file by
        a worker thread, never through the FUSE request path."""
        step_node = next(tree_walk.enclosing_steps(node), None)
        if step_node is None or step_node.is_file:
            return
        step = step_node.step
        manifest = step.manifest
        if manifest is None or step in self._reading_ahead:
            return
        if not any(sibling.remote is not None and sibling.remote.entry.size > SMALL_FILE
                   for sibling in self._step_files_after(step_node, name)):
            return  # all in RAM or on their way (a load of a step this node holds)
        self._reading_ahead.add(step)
        where = self.tree.relpath(step_node)
        records = self.records

        fetched = 0
        stopped = False  # a file did not come: no other starts

        async def one(sibling: Node, fetch: Fetch, limiter: trio.CapacityLimiter,
                      underway: trio.Event) -> None:
            nonlocal fetched, stopped
            try:
                await fetch.fill(self.read_sources, limiter=limiter, underway=underway)
                self._adopt(sibling, fetch)
                fetched += 1
            except (FetchError, RamFull, FsError) as exc:
                stopped = True
                log.info("read-ahead of %s stopped at %s: %s", where,
                         self.tree.relpath(sibling), exc or "no room in RAM")

        async def ahead() -> None:
            try:
                writers = step.file_writers
                if records is not None and name not in writers:
                    # a node that holds nothing of the step has not read who wrote what
                    writers = await records.writers_of(manifest) or {}
                    if name not in writers:
                        return  # unknown: no file comes unasked
                wanted = [sibling for sibling in self._step_files_after(step_node, name)
                          if sibling.remote is not None
                          and sibling.remote.entry.size > SMALL_FILE
                          and writers.get(sibling.remote.entry.name) == writers.get(name)]
                # One file after another, WHOLE_IN_FLIGHT chunks in flight over them all: the
                # next file starts once every chunk of the one before is on its way, so the
                # pipe stays full across files and the file a reader opens next comes first.
                limiter = self._ahead_slots[step] = Slots(WHOLE_IN_FLIGHT)
                coming: Fetch | None = None  # the file before, its last chunks on their way
                async with trio.open_nursery() as nursery:
                    for sibling in wanted:
                        if stopped or step_node.step is not step or step.manifest is not manifest:
                            return  # a file did not come, or the step moved on
                        if sibling.remote is None:
                            continue  # in RAM already (its open fetched it)
                        fetch = self._fetch_of(sibling)
                        before = coming.missing_bytes if coming is not None and \
                            coming.fd >= 0 else 0
                        if not self.store.room_for(fetch.missing_bytes + before):
                            return
                        self._ahead.add(fetch)
                        underway = trio.Event()
                        nursery.start_soon(one, sibling, fetch, limiter, underway)
                        await underway.wait()
                        coming = fetch
            finally:
                self._reading_ahead.discard(step)
                self._ahead_slots.pop(step, None)
                log.info("read-ahead of %s ended: %d files came to RAM", where, fetched)

        self.background.spawn(ahead)

    def _step_files_after(self, step_node: Node, name: str) -> list[Node]:
        """The step's files not in RAM and not being fetched, in manifest order from the one
        after `name` (then from the start)."""
        entries = step_node.step.manifest.files
        start = next((i + 1 for i, entry in enumerate(entries) if entry.name == name), 0)
        found = []
        for entry in entries[start:] + entries[:start]:
            if entry.name == name or entry.name in step_node.step.resident:
                continue
            sibling = tree_walk.entry_node(step_node, entry.name)
            if sibling is not None and sibling.remote is not None and sibling.fetch is None:
                found.append(sibling)
        return found

    def _small_files(self, step_node: Node, node: Node) -> list[Node] | None:
        """The files of the step that `_fetch_small` brings for `node`: small, not in RAM,
        not on their way, up to SMALL_STEP_BYTES, the ones after `node` first (None: the RAM
        tier has no room for them)."""
        wanted, total = [], 0
        name = node.remote.entry.name if node.remote is not None else ""
        for sibling in self._step_files_after(step_node, name):
            size = sibling.remote.entry.size if sibling.remote is not None else 0
            if size > SMALL_FILE:
                continue
            if total + size > SMALL_STEP_BYTES:
                break
            wanted.append(sibling)
            total += size
        return wanted if self.store.room_for(total) else None

    def _ahead_slots_of(self, node: Node) -> contextlib.AbstractContextManager[None]:
        """While an open waits for `node` whole: its step's read-ahead, if one runs, starts no
        chunk (`Slots.urgent`). A loader opens the step's files in an order of its own (a DCP
        load: its plan's), not the manifest's the read-ahead follows."""
        step_node = next(tree_walk.enclosing_steps(node), None)
        slots = None if step_node is None else self._ahead_slots.get(step_node.step)
        return contextlib.nullcontext() if slots is None else slots.urgent()

    def _being_loaded(self, node: Node) -> bool:
        step_node = next(tree_walk.enclosing_steps(node), None)
        return step_node is not None and self.loads.loading(step_node.step)

    def _unreachable(self, node: Node) -> str | None:
        """Why no tier can give this file, if its step is incomplete for want of it: its last
        holders and since when (`fs.tree.recoverable`)."""
        step = tree_walk.committed_step_holding(node)
        if step is None or node.remote is None:
            return None
        loss = self._recoverable.loss(step, fresh=True)
        lost = next((f for f in loss.files if f.name == node.remote.entry.name), None) \
            if loss is not None else None
        if lost is None:
            return None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(loss.since_ns / 1e9))
        return (f"no node reachable from here and no store holds it ({lost.why()}; last "
                f"held by {', '.join(lost.holders) or 'no node'}); its step is incomplete "
                f"since {since}")

    def _adopt(self, node: Node, fetch: Fetch, *, quiet: bool = False) -> bool:
        """A complete fetch that matches its xxh3-128 becomes the file's committed object (a
        second completer finds it adopted, or gone: no await in between); whether it did.
        `quiet`: no log line of its own (a step's small files have one for them all)."""
        if node.fetch is not fetch:
            return False
        good = fetch.verify()
        size = node.remote.entry.size if node.remote is not None else 0
        if not self._residents.adopt_fetch(node, fetch, good):
            return False
        if fetch in self._ahead:
            self.ahead_files += 1
            self.ahead_bytes += size
        if not quiet:
            log.info("%s is back in RAM (%d bytes, verified)", self.tree.relpath(node), size)
        return True

    async def prefetch(self, relpath: str) -> int:
        """`tierfs prefetch`: bring every file of a committed step into RAM; bytes fetched."""
        step_node = self.tree.find_step(relpath)
        # Also a step committed with its hashes to come: every file of it is here already.
        if step_node is None or not step_node.step.shown_committed:
            raise FsError(errno.EINVAL, f"{relpath} is not a committed step")
        fetched = 0
        for _rel, node in list(tree_walk.files_under(step_node)):
            if node.remote is not None:
                size = node.remote.entry.size
                await self.make_resident(node, empty=False)
                fetched += size
        return fetched

    # -- leaving RAM ---------------------------------------------------------------------
    #
    # A step leaves RAM file by file: the tree file first, then the committed object once no
    # other step names it (a crash in between leaves an object that start-up links back, or
    # none: the file is read from another tier). Files that are open, or whose bytes are on
    # their way in, stay. The work runs in slices of EVICT_SLICE seconds with a checkpoint in
    # between, so that evicting a step of 50,000 files never holds the FUSE loop; each file is
    # checked and changed with no await in between (`Residents.evict_file`), so handlers see it
    # either in RAM or not. In a cluster, the records of a step not persisted change first
    # (`_leave`): a copy leaves the file's holders in etcd before its bytes leave RAM, never
    # after, so no node plans a copy from a node that no longer has it as if it were the last
    # ones. A persisted step's records change after (`_leave_later`): the persistent tier
    # holds it whatever the records say.

    def enforce_keep_ram(self) -> None:
        """Evict steps beyond the newest `keep_ram` of each run directory that are safe
        elsewhere (`file_leaves`: persisted, or K + 1 live copies on other nodes): without a
        store, the K + 1 copies of a file stay in RAM whatever --keep-ram says. The first
        slice of the work is done at once; what remains continues in the background. Called
        whenever a step gets safer (persisted, or a copy held): a write waiting for room wakes."""
        self._safer.set()
        self._safer = trio.Event()
        self._room_stalled = False
        for step_node in self._eviction_candidates(pressure=False):
            self._evict_soon(step_node)

    async def make_room(self, needed: int, sparing: Node | None = None) -> None:
        """Before a write that needs `needed` more bytes is refused: committed copies that are
        safe elsewhere leave RAM, read-back copies and steps beyond --keep-ram first, then the
        newer ones (--keep-ram yields to a write), oldest first; `sparing`'s step stays. If
        none is safe yet but some are on their way (a commit does not wait for the hashes that
        the store and the peers wait for), the write waits for them (ROOM_WAIT). Raises
        RamFull, with a log line naming what holds the RAM, if that is not enough."""
        if not await self._free_safe_copies(needed, sparing):
            self.store.check_room(needed, self._ram_holders())

    async def _free_safe_copies(self, needed: int, sparing: Node | None = None) -> bool:
        """Evict safe copies (see `make_room`) until `needed` more bytes fit; whether they do."""
        tried: set[StepState] = set()  # a step with files in use keeps them: once is enough
        while not self.store.room_for(needed) and needed <= self.store.limit_bytes:
            running = self._evictions
            candidates = [node for node in self._eviction_candidates(pressure=True)
                          if node.step not in running and node.step not in tried
                          and not tree_walk.holds(node, sparing)]
            if candidates:
                tried.add(candidates[0].step)
                await self._evict(candidates[0])
            elif running:
                await next(iter(running.values())).wait()
            elif self._on_their_way():
                with trio.move_on_after(ROOM_WAIT) as waited:
                    await self._safer.wait()
                self._room_stalled = waited.cancelled_caught
            else:
                break
        return self.store.room_for(needed)

    def _on_their_way(self) -> bool:
        """Whether a committed step in RAM may get safe elsewhere soon: there is another tier,
        and the last wait for one did not run out (a store down: later writes are refused at
        once, until a step gets there)."""
        if not self.read_sources or self._room_stalled:
            return False
        return any(self._not_yet_safe(node.step) for node in self.tree.steps())

    def _not_yet_safe(self, step: StepState) -> bool:
        """A committed step in RAM that may not leave it yet: its hashes still to come (no
        manifest, so nothing of it left the node), or not yet persisted or copied enough."""
        if step.pending is not None and not step.pending.superseded:
            return True
        return step.committed and bool(step.resident) and not self.safe_elsewhere(step)

    def relieve_pressure(self) -> None:
        """The tier is over its limit (passthrough writers add bytes the daemon does not see
        one by one): safe copies leave RAM in the background until it is back under."""
        if self.store.room_for(0) or self._pressure_relief:
            return
        self._pressure_relief = True

        async def relieve() -> None:
            try:
                await self._free_safe_copies(0)  # what stays is not safe elsewhere
            finally:
                self._pressure_relief = False

        self.background.spawn(relieve)

    def _eviction_candidates(self, *, pressure: bool) -> list[Node]:
        """Committed steps with bytes in RAM that are safe elsewhere, in the order they leave:
        beyond --keep-ram of their run directory first, then (under pressure) the others,
        each group by step number, oldest first."""
        by_run: dict[int, list[Node]] = {}
        for node in self.tree.steps():
            if node.step.committed:
                by_run.setdefault(node.parent.ino, []).append(node)
        beyond: list[Node] = []
        within: list[Node] = []
        for step_nodes in by_run.values():
            # Loose files (no number) are not counted: they leave RAM only under pressure.
            step_nodes.sort(key=_number, reverse=True)
            for rank, node in enumerate(step_nodes):
                step = node.step
                if any(self.file_leaves(step, name) for name in step.resident) or (
                        not step.resident and self._residents.has_partial_fetches(node)):
                    counted = node.step.number is not None and rank >= self.keep_ram
                    (beyond if counted else within).append(node)
        oldest_first = _number
        return sorted(beyond, key=oldest_first) + (
            sorted(within, key=oldest_first) if pressure else [])

    def safe_elsewhere(self, step: StepState) -> bool:
        """Whether every file of the step in RAM here may leave it (`file_leaves`)."""
        return step.persisted_on_record or all(self.file_leaves(step, name)
                                               for name in step.resident)

    def file_leaves(self, step: StepState, name: str) -> bool:
        """Whether this node's copy of one file of a committed step may leave RAM (the K + 1
        rule): the step is persisted, or K + 1 live peers are known to hold verified copies
        of it without this one. Whoever wrote the file, and whether the copy is a replica or
        one read back here: without a store, the K + 1 copies the cluster makes of a file
        (its writer's and K replicas) all stay; only a copy beyond those may go. This is
        what this node knows; the records in etcd have the last word (`_leave`). A file
        whose holders this node has not read (a copy read back here) is judged by the nodes
        holding some file of the step: if K + 1 of them are live, etcd is asked."""
        return step.persisted_on_record or self._copies_elsewhere(step, name)

    def _copies_elsewhere(self, step: StepState, name: str) -> bool:
        """The K + 1 rule of `file_leaves` without the store: K + 1 live peers hold verified
        copies of the file without this one."""
        peers = self._holdings.verified_peers(step, name)
        if name not in step.file_holders and self.records is not None:
            peers = peers | (step.holders - {self.tree.node_id})
        if self.liveness is not None:
            peers = {peer for peer in peers if self.liveness.is_up(peer)}
        return len(peers) >= self.replicas + 1

    def _ram_holders(self) -> str:
        """What the RAM tier holds that cannot leave it now, for the log line of a refusal."""
        writing, unsafe = [], []
        for node in self.tree.steps():
            step = node.step
            if self._not_yet_safe(step):
                unsafe.append(self.tree.relpath(node))
            elif not step.committed:
                writing.append(self.tree.relpath(node))
        parts = []
        if writing:
            parts.append("steps being written (or left half-written by a failed save; "
                         "remove or save them again to free their space): "
                         + ", ".join(sorted(writing)[:5]) + (" ..." if len(writing) > 5 else ""))
        if unsafe:
            parts.append(f"{len(unsafe)} committed steps not yet persisted or replicated")
        return "; ".join(parts)

    def _evict_soon(self, step_node: Node) -> None:
        """Evict a step: the first slice now, the rest in the background (in a cluster, all of
        a step not persisted in the background: the records change first)."""
        step = step_node.step
        if step in self._evictions:
            return
        work = None
        if (self.records is None or step.persisted_on_record) and not self._asks_store(step):
            self._leave_later(step_node)
            work = self._eviction_work(step_node, FIRST_SLICE)
            try:
                next(work)
            except StopIteration:
                return
        self._evictions[step] = trio.Event()
        self.background.spawn(self._finish_eviction, step_node, work)

    async def _evict(self, step_node: Node) -> None:
        """Evict a step, a slice at a time, in this task."""
        self._evictions[step_node.step] = trio.Event()
        await self._finish_eviction(step_node, None)

    async def _finish_eviction(self, step_node: Node, work: Iterator[None] | None) -> None:
        step = step_node.step
        try:
            if work is None:
                manifest = step.manifest
                leaving = await self._leave(step_node)
                if step_node.step is not step or step.manifest is not manifest:
                    return  # re-saved or removed meanwhile: the names are of another version
                # no await from here to the generator's first slice: the version stays
                work = self._eviction_work(step_node, leaving=leaving)
            for _slice in work:
                await trio.sleep(EVICT_SLICE)
        finally:
            self._evictions.pop(step).set()

    async def _leave(self, step_node: Node) -> set[str] | None:
        """The files of the step whose copies here may leave RAM now (None: all may).

        A persisted step: those the store is seen to hold now (`_held_in_store`), once it
        holds every file of the step; the records are told later (`_leave_later`). A step
        the store lacks files of is no longer persisted (`store_lacks`), and one the store
        cannot be asked about stays persisted; in both cases nothing leaves on the store's
        word, and the cluster's rule below decides.

        In a cluster: those whose copies here may leave RAM once the records stopped
        counting this node as their holder. Records first, bytes second: between the two
        the records count one copy fewer than there are (a restore may make one more),
        never one more (a restore that does not happen). If etcd does not take the change,
        the files stay in RAM: evicting them anyway would leave records that overstate the
        copies until a restart, and a later eviction tries again (under pressure a write is
        refused, which the writer sees). A file opened between the two stays in RAM
        uncounted: again one copy fewer.

        The change is guarded where it is made (in etcd's transaction): only records that
        still list K + 1 other live holders let this node go, so a holder that dropped
        itself meanwhile (it lost its copy) is never relied on; a holder that comes back
        with an empty RAM dir drops itself before it registers as a live member. Not closed
        by this: a holder whose RAM dir is wiped and which comes back under the same id
        before its lease ran out (a few seconds) is counted live with copies it lost until
        it has started."""
        step = step_node.step
        manifest = step.manifest
        if step.persisted_on_record:
            if not self._asks_store(step):
                self._leave_later(step_node)
                return None
            held = await self._held_in_store(step_node)
            if step_node.step is not step or step.manifest is not manifest:
                return set()  # re-saved or removed meanwhile
            if held is not None and all(e.name in held for e in manifest.files):
                self._leave_later(step_node)
                return None
            if held is not None and step.persisted:
                self.store_lacks(step_node, [e.name for e in manifest.files
                                             if e.name not in held], "before leaving RAM")
        if self.records is None:  # the peers this node knows of decide (`file_leaves`)
            return {name for name in step.resident if self._copies_elsewhere(step, name)} \
                if step.persisted_on_record else None
        names = [name for name in sorted(step.resident) if self._copies_elsewhere(step, name)
                 and not self._in_use(step_node, name)]
        if not names or trio.current_time() < self._leaves_paused_until:
            return set()
        liveness = self.liveness
        allowed = await self.records.leave_files(
            step.manifest, names, self.replicas + 1,
            liveness.is_up if liveness is not None else _anyone)
        if allowed is None:
            self._leaves_paused_until = trio.current_time() + LEAVE_PAUSE
            return set()
        return allowed

    def _asks_store(self, step: StepState) -> bool:
        """Whether the copies of this step may leave RAM on the store's word only after
        the store is seen to hold them (`_leave`)."""
        return step.persisted_on_record and self.store_check is not None

    async def _held_in_store(self, step_node: Node) -> set[str] | None:
        """The files of the step's committed version the store holds now; None if it could
        not say (nothing leaves on its word then, and for STORE_PAUSE no other is asked)."""
        step = step_node.step
        if self.store_check is None or trio.current_time() < self._store_paused_until:
            return None
        try:
            return await self.store_check.held_files(step.manifest)
        except TierError as exc:
            self._store_paused_until = trio.current_time() + STORE_PAUSE
            log.warning("%s stays in RAM: the persistent tier cannot say now whether it holds "
                        "it (%s)", step.manifest.path, exc)
            return None

    def store_lacks(self, step_node: Node, lacking: list[str], seen: str) -> None:
        """The store was seen (`seen`: when) to lack these files of the step's committed
        version, which it was believed to hold: the step no longer counts as persisted
        (`StepVersions.set_store_lost`): nothing of it leaves RAM on the store's word, and
        `status` says so. With every file of it here it goes up again; a file of it in no
        tier makes it incomplete (`fs.tree.recoverable`)."""
        step = step_node.step
        manifest = step.manifest
        self.versions.set_store_lost(step_node, lacking)
        self._recoverable.loss(step, fresh=True)  # lost now, if no other tier has it
        again = step.in_ram
        log.error("the persistent tier lacks %d of the %d files of %s v%d (%s), seen %s: "
                  "it no longer counts as persisted; %s", len(lacking), len(manifest.files),
                  manifest.path, manifest.version, some_names(lacking), seen,
                  "its files stay in RAM, and it is uploaded again" if again else
                  "its files not in RAM here are readable only from peers that hold them")
        if again:
            self._lost_send.send_nowait(manifest)

    def _leave_later(self, step_node: Node) -> None:
        """A persisted step leaves RAM now: its files in RAM (not in use) leave the records in
        the background, tried again every LEAVE_PAUSE while etcd does not take it. Until then
        the records count this node for files it no longer has in RAM: no loss, the
        persistent tier holds them (a read of such a file from here is fetched again)."""
        records = self.records
        step = step_node.step
        names = [name for name in sorted(step.resident) if not self._in_use(step_node, name)]
        if records is None or not names:
            return
        manifest = step.manifest

        async def leave() -> None:
            while await records.leave_files(manifest, names, 0, _anyone) is None:
                await trio.sleep(LEAVE_PAUSE)

        self.background.spawn(leave)

    def copies_lost(self, manifest: mf.StepManifest, names: list[str]) -> None:
        """This node's copies of these files are gone (found bad): the records stop counting
        them, in the background (a log line if etcd does not take it)."""
        records = self.records
        if records is None or not names:
            return

        async def drop() -> None:
            try:
                await records.drop_copies(manifest, names)
            except TierError as exc:
                log.warning("could not record in the cluster that the copies of %d files of "
                            "%s here are lost: %s", len(names), manifest.path, exc)

        self.background.spawn(drop)

    def _in_use(self, step_node: Node, name: str) -> bool:
        node = tree_walk.entry_node(step_node, name)
        return node is not None and bool(node.handles or (node.fetch and node.fetch.busy))

    def _eviction_work(self, step_node: Node, first_slice: float = EVICT_SLICE,
                       leaving: set[str] | None = None) -> Iterator[None]:
        """Drop a safe step's bytes from RAM, file by file; it stays listed and readable.
        Of the files in RAM, only those of `leaving` (if given: the records no longer count
        them here) go. Yields whenever a slice of work is done and a checkpoint is due."""
        step = step_node.step
        manifest = step.manifest
        freed = evicted = 0
        holders: set[str] = set()  # the live peers holding the evicted files
        deadline = time.monotonic() + first_slice
        for entry in manifest.files:
            if step_node.step is not step or step.manifest is not manifest \
                    or not step.committed:
                break  # re-saved, superseded or removed meanwhile: it is no longer ours to evict
            if entry.name in step.resident and (
                    not self.file_leaves(step, entry.name)
                    or (leaving is not None and entry.name not in leaving)):
                continue  # not safe elsewhere (fewer than K + 1 other copies)
            node = tree_walk.entry_node(step_node, entry.name)
            size = None if node is None else self._residents.evict_file(step, entry, node)
            if size is not None:
                freed += size
                evicted += 1
                holders |= self._holdings.verified_peers(step, entry.name)
            if time.monotonic() > deadline:
                yield
                deadline = time.monotonic() + EVICT_SLICE
        if not evicted:
            return  # nothing was in RAM but files in use
        log.info("evicted %s v%d from RAM (%d files, %d bytes); they stay readable from %s",
                 manifest.path, manifest.version, evicted, freed,
                 "the persistent tier" if step.persisted else
                 f"peers {', '.join(sorted(holders))} (each file on at least "
                 f"{self.replicas + 1} of them)")


def _anyone(_node: str) -> bool:
    """Every node counts as live (no `Liveness` given, or none is needed)."""
    return True


def _number(step_node: Node) -> int:
    """A step's number for ordering; a loose file (none) comes first."""
    number = step_node.step.number
    return -1 if number is None else number


def _at_once(files: list[Node]) -> Iterator[list[Node]]:
    """`files` (small, not in RAM) in runs a source may give at once: SMALL_AT_ONCE files and
    SMALL_AT_ONCE_BYTES at most each."""
    run: list[Node] = []
    size = 0
    for node in files:
        node_size = node.remote.entry.size if node.remote is not None else 0
        if run and (len(run) >= SMALL_AT_ONCE or size + node_size > SMALL_AT_ONCE_BYTES):
            yield run
            run, size = [], 0
        run.append(node)
        size += node_size
    if run:
        yield run
