"""Sending copies of committed files to the nodes that should hold them, per file, driven by the
cluster's file records in etcd (`/<prefix>/steps/<step>/files/<path>`: writer and holders). For
a committed step this node holds files of, it reads the step's records and computes
`placement.restore_plan` over the files held here and the ring of live members: for a fresh
commit that is "writer -> its next K live nodes", after a loss the copies that bring each file
back to K + 1 live holders (less the nodes that let their copy go once the store held it: the
records list only real holders, `commit_records`). Every node computes the same plan from the
same records, so each copy is made once, by its planned source; this node carries out the
copies it is the source of, grouped by target, in parallel across targets.

To a target, the files' chunks go from the RAM store's immutable committed objects over the
directory's `connections` connections at once (`--peer-connections`): whole files to each
where they spread evenly, so that each file's chunks arrive in order and are hashed by the
receiver as they are written, else dealt out in turn (`deal`); each connection is driven by a
worker thread of its own (`sendfile`, the chunks' tags, channel.WINDOW PUTs ahead of the
peer's OKs, which are the backpressure), and small files (SMALL_FILE bytes at most) go many to a
PUT_FILES, read into one payload (one by one, as PUTs, to a peer that closed the connection at
one: an older version). Then HOLD names them (at most MAX_NAMES per message); the target
answers HELD with those it now holds, verified. Only then
are they counted: the target is added to their records in etcd (batched transactions) and to
this node's view. Only steps whose commit record is in etcd are replicated (the target asks
etcd about a version it does not know). Failures retry while the step is still the current
version; a step that keeps failing (etcd does not know it yet, a target refuses it) waits aside
and is tried again a few seconds later, without holding up the other steps.

A target that refuses a copy for want of room (NO_ROOM: its RAM tier, or its RAM dir's file
system, is full) takes no copy from this node for NO_ROOM_PAUSE seconds: the plan is made
again at once without it, so the copy goes to the next node on the ring; a step that no other
node can take waits aside and is tried again (`troubles` says why it is short of copies, for
`tierfs status`).

A tracker file (`tierfs.trackers`) goes to a peer only once the step it names is safe
(`may_copy`: in the store, held whole by that peer, or every file at K + 1 verified copies on
live nodes, as a multi-node save's files are without any node holding them all): until then its
copies wait, and are planned again each time another step's copies are done here, and every
RETRY_LATER seconds after the step it names is planned again (its records read anew: the
copies other nodes made of their files count).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator

import trio

from tierfs import manifest as mf
from tierfs.observe import Events
from tierfs.replication.coordination import placement
from tierfs.replication.coordination.commit_records import FileRecord
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import (
    WINDOW,
    BlockingChannel,
    ConnectionClosed,
    ConnectionLost,
    NoRoom,
)
from tierfs.replication.peers.directory import PeerDirectory
from tierfs.retry import POLICY
from tierfs.step_queue import StepQueue

log = logging.getLogger(__name__)

# The one retry policy, pausing at most RETRY_DELAY: a membership change (a peer back, a new
# node) ends the pause at once anyway, and each failure is logged by _send_to.
RETRY_DELAY = 2.0
RETRIES = POLICY.capped(RETRY_DELAY)
TRIES_BEFORE_ASIDE = 5  # failed rounds of a step before it waits aside for RETRY_LATER
RETRY_LATER = 5.0  # seconds between tries of the steps waiting aside
NO_ROOM_PAUSE = 30.0  # seconds a target that had no room for a copy is not sent another
# Whole files go to a connection each when no connection gets more than this times its even
# share of the bytes (`deal`).
BALANCE = 1.25
# Files of at most SMALL_FILE bytes go many to a message (PUT_FILES), SMALL_BATCH bytes at most
# each: a step of 10,000 small files cost the receiver a frame read, a reply and their
# Python per file, about 330 us (ad hoc, 4 KiB files, two nodes on 2 cores).
SMALL_FILE = 64 << 10
SMALL_BATCH = 1 << 20
# Seconds a target that closed the connection at its first PUT_FILES (a daemon of an older
# version, which does not know it) is sent small files one by one, before it is tried again.
ONE_BY_ONE = 600.0

Placements = Callable[[mf.StepManifest], Awaitable[dict[str, FileRecord] | None]]
# Count a target as holding files it verified; whether etcd recorded every one.
Recorded = Callable[[mf.StepManifest, str, list[str]], Awaitable[bool]]


class Replicator:
    def __init__(
        self,
        directory: PeerDirectory,
        replicas: int,
        object_path: Callable[[str], str],
        *,
        is_current: Callable[[mf.StepManifest], bool],
        placements: Placements,
        on_placements: Callable[[mf.StepManifest, dict[str, set[str]], dict[str, str]], None],
        on_held: Recorded,
        may_copy: Callable[[mf.StepManifest, str, int, Callable[[str], bool]], bool]
        = lambda _m, _peer, _wanted, _up: True,
        named_step: Callable[[mf.StepManifest], mf.StepManifest | None] = lambda _m: None,
        events: Events,
    ) -> None:
        self.directory = directory
        self._events = events
        self.replicas = replicas
        self._object_path = object_path
        self._is_current = is_current
        self._placements = placements
        self._on_placements = on_placements
        self._on_held = on_held
        self._may_copy = may_copy
        self._named_step = named_step
        self.queue = StepQueue()
        self._later: dict[str, mf.StepManifest] = {}  # steps that kept failing: tried again
        self._waiting: dict[str, mf.StepManifest] = {}  # trackers waiting for a peer's copies
        self._no_room: dict[str, tuple[float, str]] = {}  # target -> (trio time until, why)
        self._one_by_one: dict[str, float] = {}  # target -> trio time until (ONE_BY_ONE)
        self._refusals = 0  # NO_ROOM answers so far
        # step path -> (why it is short of the copies this node owes, since when, wall ns)
        self.troubles: dict[str, tuple[str, int]] = {}

    def submit(self, manifest: mf.StepManifest) -> None:
        if self.replicas > 0:
            self.queue.put(manifest)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._retry_later)
            await self.queue.serve(self._replicate_or_log)

    async def _retry_later(self) -> None:
        while True:
            await trio.sleep(RETRY_LATER)
            waiting, self._later = self._later, {}
            for manifest in waiting.values():
                self.submit(manifest)
            self._plan_named_steps_again()

    async def _replicate_or_log(self, manifest: mf.StepManifest) -> None:
        try:
            await self._replicate(manifest)
        except Exception:  # never let one step stop the replicator
            log.exception("replication of %s failed", manifest.path)

    async def _replicate(self, manifest: mf.StepManifest) -> None:
        """Make the copies this node owes until there are none left or the step is no longer
        the current version here."""
        failures = 0
        while self._is_current(manifest):
            # None: not committed in etcd (yet), or etcd does not answer
            copies = await self._plan(manifest)
            if copies is not None:
                copies = self._not_waiting(manifest, copies)
            if copies is not None and not copies:
                if manifest.path in self.troubles:  # short for want of room: tried later
                    self._later[manifest.path] = manifest
                    return
                if manifest.path not in self._waiting:
                    self._plan_waiting_again()  # this step's copies are done
                return
            refusals = self._refusals
            if copies is not None and await self._send_copies(manifest, copies):
                failures = 0
                continue  # the records changed: check whether more copies are due
            if self._refusals != refusals:
                continue  # a target had no room: planned again at once without it
            failures += 1
            if failures >= TRIES_BEFORE_ASIDE:  # the other steps' copies go first
                self._later[manifest.path] = manifest
                return
            await RETRIES.pause(failures, wake=self.directory.changed)
        self.troubles.pop(manifest.path, None)  # no longer the step's version here

    def _not_waiting(self, manifest: mf.StepManifest,
                     copies: list[placement.Copy]) -> list[placement.Copy]:
        """The copies that may go now; a tracker's copies wait while the step it names is not
        safe (`may_copy`)."""
        wanted = placement.copies_wanted(self.replicas, len(self.directory.live.ring))
        ready = [copy for copy in copies
                 if self._may_copy(manifest, copy.target, wanted, self.directory.is_up)]
        if len(ready) < len(copies):
            self._waiting[manifest.path] = manifest
        else:
            self._waiting.pop(manifest.path, None)
        return ready

    def _plan_named_steps_again(self) -> None:
        """The steps the waiting trackers name are planned again: each plan reads the step's
        records anew, and one that owes no copy from here plans the trackers again."""
        self._submit_for_waiting(self._named_step)

    def _plan_waiting_again(self) -> None:
        self._submit_for_waiting(lambda tracker: tracker)

    def _submit_for_waiting(self, pick: Callable[[mf.StepManifest], mf.StepManifest | None]
                            ) -> None:
        """What `pick` gives for each waiting tracker still current here, submitted; the
        others stop waiting."""
        for path, manifest in list(self._waiting.items()):
            if not self._is_current(manifest):
                del self._waiting[path]
            elif (step := pick(manifest)) is not None:
                self.submit(step)

    async def _plan(self, manifest: mf.StepManifest) -> list[placement.Copy] | None:
        """The copies this node is the source of, from the step's records now."""
        records = await self._placements(manifest)
        if records is None:
            return None
        self._on_placements(manifest, {name: set(r.holders) for name, r in records.items()},
                            {name: r.node for name, r in records.items()})
        here = {name: placement.Placement(r.node, frozenset(r.holders), frozenset(r.left))
                for name, r in records.items()
                if os.path.exists(self._object_path(r.xxh3))}
        live, me = self.directory.live, self.directory.me
        ring, domains = live.ring, live.domains
        full = self._full_targets()
        copies = placement.restore_plan(here, ring, self.replicas, domains, full).for_source(me)
        wanted = placement.restore_plan(here, ring, self.replicas, domains).for_source(me) \
            if full else copies
        if len(copies) < len(wanted):  # some copy has no target with room now
            refused = sorted({c.target for c in wanted} & full)
            self._note_trouble(manifest, "; ".join(self._no_room[t][1] for t in refused)
                               + ": no other live node can take its copies")
        elif manifest.path in self.troubles and not copies:
            del self.troubles[manifest.path]  # every copy it owes is made
        return copies

    def _full_targets(self) -> frozenset[str]:
        """The targets that had no room for a copy less than NO_ROOM_PAUSE ago."""
        now = trio.current_time()
        for target, (until, _why) in list(self._no_room.items()):
            if until <= now:
                del self._no_room[target]
        return frozenset(self._no_room)

    def _note_trouble(self, manifest: mf.StepManifest, why: str) -> None:
        known = self.troubles.get(manifest.path)
        self.troubles[manifest.path] = (why, known[1] if known else time.time_ns())

    def trouble(self, path: str) -> dict[str, object] | None:
        """Why the step at `path` is short of copies this node owes, and since when (ns);
        None when it is not (as far as this node's last try knows)."""
        known = self.troubles.get(path)
        return None if known is None else {"reason": known[0], "since_ns": known[1]}

    async def _send_copies(self, manifest: mf.StepManifest,
                           copies: list[placement.Copy]) -> bool:
        """Send each target its files, all targets at once; whether every copy was made."""
        by_target: dict[str, list[str]] = {}
        for copy in copies:
            by_target.setdefault(copy.target, []).append(copy.file)
        results: list[bool] = []

        async def send(target: str, names: list[str]) -> None:
            results.append(await self._send_to(manifest, target, names))

        async with trio.open_nursery() as nursery:
            for target, names in sorted(by_target.items()):
                nursery.start_soon(send, target, names)
        return all(results)

    async def _send_to(self, manifest: mf.StepManifest, target: str, names: list[str]) -> bool:
        started = time.monotonic()
        held: list[str] = []
        error: BaseException | None = None
        try:
            for batch in proto.name_batches(names, str):
                entries = [entry for name in batch if (entry := manifest.entry(name)) is not None]
                await self._send_files(target, manifest.path, entries)
                async with self.directory.channel(target) as channel:
                    reply = await channel.request("HOLD", path=manifest.path,
                                                  version=manifest.version, names=batch,
                                                  expect="HELD")
                sent = set(batch)
                held += [n for n in reply["names"] if isinstance(n, str) and n in sent]
        except NoRoom as exc:  # the copies go to another node meanwhile
            error = exc
            self._refusals += 1
            self._no_room[target] = (trio.current_time() + NO_ROOM_PAUSE, str(exc))
        except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
            error = exc
        recorded = not held or await self._on_held(manifest, target, held)
        if error is not None or len(held) < len(names) or not recorded:
            why = str(error or ("not all held there" if len(held) < len(names)
                                else "etcd did not record the copies"))
            log.warning("replication of %d files of %s v%d to %s failed, %s: %s",
                        len(names) - len(held), manifest.path, manifest.version, target,
                        f"its copies go to another node for {NO_ROOM_PAUSE:.0f} s"
                        if isinstance(error, NoRoom) else "will retry", why)
            self._note_trouble(manifest, f"copies to {target} failed: {why}")
            return False
        sent = sum(entry.size for name in names if (entry := manifest.entry(name)) is not None)
        self._events.replicated(manifest, target, sent, time.monotonic() - started)
        return True

    async def _send_files(self, target: str, step_path: str,
                          entries: list[mf.FileEntry]) -> None:
        """The files' chunks as PUTs to `target`, over as many pooled connections at once as
        the directory says (each driven by a worker thread, `_put_chunks`), dealt out by
        `deal`. The first failure raises (the other connections stop)."""
        shares = deal(entries, self.directory.connections)
        failures: list[BaseException] = []
        batches = self._one_by_one.get(target, 0.0) <= trio.current_time()

        async def lane(share: list[tuple[mf.FileEntry, int]], scope: trio.CancelScope) -> None:
            try:
                async with self.directory.channel(target) as channel:
                    await channel.in_thread(_put_chunks, share, step_path, self._object_path,
                                            batches)
            except (OSError, proto.ProtocolError, trio.TooSlowError) as exc:
                if isinstance(exc, BatchesRefused):
                    self._send_one_by_one(target)
                failures.append(exc)
                scope.cancel()

        async with trio.open_nursery() as nursery:
            for share in shares:
                nursery.start_soon(lane, share, nursery.cancel_scope)
        if failures:
            raise failures[0]

    def _send_one_by_one(self, target: str) -> None:
        """`target` closed the connection at small files sent many at once: they go to it one
        by one for ONE_BY_ONE seconds (said the first time)."""
        if target not in self._one_by_one:
            log.warning("%s closed the connection at small files sent many at once (a daemon "
                        "of an older version?): they go one by one there for %.0f s", target,
                        ONE_BY_ONE)
        self._one_by_one[target] = trio.current_time() + ONE_BY_ONE


