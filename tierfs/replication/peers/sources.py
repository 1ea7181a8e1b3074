"""Where a reader fetches each chunk of a file from: the one decision, pure (no I/O, no
clock of its own), used by the daemon (`peer_reader`) and by `bench/simulate_cluster.py`.

After a data-parallel restart every node reads the same file at once. Read only from its
holders (the writer and its K replica targets), the file would leave those few uplinks once
per reader: 2,000 readers of 20 GB is 40 TB through two or three NICs. Instead the holders
hand chunks out as a swarm does, but planned by the holder rather than discovered by gossip:

* A reader asks one of the file's holders for a chunk (`holder_order`: the holders in an order
  that depends on the chunk, so the chunks of one file are spread over all of them).
* The holder's `ChunkRoutes` for the file remembers, per chunk, the readers it has already
  sent the chunk to, or sent to someone who had it. The first reader of a chunk gets the bytes
  from the holder; a later one is told to fetch it from one of those readers (a relay), which
  serves it from its own partial copy as soon as the chunk is in (it waits for a chunk still
  on its way). So the holder's uplink sends each chunk about once, whatever the number of
  readers, and every reader's uplink sends about as much as it receives.
* Relays are chosen to spread the load: at most FANOUT readers per chunk per relay; of the
  CHOICES earliest that may take one more, the one with the fewest chunks routed to it so
  far, the shallower one on a tie. Each chunk's
  relays form a tree rooted at the holder, a different tree for every chunk.
* A reader is only ever sent to a reader the holder saw before it (for the same chunk), so no
  two readers wait on each other. A relay that fails (dead, evicted, out of RAM) is named
  back by the reader (`avoid`); the holder drops it for that chunk and chooses again, and
  after MAX_HOPS failures, or when no relay is left, serves the chunk itself.

Why the holder decides, not the readers: the holder sees every first request for its chunks,
so it knows exactly who has (or is getting) each chunk, with no extra messages, no etcd writes
per chunk and no membership-wide state; a reader learns one address per chunk. The cost is
one small extra round trip for a routed chunk, and a holder's memory of one entry per
(chunk, reader) while a file is being read (forgotten STATE_TTL after its last request).

Copies a reader makes this way are read-back caches: evictable like any fetched file, never
counted as replicas (the records in etcd are not told about them).
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

FANOUT = 2  # readers one relay is given per chunk: a tree of depth ~log2(readers) per chunk
CHOICES = 4  # relays of a chunk weighed for each reader: the earliest that may take one more
MAX_HOPS = 3  # failed relays for one chunk before the reader asks the holder to serve it
STATE_TTL = 600.0  # seconds after a file's last request that its routes are forgotten
# Readers a holder gives a step's small files many at once (GET_FILES), within STATE_TTL of
# the step's last such request: beyond them (a data-parallel restart, every node reading the
# step), a reader gets none that way and reads them one by one through the swarm, which
# spreads them over the readers instead of sending each its own copy of them all.
FILES_READERS = 8


def holder_order(holders: Iterable[str], xxh3: str, offset: int,
                 is_up: Callable[[str], bool] = lambda _node: True) -> list[str]:
    """The holders of a file in the order a reader asks them for the chunk at `offset`:
    rotated by a hash of (file, offset), so that the chunks of one file, read by every node at
    once, are spread over all its holders; live ones first (a peer may be up before a
    heartbeat says so, so the others stay, last)."""
    ordered = list(holders)
    if not ordered:
        return []
    start = zlib.crc32(f"{xxh3}:{offset}".encode()) % len(ordered)
    rotated = ordered[start:] + ordered[:start]
    return sorted(rotated, key=lambda node: not is_up(node))


@dataclass
class _Chunk:
    """Who has (or is getting) one chunk: each reader's place in the order the holder saw
    them, how far from the holder it is, and how many readers it was given; `open`: readers
    in that order that may be given more (lazily pruned)."""

    place: dict[str, int] = field(default_factory=dict)
    depth: dict[str, int] = field(default_factory=dict)
    given: Counter[str] = field(default_factory=Counter)
    open: deque[str] = field(default_factory=deque)
    seen: int = 0

    def add(self, reader: str, depth: int) -> None:
        self.place[reader] = self.seen
        self.seen += 1
        self.depth[reader] = depth
        self.open.append(reader)

    def usable(self, node: str) -> bool:
        return node in self.place and self.given[node] < FANOUT

    def candidates(self, before: int | None) -> list[str]:
        """Up to CHOICES readers that may take one more, the earliest first (placed before
        `before`, if given)."""
        looked: list[str] = []  # taken off the front, put back (those still usable)
        found = []
        while self.open and len(found) < CHOICES and len(looked) < 4 * CHOICES:
            node = self.open.popleft()
            if not self.usable(node):
                continue  # full, or dropped: gone from the queue for good
            looked.append(node)
            if before is None or self.place[node] < before:
                found.append(node)
        self.open.extendleft(reversed(looked))
        return found


class ChunkRoutes:
    """One holder's plan for one file (see the module docstring). `route` answers each
    request: the holder itself (`me`: serve it) or the reader to fetch the chunk from."""

    def __init__(self, me: str) -> None:
        self.me = me
        self._chunks: dict[int, _Chunk] = {}
        self.load: Counter[str] = Counter()  # chunks routed to each relay so far
        self.served = 0  # chunks the holder was told to serve itself
        self.last_used = 0.0  # the caller's clock: when a request last came

    def route(self, reader: str, chunk: int, avoid: Iterable[str] = ()) -> str:
        """Where `reader` gets chunk `chunk`: `me`, or a reader that has it or is getting it.
        `avoid`: relays that failed this reader for this chunk (dropped from the chunk)."""
        state = self._chunks.setdefault(chunk, _Chunk())
        for failed in avoid:
            if failed != reader and state.place.pop(failed, None) is not None:
                del state.depth[failed]
        # only readers seen before this one: nobody waits on a reader that waits on it
        before = state.place.get(reader)
        candidates = state.candidates(before)
        if not candidates:
            if before is None:
                state.add(reader, 1)
            self.served += 1
            return self.me
        relay = min(candidates, key=lambda node: (self.load[node], state.depth[node]))
        state.given[relay] += 1
        self.load[relay] += 1
        if before is None:
            state.add(reader, state.depth[relay] + 1)
        return relay


class RouteBook:
    """A holder's `ChunkRoutes`, one per file being read (by content hash), forgotten
    STATE_TTL after their last request (`now` is the caller's clock)."""

    def __init__(self, me: str, ttl: float = STATE_TTL) -> None:
        self.me = me
        self.ttl = ttl
        self._files: dict[str, ChunkRoutes] = {}

    def route(self, xxh3: str, reader: str, chunk: int, avoid: Iterable[str], now: float
              ) -> str:
        for key, routes in list(self._files.items()):
            if now - routes.last_used > self.ttl:
                del self._files[key]
        routes = self._files.get(xxh3)
        if routes is None:
            routes = self._files[xxh3] = ChunkRoutes(self.me)
        routes.last_used = now
        return routes.route(reader, chunk, avoid)

    def relayed(self) -> int:
        """Chunks of the files being read that readers fetched from other readers."""
        return sum(sum(routes.load.values()) for routes in self._files.values())


class StepReaders:
    """The readers a holder gave a step's small files many at once (GET_FILES), forgotten
    STATE_TTL after the step's last such request: at most FILES_READERS per step."""

    def __init__(self, ttl: float = STATE_TTL, most: int = FILES_READERS) -> None:
        self.ttl = ttl
        self.most = most
        self._steps: dict[str, tuple[set[str], float]] = {}

    def admit(self, step_path: str, reader: str, now: float) -> bool:
        """Whether `reader` gets the step's small files at once (it did before, or there is
        room for one more)."""
        for step, (_readers, last) in list(self._steps.items()):
            if now - last > self.ttl:
                del self._steps[step]
        readers = self._steps.get(step_path, (set(), now))[0]
        admitted = reader in readers or len(readers) < self.most
        if admitted:
            readers.add(reader)
        self._steps[step_path] = (readers, now)  # asked now, admitted or not
        return admitted
