"""Where copies of a file belong: pure functions over the ring of live members.

The ring is the live member ids in a fixed order: sorted, and with failure domains
(`--failure-domain`: a rack, a switch, a zone) interleaved, one node of each domain in turn
(domains by name, nodes by id within each), so that a node's next on the ring is as a rule in
another domain and every node gets about as many copies as it sends (a rack replicating to
its neighbour rack, node by node: NVIDIA's resiliency extension's replication jump does the
same). A node without a domain is a domain of its own; with no domains at all the ring is the
sorted ids.

A file written by node X belongs on X and on K more nodes (its replica targets): the next live
nodes after X's place on the ring, each one from a domain that holds no copy yet while there is
such a domain (then clockwise again). K + 1 copies in all, the writer's own first, spread over
as many domains as there are, up to K + 1: a whole domain lost (cut off or burnt) leaves every
file a copy in another one. When nodes go, the same rule on the ring of the survivors says
where new copies go: `restore_plan` lists the copies that bring each file back to K + 1 live
copies (to the domains its live copies are not in first), each from one live holder chosen by
the same rule, so every node can compute the whole plan from the same inputs and carry out only
its own part, with no coordination and no copy made twice. Only missing copies are made: a
node joining moves nothing.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def _domain(node: str, domains: Mapping[str, str] | None) -> str:
    """The node's failure domain; a node without one is a domain of its own (a NUL cannot be
    part of a domain's name)."""
    found = domains.get(node) if domains else None
    return found if found is not None else "\0" + node


def ring(members: Iterable[str], domains: Mapping[str, str] | None = None) -> list[str]:
    """The ring: live member ids, distinct, sorted; with failure domains, the domains
    interleaved (one node of each in turn)."""
    ids = sorted(set(members))
    if not domains:
        return ids
    groups: dict[str, list[str]] = {}
    for node in ids:
        groups.setdefault(_domain(node, domains), []).append(node)
    ordered = [groups[name] for name in sorted(groups)]
    return [group[i] for i in range(max(map(len, ordered))) for group in ordered
            if i < len(group)]


def _start(ring_ids: list[str], start: str, index: Mapping[str, int] | None = None) -> int:
    """Where `start` is on the ring; for an id not on it (a writer that is not live), the
    place of the next id after it in sorted order (wrapping): the same on every node."""
    if index is not None:
        found = index.get(start)
        if found is not None:
            return found
    elif start in ring_ids:
        return ring_ids.index(start)
    after = [node for node in ring_ids if node > start]
    first = min(after) if after else min(ring_ids, default=None)
    if first is None:
        return 0
    return index[first] if index is not None else ring_ids.index(first)


def clockwise(ring_ids: list[str], start: str, index: Mapping[str, int] | None = None
              ) -> list[str]:
    """Every id on the ring, starting at `start` if it is there, else at the place it would
    have (see `_start`); each once. `index`: each id's place, when the caller has it."""
    at = _start(ring_ids, start, index)
    return ring_ids[at:] + ring_ids[:at]


def _spread(order: list[str], count: int, covered: set[str],
            domains: Mapping[str, str] | None) -> list[str]:
    """Up to `count` nodes of `order`, taken in order, each from a domain not `covered` yet
    (by copies there already, or taken before it) while `order` has one."""
    picked: list[str] = []
    covered = set(covered)
    rest = list(order)
    while rest and len(picked) < count:
        node = next((n for n in rest if _domain(n, domains) not in covered), rest[0])
        picked.append(node)
        rest.remove(node)
        covered.add(_domain(node, domains))
    return picked


def desired_holders(ring_ids: list[str], writer: str, replicas: int,
                    domains: Mapping[str, str] | None = None) -> list[str]:
    """The K + 1 nodes that should hold a file written by `writer`: the writer itself first
    while it is live, then its replica targets (from the writer's place on the ring)."""
    order = clockwise(ring_ids, writer)
    if order and order[0] == writer:
        return [writer, *_spread(order[1:], replicas, {_domain(writer, domains)}, domains)]
    return _spread(order, replicas + 1, set(), domains)


def replica_targets(ring_ids: list[str], writer: str, replicas: int,
                    domains: Mapping[str, str] | None = None) -> list[str]:
    """The writer's K replica targets: the next K live nodes after it on the ring, each from
    another domain than the writer's and the targets' before it while there are such (fewer
    targets when the ring is smaller); never the writer."""
    after = [node for node in clockwise(ring_ids, writer) if node != writer]
    return _spread(after, replicas, {_domain(writer, domains)}, domains)


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
                 replicas: int, domains: Mapping[str, str] | None = None,
                 avoid: frozenset[str] = frozenset()) -> RestorePlan:
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
    clockwise from the writer's place (a writer that is gone, with failure domains: its first
    live holder's, by id) that do not hold the file and did not leave it, each
    from a failure domain that holds no live copy yet while there is one (`_spread`: a fresh
    file's copies go to its replica targets). Its source is the first live holder clockwise
    from there (the writer itself while it holds it). The plan is therefore the same on every
    node that computes it.
    Holders beyond the count are left alone: dropping them is retention's decision, made only
    once the new copies are verified.

    `avoid`: nodes that take no copy now (one refused a copy for want of room): the next
    node clockwise takes it instead (the same on every node that knows of the refusal; a
    file has one source, so it is copied once whatever the others know), and a file short
    of targets gets fewer copies for now.
    """
    live = set(ring_ids)
    index = {node: i for i, node in enumerate(ring_ids)}
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
        # From the writer's place, also for a writer that is gone (the place it would have:
        # a replacement node with the next id takes its copies); with failure domains, a
        # writer that is gone: from its first live holder's (from the writer's place, the
        # files of a rack lost whole would all start at one node, and their copies would all
        # go to its next ones).
        start = placement.writer if placement.writer in index or not domains \
            else min(live_holders)
        order = clockwise(ring_ids, start, index)
        source = next(node for node in order if node in live_holders)
        # never short but for `avoid`: `missing` is at most the number of the others
        targets = _spread([node for node in order
                           if node not in live_holders and node not in left
                           and node not in avoid], missing,
                          {_domain(node, domains) for node in live_holders}, domains)
        copies.extend(Copy(name, source, target) for target in targets)
    return RestorePlan(copies, lost)