def _chunks(entry: mf.FileEntry) -> list[tuple[mf.FileEntry, int]]:
    return [(entry, offset) for offset in range(0, max(entry.size, 1), mf.CHUNK_SIZE)]


def deal(entries: list[mf.FileEntry], connections: int
         ) -> list[list[tuple[mf.FileEntry, int]]]:
    """The files' chunks (entry, offset) dealt out to at most `connections` connections, each
    connection's in the order it sends them. Whole files to a connection, each file's chunks
    in order, when the files can be spread so that no connection carries more than
    BALANCE x its even share (largest first, each to the least loaded): the receiver then
    hashes every chunk from the bytes it just wrote, in its CPU's cache. Otherwise (one large
    file, or a few unequal ones) chunk i goes over connection i mod n, so that one file still
    uses every connection; chunks ahead of their file's order are read back once for its hash
    (`tierfs.whole_hash`)."""
    chunks = [chunk for entry in entries for chunk in _chunks(entry)]
    lanes = max(1, min(connections, len(chunks)))
    if lanes == 1:
        return [chunks]
    loads = [0] * lanes
    owner: dict[int, int] = {}  # index in entries -> lane
    for index in sorted(range(len(entries)), key=lambda i: -entries[i].size):
        lane = loads.index(min(loads))
        owner[index] = lane
        loads[lane] += max(entries[index].size, 1)
    if max(loads) <= BALANCE * sum(loads) / lanes:
        shares: list[list[tuple[mf.FileEntry, int]]] = [[] for _ in range(lanes)]
        for index, entry in enumerate(entries):  # in the step's order on each connection
            shares[owner[index]] += _chunks(entry)
        return [share for share in shares if share]
    return [chunks[i::lanes] for i in range(lanes)]


