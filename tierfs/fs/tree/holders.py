"""Who holds a committed step, told the same way on every node.

`tierfs status` shows a step's `copies`, `holders` and TIERS. In a cluster they are computed
here from one source, the same on every node: the cluster's file records (who holds a verified
copy of each file, in etcd) and whether the store holds the step; never from what one node
happens to hold (a copy read back into its RAM is not a recorded copy) or believes of its
peers. A multi-node step's files are spread over its writers and their replicas: its TIERS show
the spread, `peer:node0-3 (2 copies each)` (files on node0 to node3, each file on two of
them), where a step held whole by every holder shows `peer:node0,node1`.

`Holdings` is the arithmetic over one step's state as this node knows it; `spread` and
`node_ranges` are pure functions over values; `RecordedHolders` keeps the records
the daemon reads for a status (briefly: a status polled in a loop does not read etcd each time).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import StepState

log = logging.getLogger(__name__)

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


@dataclass(frozen=True)
class Spread:
    """How the files of one committed step are held: `holders`, every node holding some
    file; `whole`, those holding every file; `copies` and `most`, the fewest and the most
    live copies of any file (the store not counted)."""

    holders: tuple[str, ...]
    whole: tuple[str, ...]
    copies: int
    most: int

    def tiers(self, persisted: bool) -> str:
        """TIERS of `tierfs status`: the holders (and the copies of each file, when not
        every holder holds every file), then `persist`; `-` if none."""
        parts = []
        if self.holders:
            named = "peer:" + node_ranges(self.holders)
            if self.whole != self.holders:
                each = (f"{self.copies} copies each" if self.copies == self.most
                        else f"{self.copies}-{self.most} copies")
                named += f" ({each})"
            parts.append(named)
        if persisted:
            parts.append("persist")
        return ",".join(parts) or "-"


def spread(files: Mapping[str, Collection[str]], is_up: Callable[[str], bool]) -> Spread:
    """The spread of a step whose files (every one, by name) are held by these nodes (a
    file with no holder: an empty collection). Only live holders count as copies; every
    recorded holder is named."""
    # A step's files share a few holder sets (each writer's and its replicas'): each set is
    # judged once, not each file (a status lists every step, of any number of files).
    groups = {frozenset(nodes) for nodes in files.values()}
    holders = frozenset().union(*groups)
    whole = frozenset.intersection(*groups) if groups else frozenset()
    counts = [sum(1 for node in group if is_up(node)) for group in groups]
    return Spread(tuple(sorted(holders)), tuple(sorted(whole)), min(counts, default=0),
                  max(counts, default=0))


def node_ranges(nodes: Collection[str]) -> str:
    """Node ids, sorted, consecutive numbered ones of one prefix as a range:
    `node0-3,spare` for node0, node1, node2, node3 and spare (a run of two stays a list)."""
    runs: list[list[tuple[str, int, str]]] = []
    for node in sorted(nodes, key=_numbered_key):
        match = _NUMBERED.match(node)
        prefix, number = (match.group(1), int(match.group(2))) if match else (node, -1)
        last = runs[-1][-1] if runs else None
        if (last is not None and match and last[1] >= 0 and last[0] == prefix
                and last[1] + 1 == number):
            runs[-1].append((prefix, number, node))
        else:
            runs.append([(prefix, number, node)])
    named = []
    for run in runs:
        if len(run) > 2:
            named.append(f"{run[0][2]}-{run[-1][1]}")
        else:
            named += [node for _prefix, _number, node in run]
    return ",".join(named)


def _numbered_key(node: str) -> tuple[str, int, str]:
    match = _NUMBERED.match(node)
    return (match.group(1), int(match.group(2)), node) if match else (node, -1, node)


# The records of a step are read again for `tierfs status` at most this often: a status polled
# in a loop costs etcd one read of each step per second, not one per call.
RECORDS_FRESH = 1.0
# ... and, however often a status is asked for, not before READ_SHARE times as long as the last
# read took has passed: a step of 20,000 files takes about half a second to read and decode,
# and a status polled in a loop spent most of the daemon's loop on it.
READ_SHARE = 5
RECORDS_PATIENCE = 1.0  # seconds a status waits for etcd before it shows this node's view
# After etcd did not answer a status in time, the statuses of this many seconds do not ask it
# (a status polled during an etcd outage answers at once, from this node's view).
RECORDS_PAUSE = 5.0

# (manifest) -> {file name: its holders, from the cluster's records}, None if unknown
ReadHolders = Callable[[mf.StepManifest], Awaitable[dict[str, set[str]] | None]]
# (manifest) -> a value that names the content of its records now (equal only if they did
# not change), None if unknown
ReadStamp = Callable[[mf.StepManifest], Awaitable[Hashable | None]]


@dataclass
class _Read:
    """One step version's records as last read (trio times), with this node's own changes
    since."""

    at: float
    took: float
    files: dict[str, set[str]]
    stamp: Hashable | None = None  # of the records read (`ReadStamp`)

    def due(self, now: float) -> bool:
        return now - self.at >= max(RECORDS_FRESH, READ_SHARE * self.took)


class RecordedHolders:
    """The cluster's file records of the committed steps, as `tierfs status` shows them: read
    on demand (`ReadHolders`), kept for RECORDS_FRESH seconds per step version (or READ_SHARE
    times as long as their read took), with the changes this node made meanwhile (`changed`:
    the copies it recorded). Due again, records whose stamp did not change (`ReadStamp`: a
    request or two) are kept as they are: going through every file of them again took a
    status about 0.45 s of the loop for a 50,000-file step (ad hoc), each time it was due."""

    def __init__(self, read: ReadHolders, stamp: ReadStamp | None = None) -> None:
        self._read = read
        self._stamp = stamp
        self._cache: dict[tuple[str, int], _Read] = {}
        self._paused_until = -math.inf  # trio time: etcd did not answer the last status
        # Where reads run once `run` owns a nursery: a read that outlasts a status's patience
        # goes on, for the next status (the records of a 50,000-file step take longer than
        # RECORDS_PATIENCE to read, and, cancelled, were never shown), one per step at a time.
        self._nursery: trio.Nursery | None = None
        self._reading: dict[tuple[str, int], trio.Event] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the reads that outlast a status, until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def of(self, manifests: list[mf.StepManifest]) -> dict[str, dict[str, set[str]]]:
        """{step path: {file name: holders}} for those of `manifests` whose records could be
        read by RECORDS_PATIENCE (or were, less than RECORDS_FRESH ago, or by a read that
        outlasted an earlier status)."""
        now = trio.current_time()
        wanted = {(m.path, m.version): m for m in manifests}
        self._cache = {key: value for key, value in self._cache.items() if key in wanted}
        if now < self._paused_until:
            wanted = {}
        due = [(key, manifest) for key, manifest in wanted.items()
               if (cached := self._cache.get(key)) is None or cached.due(now)]
        with trio.move_on_after(RECORDS_PATIENCE) as patience:
            nursery = self._nursery
            if nursery is None:  # no `run`: each read is the status's own
                for key, manifest in due:
                    await self._read_into_cache(key, manifest)
            else:
                for done in [self._reading.get(key) or self._read_later(nursery, key, manifest)
                             for key, manifest in due]:
                    await done.wait()
        if patience.cancelled_caught:
            self._paused_until = trio.current_time() + RECORDS_PAUSE
        return {path: read.files for (path, _version), read in self._cache.items()}

    def _read_later(self, nursery: trio.Nursery, key: tuple[str, int],
                    manifest: mf.StepManifest) -> trio.Event:
        done = self._reading[key] = trio.Event()

        async def read() -> None:
            try:
                await self._read_into_cache(key, manifest)
            except Exception as exc:  # noqa: BLE001 - a status's read never ends the daemon
                log.warning("reading the records of %s for a status failed: %r", key[0], exc)
            finally:
                del self._reading[key]
                done.set()

        nursery.start_soon(read)
        return done

    async def _read_into_cache(self, key: tuple[str, int], manifest: mf.StepManifest) -> None:
        started = trio.current_time()
        # the stamp before the read: the records read are of that stamp or newer
        stamp = await self._stamp(manifest) if self._stamp is not None else None
        cached = self._cache.get(key)
        if stamp is not None and cached is not None and cached.stamp == stamp:
            cached.at = trio.current_time()
            cached.took = cached.at - started
            return
        files = await self._read(manifest)
        if files is not None:
            at = trio.current_time()
            self._cache[key] = _Read(at, at - started, files, stamp)

    def changed(self, path: str, version: int, holders: Mapping[str, set[str]]) -> None:
        """This node changed the records of these files of that step version (it recorded
        copies it made), which now name `holders`: a status shows them at once (re-reading
        every record for it cost a status of a 20,000-file step half a second, at each batch
        of copies; kept as read, they hid a copy verified in 0.7 s until the next read)."""
        cached = self._cache.get((path, version))
        if cached is not None:
            cached.files.update(holders)


class Holdings:
    """The holder arithmetic of one node over a step's own state (`StepState`: its replicas,
    the peers known to hold files of it, and per file the holders the cluster's records name):
    who else holds the committed version, each file of it, or all of it, how many live copies
    its least-held file has, and its TIERS. `node_id` is this node, never counted as a peer."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def peer_holders(self, step: StepState) -> list[str]:
        """Other nodes known to hold the committed version: replicas of ours, or the owner."""
        if not step.committed:
            return []
        known = step.replicas | step.holders
        if step.manifest.node_id != self.node_id:
            known = known | {step.manifest.node_id}
        return sorted(known - {self.node_id})

    def file_peers(self, step: StepState, name: str) -> set[str]:
        """Other nodes holding this file of the committed version: its own holders once the
        cluster's records told them, else those known for the step."""
        known = step.file_holders.get(name)
        if known is None or not step.committed:
            return set(self.peer_holders(step))
        return (known | step.replicas) - {self.node_id}

    def verified_peers(self, step: StepState, name: str) -> set[str]:
        """Other nodes known to hold a verified copy of this file: its holders in the
        cluster's records, and the replicas of the whole step (never the nodes merely known to
        hold some file of it)."""
        return (step.file_holders.get(name, set()) | step.replicas) - {self.node_id}

    def full_holders(self, step: StepState) -> list[str]:
        """Other nodes holding every file of the committed version."""
        if not step.committed:
            return []
        if not step.file_holders:
            return self.peer_holders(step)
        holders: set[str] | None = None
        for entry in step.manifest.files:
            peers = self.file_peers(step, entry.name)
            holders = peers if holders is None else holders & peers
        return sorted(holders or ())

    def copies(self, step: StepState, is_up: Callable[[str], bool]) -> int:
        """The fewest live copies of any file of the committed version (this node's RAM and
        the live peers holding it); 0 for a step being written."""
        if not step.committed:
            return 0
        # A file with no holders of its own has the step's (`file_peers`): counted once, not
        # once per file (`tierfs status` of a 10,000-file step spent nearly all its time here).
        step_peers = sum(1 for peer in self.peer_holders(step) if is_up(peer))
        if not step.file_holders and step.manifest.files:  # every file has the step's holders
            return int(step.resident.issuperset(step.manifest.names)) + step_peers
        return min((int(e.name in step.resident)
                    + (step_peers if e.name not in step.file_holders else
                       sum(1 for peer in self.file_peers(step, e.name) if is_up(peer)))
                    for e in step.manifest.files), default=0)

    def tiers(self, step: StepState, in_ram: bool, name: str | None = None) -> str:
        """`user.tierfs.tiers`: of one file (`name`) or of the whole step."""
        tiers = ["ram"] if in_ram else []
        peers = self.full_holders(step) if name is None else sorted(self.file_peers(step, name))
        tiers += [f"peer:{peer}" for peer in peers]
        if step.persisted:
            tiers.append("persist")
        return ",".join(tiers)
