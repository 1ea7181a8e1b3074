"""Eviction: committed steps leaving RAM once they are safe elsewhere: under --keep-ram, and
under RAM pressure before any write is refused.

`Eviction` decides what leaves and when; the `Tree` makes each change (`evict_file`). In a
cluster, a copy of a step not persisted leaves RAM only after the cluster's file records
stopped counting this node as its holder (`SealedCollector.leave_files`, which refuses unless
the record lists K + 1 other live holders: no eviction leaves a file with fewer than K + 1
copies, and the records never say there are more copies than there are of a file that exists
nowhere else). A persisted step's copies leave only once the store is seen to hold them at that
moment (`StoreCheck`: a listing of the step's objects, not the mark written when it was
uploaded); a step the store was found to lack is no longer counted as persisted, and goes up
again (`lost_from_store`). Then they leave at once, and the records are told in the background
(best effort: the persistent tier holds the file, so a holder counted too many is no loss). A
copy found bad (`copies_lost`) leaves the records in the background too, as a lost copy (the
other holders restore it). Its background work runs under the `Spawner` it is given; what comes
back into RAM is `fs.lifecycle.fetch_back`'s.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import Node, StepState, some_names
from tierfs.fs.model.ports import (
    Liveness,
    SealedCollector,
    Spawner,
    StoreCheck,
    StoreLoss,
    TierError,
)

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
# How long a write that needs room waits for a committed step on its way to the store or the
# peers (hashed after its commit, then sent) to become safe there and leave RAM, before it is
# refused with ENOSPC; each step that gets there starts the wait anew.
ROOM_WAIT = 30.0


class Eviction:
    """Committed steps leaving RAM once safe elsewhere: beyond --keep-ram, and for room."""

    def __init__(self, tree: Tree, versions: StoreLoss, background: Spawner, *,
                 other_tiers: bool, keep_ram: int = 3, replicas: int = 0,
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
        # Whether there is a tier (peers, a store) a step may get safe in: if not, a write
        # never waits for one.
        self.other_tiers = other_tiers
        self.background = background
        self.keep_ram = keep_ram
        self.replicas = replicas
        self._evictions: dict[StepState, trio.Event] = {}  # steps leaving RAM now
        self._safer = trio.Event()  # set, then renewed, whenever a step gets safe elsewhere
        self._room_stalled = False  # a wait for room saw no step get safe in ROOM_WAIT
        self._pressure_relief = False  # whether a background relief runs

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

    def enforce_keep_ram(self, safer: Node | None = None) -> None:
        """Evict steps beyond the newest `keep_ram` of each run directory that are safe
        elsewhere (`file_leaves`: persisted, or K + 1 live copies on other nodes): without a
        store, the K + 1 copies of a file stay in RAM whatever --keep-ram says. The first
        slice of the work is done at once; what remains continues in the background. Called
        whenever a step gets safer (persisted, or a copy held): a write waiting for room wakes.
        `safer`, the step that did: only the steps of its run directory are looked at (no
        other step's rank or safety changed, and a look at every step of a mount holding
        thousands made each upload's end cost a walk of them all); None: every step."""
        self._safer.set()
        self._safer = trio.Event()
        self._room_stalled = False
        if safer is not None and safer.parent is None:
            return  # removed meanwhile
        among = None if safer is None else (
            child for child in safer.parent.children.values() if child.step is not None)
        for step_node in self._eviction_candidates(pressure=False, among=among):
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
        if not self.other_tiers or self._room_stalled:
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

    def _eviction_candidates(self, *, pressure: bool,
                             among: Iterable[Node] | None = None) -> list[Node]:
        """Committed steps with bytes in RAM that are safe elsewhere, in the order they leave:
        beyond --keep-ram of their run directory first, then (under pressure) the others,
        each group by step number, oldest first. `among`: those steps only (every step of
        the run directories it names), else every step."""
        by_run: dict[int, list[Node]] = {}
        for node in self.tree.steps() if among is None else among:
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