class BatchesRefused(ConnectionClosed):
    """The connection ended while a PUT_FILES was unanswered and none was answered on it
    before: most likely a daemon of an older version, which does not know the message."""


def _put_chunks(io: BlockingChannel, chunks: list[tuple[mf.FileEntry, int]], step_path: str,
                object_path: Callable[[str], str], batches: bool = True) -> None:
    """In a worker thread, on a channel lent to it (`PeerChannel.in_thread`): each chunk as a
    PUT sent from its object by the kernel (`sendfile`), and the small files among them many
    to a PUT_FILES (`_small_batches`, if `batches`), WINDOW messages ahead of the peer's OKs.
    A file's descriptor is closed after its last chunk here: a step of many small files kept
    every file of the connection's share open until the end, past the open-file limit a
    service usually gets (1,024: EMFILE, and the copies were never made)."""
    last = {entry.xxh3: index for index, (entry, _offset) in enumerate(chunks)}
    fds: dict[str, int] = {}
    unanswered: collections.deque[bool] = collections.deque()  # each: a PUT_FILES
    batch_answered = False

    def answer() -> None:
        nonlocal batch_answered
        io.receive("OK")
        batch_answered |= unanswered.popleft()

    try:
        for item in _small_batches(chunks) if batches else enumerate(chunks):
            if isinstance(item, list):
                _put_files(io, item, step_path, object_path)
            else:
                index, (entry, offset) = item
                fd = fds.get(entry.xxh3)
                if fd is None:
                    fd = fds[entry.xxh3] = os.open(object_path(entry.xxh3), os.O_RDONLY)
                io.send_file("PUT", fd, offset, min(mf.CHUNK_SIZE, entry.size - offset),
                             path=step_path, name=entry.name, xxh3=entry.xxh3,
                             size=entry.size, offset=offset)
                if last[entry.xxh3] == index:
                    os.close(fds.pop(entry.xxh3))
            unanswered.append(isinstance(item, list))
            if len(unanswered) == WINDOW:
                answer()
        while unanswered:
            answer()
    except (ConnectionClosed, ConnectionLost) as exc:
        if any(unanswered) and not batch_answered:
            raise BatchesRefused(f"{exc} at small files sent many at once") from None
        raise
    finally:
        for fd in fds.values():
            os.close(fd)


