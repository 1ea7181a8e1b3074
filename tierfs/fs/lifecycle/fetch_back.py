"""Fetch back: committed files whose bytes live in another tier, brought into RAM on demand
(verified), ahead of a reader going through a step, or on request (`tierfs prefetch`).

A read of a file not in RAM fetches the blocks or chunks it touches (`fs.store.fetch`); a file
read back to back from its first byte comes whole in the background; a small file, or any file
of a step being loaded (its `.metadata` opened: `StepLoads`), comes whole before a read-only
open returns, so that passthrough answers its reads. A step's other small files come with the
first one read back, many per request (`_fetch_small`), and the other large files of the step
that the same node wrote come while the loader reads one (`_read_ahead`). Every file comes
checked (its chunks or blocks, then its xxh3-128) and only into free room: fetching never makes
a copy leave RAM (`fs.lifecycle.eviction` decides that). The tiers it reads from are
`ReadSource`s (peers first, then the persistent tier), and its background work runs under the
`Spawner` it is given.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs.fs.lifecycle.step_loads import StepLoads
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import METADATA, FsError, Node, StepState
from tierfs.fs.model.ports import ReadSource, SealedCollector, Spawner, TierError
from tierfs.fs.store.fetch import WHOLE_IN_FLIGHT, Fetch, FetchError, GivenBytes, Slots
from tierfs.fs.store.ram_store import RamFull

if TYPE_CHECKING:
    from tierfs.fs.tree.recoverable import Recoverability
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.tree import Tree

log = logging.getLogger(__name__)

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
SMALL_IN_FLIGHT = 16
# A source that can (a peer, `fetch.FilesSource`) is asked for this many of them at once, in
# one request: one request per file made a peer's read-back of a step of 10,000 small files
# 3.5x slower than the store's out of its packs.
SMALL_AT_ONCE = 512
SMALL_AT_ONCE_BYTES = 4 << 20


class FetchBack:
    """Files whose bytes are in another tier: fetched back on demand, ahead, on request."""

    def __init__(self, tree: Tree, read_sources: list[ReadSource], background: Spawner, *,
                 records: SealedCollector | None = None, recoverable: Recoverability,
                 residents: Residents) -> None:
        self.tree = tree
        self.store = tree.store
        self.read_sources = read_sources
        self.background = background
        # The cluster's file records (None on a single node): who wrote the files read ahead.
        self.records = records
        self._recoverable = recoverable  # why a file no tier gives is lost
        self._residents = residents
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
        except RamFull:
            if node.fetch is not fetch:  # dropped meanwhile: the file went (a peer's delete)
                raise FsError(errno.ENOENT) from None
            raise
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
