"""Where copies of a file belong: pure functions over the ring of live members.

The ring is the sorted node ids of the live members. A file written by node X belongs on X and
on the next K live nodes after X's place on the ring (its K replica targets): K + 1 copies in
all, the writer's own first. When nodes go, the same rule on the ring of the survivors says
where new copies go: `restore_plan` lists the copies that bring each file back to K + 1 live
copies, each from one live holder chosen by the same rule, so every node can compute the whole
plan from the same inputs and carry out only its own part, with no coordination and no copy
made twice. Only missing copies are made: a node joining moves nothing.

Every file below K + 1 live copies gets copies, whatever made it short (a holder died, came
back without its copies, or found one bad). Eviction never makes a file short: a node lets its
copy go only while K + 1 other live nodes hold it (`commit_records.CommitRecords.leave_files`),
or once the store holds the file. A node that let its copy go on the store's strength is
listed among those that `left`: each such live node lowers the copies the file wants by one
(the store is a copy), and a node that left is never a target (there are always enough live
nodes that did not leave: see `restore_plan`), so no copy goes back to the node that just
evicted it (no ping-pong between eviction and restore).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def ring(members: Iterable[str]) -> list[str]:
    """The ring: live member ids, sorted and distinct."""
    return sorted(set(members))


def clockwise(ring_ids: list[str], start: str) -> list[str]:
    """Every id on the ring, starting at `start` if it is there, else at the first id after the
    place `start` would have; each once."""
    index = bisect.bisect_left(ring_ids, start)
    return ring_ids[index:] + ring_ids[:index]


def desired_holders(ring_ids: list[str], writer: str, replicas: int) -> list[str]:
    """The K + 1 nodes that should hold a file written by `writer`: the first live nodes from
    the writer's place on the ring (the writer itself first while it is live)."""
    return clockwise(ring_ids, writer)[:replicas + 1]


def replica_targets(ring_ids: list[str], writer: str, replicas: int) -> list[str]:
    """The writer's K replica targets: the next K live nodes after it on the ring (fewer when
    the ring is smaller); never the writer."""
    after = [node for node in clockwise(ring_ids, writer) if node != writer]
    return after[:replicas]


@dataclass(frozen=True)
class Copy:
    """Copy `file` from `source` (a live holder) to `target` (a live node that should hold it)."""

    file: str
    source: str
    target: str


@dataclass(frozen=True)
class Placement:
    """Where a file was written, who holds a verified copy of it now, and who let its copy
    go deliberately (`left`: evicted, not lost)."""

    writer: str
    holders: frozenset[str]
    left: frozenset[str] = frozenset()


@dataclass
class RestorePlan:
    copies: list[Copy]
    lost: list[str]  # files with no live holder: only the persistent tier can restore them

    def for_source(self, node: str) -> list[Copy]:
        """The copies `node` is responsible for sending."""
        return [copy for copy in self.copies if copy.source == node]


def restore_plan(files: Mapping[str, Placement], ring_ids: list[str],
                 replicas: int, avoid: frozenset[str] = frozenset()) -> RestorePlan:
    """The copies that bring every file back to K + 1 live copies (fewer if fewer nodes live),
    less one for each live node that let its copy go because the store holds the file
    (`Placement.left`).

    A file wants min(K + 1, ring size) - |left live| live holders. Counting only the live
    leavers keeps the count within reach: the missing copies are at most
    |ring| - |left live| - |live holders|, exactly the live nodes that neither hold the file
    nor left it, so a node that left is never chosen as a target (it would evict the copy
    again). A dead leaver lowers nothing: its copy was gone anyway, and the ring without it
    may want one more.

    Only missing copies are made: a file that still has the copies it wants stays where it
    is, so a node joining the ring moves no data. A missing copy goes to the first live nodes
    clockwise from the writer's place that do not hold the file and did not leave it (its
    desired holders first). Its source is the first live holder clockwise from there (the
    writer itself while it holds it). The plan is therefore the same on every node that
    computes it.
    Holders beyond the count are left alone: dropping them is retention's decision, made only
    once the new copies are verified.

    `avoid`: nodes that take no copy now (one refused a copy for want of room): the next
    node clockwise takes it instead (the same on every node that knows of the refusal; a
    file has one source, so it is copied once whatever the others know), and a file short
    of targets gets fewer copies for now.
    """
    live = set(ring_ids)
    copies: list[Copy] = []
    lost: list[str] = []
    for name in sorted(files):
        placement = files[name]
        live_holders = placement.holders & live
        if not live_holders:
            lost.append(name)
            continue
        left = (placement.left - placement.holders) & live
        missing = min(replicas + 1, len(ring_ids)) - len(left) - len(live_holders)
        if missing <= 0:
            continue
        order = clockwise(ring_ids, placement.writer)
        source = next(node for node in order if node in live_holders)
        # never short: `missing` is at most the number of these (see above)
        targets = [node for node in order if node not in live_holders and node not in left
                   and node not in avoid][:missing]
        copies.extend(Copy(name, source, target) for target in targets)
    return RestorePlan(copies, lost)