def _small_batches(chunks: list[tuple[mf.FileEntry, int]]
                   ) -> Iterator[list[mf.FileEntry] | tuple[int, tuple[mf.FileEntry, int]]]:
    """The chunks in their order, each (its index, itself), but files of at most SMALL_FILE
    bytes gathered into lists, each one PUT_FILES: at most SMALL_BATCH bytes, MAX_NAMES
    names and MAX_NAME_BYTES of names. A step of many small files costs the receiver one
    message (one frame read, one answer, one hop to a thread) per batch instead of per file."""
    batch: list[mf.FileEntry] = []
    size = name_bytes = 0
    for index, (entry, offset) in enumerate(chunks):
        if entry.size > SMALL_FILE:
            yield index, (entry, offset)
            continue
        name = len(entry.name.encode())
        if batch and (size + entry.size > SMALL_BATCH or len(batch) == proto.MAX_NAMES
                      or name_bytes + name > proto.MAX_NAME_BYTES):
            yield batch
            batch, size, name_bytes = [], 0, 0
        batch.append(entry)
        size += entry.size
        name_bytes += name
    if batch:
        yield batch


def _put_files(io: BlockingChannel, entries: list[mf.FileEntry], step_path: str,
               object_path: Callable[[str], str]) -> None:
    """Small whole files as one PUT_FILES, read from their objects (a ProtocolError if one
    is shorter than its entry: never a payload that says otherwise)."""
    parts = []
    for entry in entries:
        fd = os.open(object_path(entry.xxh3), os.O_RDONLY)
        try:
            data = os.pread(fd, entry.size, 0)
        finally:
            os.close(fd)
        if len(data) != entry.size:
            raise proto.ProtocolError(f"{entry.name}: its object is shorter than its entry")
        parts.append(data)
    io.send("PUT_FILES", b"".join(parts), path=step_path,
            names=[entry.name for entry in entries],
            digests=[entry.xxh3 for entry in entries], sizes=[entry.size for entry in entries])
