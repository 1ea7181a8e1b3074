"""The cluster-wide side of commits, on etcd (`coordination.commit_records`): no shard moves.

With DCP every rank writes its shard into the same step path on its own node's mount, and only
rank 0's node sees `.metadata`. Each node records in etcd every file of a step it seals (its
whole manifest entry). The node that gets `.metadata` learns from it which files the step
has, waits until a record exists for every one it does not hold (`collect`, with a deadline),
lists them as held elsewhere (their bytes stay on the nodes that wrote them), commits, and
then writes the step's commit record (`publish`) before `.metadata`'s close returns.

Every node follows the commit records (`follow`): each commit of another node reaches it as
one watch event, which names the version, the committer and every node holding some file of
it. The step's manifest comes on demand from a peer that lists that version (the committer
first, then other holders: `peer_manifest`, in chunks), not from etcd's per-file records; only
if no such peer answers does the node read those records (the old way). A re-save of the step
rewrites those records before its commit, so what they make is taken only if it has the
content digest the commit record carries (never a manifest mixing two versions). A later
touch of the commit record (holders added) is taken from the event alone: nothing is fetched
again. A node asked about a step it still holds as `writing` asks etcd for the commit record
directly (`manifest_of`), so a load on any node right after the save's barrier finds the step
committed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import trio

from tierfs import manifest as mf
from tierfs.fs.model.ports import CoordinationUnavailable
from tierfs.replication.coordination.commit_records import (
    CommitEvent,
    CommitRecord,
    CommitRecords,
    CommitTimeout,
    Deletion,
    FileRecord,
)
from tierfs.replication.coordination.etcd import EtcdError, EtcdUnavailable, retry_unavailable

log = logging.getLogger(__name__)


PUBLISH_WAIT = 20.0  # seconds a commit record may take by default
# Seconds a commit waits for etcd to say which nodes write its step before it asks every peer
# (etcd slow or away: the saves go on, as their commits do while etcd is away).
WRITERS_WAIT = 1.0
WRITERS_POLL = 0.05  # seconds between reads while a commit waits for a step's writers
# Seconds the seals of a batch are gathered before it is written: a save of many small files
# seals one every ~0.5 ms, and one etcd request per file or two (each ~1 ms of the daemon's
# CPU in httpx) made such a save 2.5x slower on a cluster node than on a lone one. A
# multi-node commit waits for the other nodes' seals at most this much longer.
SEAL_GATHER = 0.02
# (manifest, the nodes holding its files): list the step here (OtherTiers.learn)
Learn = Callable[[mf.StepManifest, list[str]], None]
# (step path, version, CommitRecord.store): the persistent tier's state of that version
StoreState = Callable[[str, int, str], None]
StepNumber = Callable[[str], int | None]
# Whether this node holds a committed step's file with this content (`TreeView.holds_copy`).
HoldsCopy = Callable[[str, str, str], bool]
# (node, step path, version) -> that node's committed manifest of the step (peer_manifest);
# raises ManifestUnavailable, OSError or trio.TooSlowError when that node cannot give it
FetchManifest = Callable[[str, str, int], Awaitable[mf.StepManifest]]


class ManifestUnavailable(Exception):
    """The node asked for a step's manifest answered, but not with it (what a `FetchManifest`
    raises for a reply it cannot use, beside OSError and trio.TooSlowError)."""
# (step path, version) -> the manifest of that version if this node lists it committed
Known = Callable[[str, int], mf.StepManifest | None]
PEER_SOURCES = 3  # holders asked for a manifest before etcd's file records are read
# times a manifest is sought again for a newer commit of the step, found when the file records
# did not add up to the commit record read first (a re-save committed meanwhile)
MANIFEST_ROUNDS = 3


class ClusterCommits:
    """This node's side of the cluster's shard and commit records."""

    def __init__(self, records: CommitRecords, node_id: str, step_number: StepNumber,
                 fetch: FetchManifest | None = None, known: Known | None = None,
                 etcd_answers: Callable[[], bool] = lambda: True) -> None:
        self.records = records
        self._etcd_answers = etcd_answers  # False while this node's lease goes unanswered
        self.node_id = node_id
        self._step_number = step_number
        self._fetch = fetch
        self._known = known
        self.manifests_from_peers = 0  # manifests learned from a peer, not the file records
        # Seals waiting to be recorded (step -> name -> record): one writer at a time records
        # all that came meanwhile in a few transactions, not one request per file.
        self._unrecorded: dict[str, dict[str, FileRecord]] = {}
        self._recording = False
        self._batch_written = trio.Event()  # set when the batch being gathered is written
        # Steps whose seals are on their way to etcd now -> set when that request ends.
        self._on_the_wire: dict[str, trio.Event] = {}
        self._batches_taken = 0  # seal batches taken for writing so far, numbered from 1
        # Steps this node published while seals of them could still be waiting: the version
        # published and the last batch such a seal can be in. Those seals, of that save or an
        # earlier one, are not written after the commit (it wrote the records of its files
        # held here, and dropped the rest: a temp file renamed away).
        self._stale_seals: dict[str, tuple[int, int]] = {}
        # versions of steps this node commits in etcd whose watch event it has not seen yet
        self._published: dict[str, int] = {}
        # steps whose records this node is changing (a commit, a delete), one change at a
        # time in the order they came: a delete of an old version took the records of a new
        # one published meanwhile at the same path (a rename undone), and that commit took
        # the old version's holders
        self._changing: dict[str, trio.Lock] = {}

    @contextlib.asynccontextmanager
    async def _one_change(self, step_path: str) -> AsyncIterator[None]:
        lock = self._changing.setdefault(step_path, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if self._changing.get(step_path) is lock and not lock.locked() and \
                    not lock.statistics().tasks_waiting:
                del self._changing[step_path]

    # -- this node's files

    async def record_sealed(self, step_path: str, entries: list[mf.FileEntry],
                            base: int = 0) -> None:
        """Record files this node sealed into a step over its committed version `base` (0:
        none) (their writer and only holder: here); returns once they are written with
        others sealed meanwhile. While etcd is away they wait, retried until it answers."""
        self.queue_sealed(step_path, entries, base)
        await self.write_queued()

    def queue_sealed(self, step_path: str, entries: list[mf.FileEntry], base: int = 0) -> None:
        """`record_sealed` without waiting: these seals join the batch being gathered, written
        by the next `write_queued` (or one under way)."""
        self._unrecorded.setdefault(step_path, {}).update(
            (e.name, self._record(e, base)) for e in entries)

    async def note_writer(self, step_path: str, base: int) -> None:
        """This node writes files of a save of the step over its committed version `base`
        (0: none): recorded once etcd answers, retried while it is away."""
        try:
            await retry_unavailable(lambda: self.records.note_writer(step_path, self.node_id,
                                                                     base),
                                    f"recording that this node writes {step_path}")
        except EtcdError as exc:
            log.info("could not record in etcd that this node writes %s: %s", step_path, exc)

    async def other_writers(self, step_path: str, base: int, deadline: float,
                            previous: str | None = None) -> set[str] | None:
        """The other nodes that write files of the save of the step over `base`. With
        `previous` (the step saved before it beside it), first waits until every other node
        that wrote that one writes this one too (this save, or one before it: a node whose
        save another node committed first, the bytes written here later), until `deadline`
        (trio time): DeepSpeed's rank 0 writes its tracker without waiting for the other
        ranks, which may not have begun. None if etcd is known not to answer
        (`etcd_answers`), or does not answer within WRITERS_WAIT."""
        if not self._etcd_answers():
            return None
        try:
            with trio.fail_after(max(0.0, min(deadline - trio.current_time(), WRITERS_WAIT))):
                expected = set() if previous is None else \
                    set(await self.records.writers(previous)) - {self.node_id}
                bases = await self.records.writers(step_path)
        except (EtcdError, trio.TooSlowError) as exc:
            log.info("etcd did not say which nodes write %s: %s", step_path,
                     exc or "no answer in time")
            return None
        while not expected <= set(bases) and trio.current_time() < deadline:
            await trio.sleep(WRITERS_POLL)
            with contextlib.suppress(EtcdError):
                bases = await self.records.writers(step_path)
        if not expected <= set(bases):
            log.warning("%s: %s, which wrote %s, did not begin to write it by its commit's "
                        "deadline: committed without them", step_path,
                        ", ".join(sorted(expected - set(bases))), previous)
        return {node for node, over in bases.items() if over == base} - {self.node_id}

    @property
    def seals_queued(self) -> bool:
        return bool(self._unrecorded)

    async def write_queued(self) -> None:
        """Returns once the seals queued so far are written, with others queued meanwhile (one
        writer at a time: a second call waits for the batch being gathered)."""
        done = self._batch_written
        if self._recording:
            await done.wait()
            return
        self._recording = True
        try:
            while self._unrecorded:
                await trio.sleep(SEAL_GATHER)
                batch, self._unrecorded = self._unrecorded, {}
                self._batches_taken += 1
                done, self._batch_written = self._batch_written, trio.Event()
                try:
                    await self._record_batch(batch, self._batches_taken)
                finally:
                    done.set()
        finally:
            self._recording = False
            self._stale_seals = {step: mark for step, mark in self._stale_seals.items()
                                 if mark[1] > self._batches_taken}
            self._batch_written.set()  # cancelled with seals left: their callers are not stuck
            self._batch_written = trio.Event()

    async def _record_batch(self, batch: dict[str, dict[str, FileRecord]], number: int
                            ) -> None:
        """Written once etcd answers: the committer of a multi-node step waits for these
        records, and only this node can write them (seals meanwhile wait for the next batch)."""
        for step_path, records in batch.items():
            try:
                await retry_unavailable(
                    lambda s=step_path, r=records: self._write_seals(s, r, number),
                    f"recording {len(records)} sealed files of {step_path}")
            except EtcdError as exc:
                log.info("could not record %d sealed files of %s in etcd yet: %s",
                         len(records), step_path, exc)

    async def _write_seals(self, step_path: str, records: dict[str, FileRecord],
                           number: int) -> None:
        """One attempt at writing seals of batch `number`, but those a commit here has made
        stale since (`_stale_seals`; `_publish` waits for an attempt under way)."""
        mark = self._stale_seals.get(step_path)
        if mark is not None and number <= mark[1]:
            records = {n: r for n, r in records.items() if r.fresh_for(mark[0])}
        if not records:
            return
        done = self._on_the_wire[step_path] = trio.Event()
        try:
            await self.records.record_files(step_path, records)
        finally:
            done.set()
            if self._on_the_wire.get(step_path) is done:
                del self._on_the_wire[step_path]

    def _record(self, entry: mf.FileEntry, base: int | None) -> FileRecord:
        return FileRecord.sealed(self.node_id, entry.size, entry.xxh3,
                                 tuple(mf.entry_fields(entry)), base)

    async def collect(self, step_path: str, names: set[str], deadline: float,
                      base: int = 0) -> dict[str, tuple[str, mf.FileEntry]]:
        """Where the other nodes hold these files of a step saved over its committed version
        `base` (0: none): name -> (node id, entry), once every one is recorded by this save
        (a record of an earlier save of the step is not taken: `FileRecord.fresh_for`) or at
        `deadline` (trio time: then those recorded so far). `CoordinationUnavailable` if etcd
        does not answer by then."""
        try:
            found = await self.records.wait_for_files(
                step_path, names, deadline, lambda record: record.fresh_for(base))
        except CommitTimeout as exc:
            found = {n: r for n, r in exc.found.items() if n in names}
        except EtcdUnavailable as exc:
            raise CoordinationUnavailable(f"etcd does not answer ({exc})") from None
        except EtcdError as exc:
            log.info("commit of %s: etcd refused to read its records (%s); it waits",
                     step_path, exc)
            return {}
        located = {}
        for name, record in found.items():
            entry = _entry(name, record)
            if entry is not None and record.node != self.node_id:
                located[name] = (record.node, entry)
        return located

    # -- commits

    async def publish(self, manifest: mf.StepManifest, held_here: set[str],
                      deadline: float | None = None) -> None:
        """After this node committed `manifest`: record the files it holds, drop records of
        files the step no longer has, and write the commit record, so that every node lists
        the step. By `deadline` (trio time; PUBLISH_WAIT from now if None), or
        `CoordinationUnavailable`, also if etcd refuses it (the caller retries either way)."""
        if deadline is None:
            deadline = trio.current_time() + PUBLISH_WAIT
        with trio.move_on_at(deadline) as scope:
            try:
                async with self._one_change(manifest.path):
                    await self._publish(manifest, held_here, deadline)
            except EtcdError as exc:
                raise CoordinationUnavailable(f"etcd refused the commit record of "
                                              f"{manifest.path} v{manifest.version}: {exc}"
                                              ) from None
        if scope.cancelled_caught:
            raise CoordinationUnavailable(f"etcd did not take the commit record of "
                                          f"{manifest.path} v{manifest.version} in time")

    async def _publish(self, manifest: mf.StepManifest, held_here: set[str],
                       deadline: float) -> None:
        step_path = manifest.path
        names = {e.name for e in manifest.files}
        # Seals of this save not written yet (a temp file's, renamed away) are not written
        # after the stale records go; one already on its way to etcd is waited for.
        waiting = self._batches_taken + (step_path in self._unrecorded)  # the last batch
        self._stale_seals[step_path] = (manifest.version, waiting)
        attempt = self._on_the_wire.get(step_path)
        if attempt is not None:
            await attempt.wait()
        recorded = await self.records.files(step_path)  # the step's one read
        mine = {e.name: self._record(e, manifest.version - 1) for e in manifest.files
                if e.name in held_here}
        # only what the seals did not record already (as a rule, nothing)
        await self.records.record_files(step_path, {n: r for n, r in mine.items()
                                                    if recorded.get(n) != r})
        # files written but not part of the step (e.g. temp files)
        await self.records.delete_files(step_path, set(recorded) - names)
        missing = names - set(recorded) - set(mine)
        if missing:  # recorded elsewhere after collect read them: not yet seen here
            recorded |= await self.records.wait_for_files(step_path, missing, deadline)
        # the writers (and any holder so far) of this content: what every node lists as the
        # step's holders (not the holders of an earlier save's records)
        holders = {h for n, r in recorded.items()
                   if (e := manifest.entry(n)) is not None and r.xxh3 == e.xxh3
                   and r.fresh_for(manifest.version - 1)
                   for h in (r.node, *r.holders)}
        holders.add(self.node_id)
        self._published[step_path] = manifest.version  # before: its watch event may come first
        try:
            record, won = await self.records.commit_recorded(
                step_path, self.node_id, len(names), deadline, manifest.version,
                manifest.committed_ns, holders, _number(manifest), manifest.single_file,
                manifest.content_digest)
        except BaseException:
            self._published.pop(step_path, None)
            raise
        if not won and record.version < manifest.version:  # an older version's commit
            newer = CommitRecord(step_path, self.node_id, len(names), record.at,
                                 manifest.version, manifest.committed_ns,
                                 tuple(sorted({*holders, self.node_id})), _number(manifest),
                                 manifest.single_file, manifest.content_digest)
            await self.records.etcd.put(self.records.commit_key(step_path), newer.encode())

    async def add_holders(self, manifest: mf.StepManifest, node: str,
                          names: list[str]) -> dict[str, FileRecord]:
        """`node` holds verified copies of these files of `manifest` (replicas): count it in
        their records (batched transactions), then among the holders in the commit record
        (one watch event, which every node takes as it is: none reads the records again). The
        records as they are now (none if etcd does not take it: the next replication round
        records it again)."""
        try:
            found = await self.records.add_holders(
                manifest.path, node, {n: e.xxh3 for n in names
                                      if (e := manifest.entry(n)) is not None})
            other = {n: found[n] for n in names if n in found
                     and (e := manifest.entry(n)) is not None and found[n].xxh3 != e.xxh3}
            if other:
                commit = await self.records.commit_of(manifest.path)
                found.update(await self._take_committed(manifest, commit, other, also_on=node))
            await self.records.add_commit_holder(manifest.path, manifest.version, node)
            return found
        except EtcdError as exc:
            log.info("could not record %s as a holder of %d files of %s: %s", node,
                     len(names), manifest.path, exc)
            return {}

    async def _take_committed(self, manifest: mf.StepManifest, commit: CommitRecord | None,
                              records: dict[str, FileRecord],
                              also_on: str | None = None) -> dict[str, FileRecord]:
        """These files' records hold another content than `manifest`'s, which this node holds
        (and `also_on` now too): if `manifest` is the commit the cluster recorded (`commit`,
        as etcd has it now), the records of a node that wrote the same paths in the same
        save and lost the commit to it are made this version's
        (`CommitRecords.take_committed`), held here (and on `also_on`)."""
        if commit is None or (commit.version, commit.committed_ns) != (manifest.version,
                                                                      manifest.committed_ns):
            return {}
        committed = {}
        for name, record in records.items():
            entry = manifest.entry(name)
            if entry is not None:
                mine = self._record(entry, record.base)
                committed[name] = mine if also_on is None else mine.with_holder(also_on)
        taken = await self.records.take_committed(manifest.path, manifest.version, records,
                                                  committed)
        changed = sorted(n for n, record in taken.items() if record.xxh3 != records[n].xxh3)
        if changed:
            log.info("records of %d files of %s held another node's bytes of the same save, "
                     "which lost the commit to v%d: now the committed ones (%s)", len(changed),
                     manifest.path, manifest.version, ", ".join(changed[:3]))
        return taken

    async def leave_files(self, manifest: mf.StepManifest, names: list[str], need: int,
                          live: Callable[[str], bool]) -> set[str] | None:
        """Before this node's copies of these files of `manifest` leave RAM: it takes itself
        out of their holders (batched transactions), only where the record, when the
        transaction takes it, still lists `need` other live holders
        (`CommitRecords.leave_files`). The names that may leave RAM now: those whose records
        do not list this node (now, or never did: a copy read back here) and list `need`
        other live holders; a file whose record does not (too few other holders, no record
        yet, another content) stays. None if etcd did not take it (then none may: see
        `Eviction._leave`)."""
        files = {n: e.xxh3 for n in names if (e := manifest.entry(n)) is not None}
        try:
            found = await self.records.leave_files(manifest.path, self.node_id, files, need,
                                                   live)
        except EtcdError as exc:
            log.info("could not record in etcd that %d files of %s leave RAM here (%s)",
                     len(files), manifest.path, exc)
            return None
        return {n for n, r in found.items() if r.xxh3 == files[n]
                and self.node_id not in r.holders
                and sum(1 for holder in r.holders if live(holder)) >= need}

    async def wait_for_copies(self, manifest: mf.StepManifest, copies: int,
                              live: Callable[[str], bool], deadline: float) -> None:
        """Until every file of `manifest` has `copies` holders that are `live` in its record
        (of this content), followed as `CommitRecords.wait_for_files` does; by `deadline`
        (trio time), else `CoordinationUnavailable` naming how many files are short."""
        digests = {entry.xxh3 for entry in manifest.files}

        def enough(record: FileRecord) -> bool:
            return record.xxh3 in digests and sum(map(live, record.holders)) >= copies

        try:
            await self.records.wait_for_files(manifest.path, [e.name for e in manifest.files],
                                              deadline, enough)
        except CommitTimeout as exc:
            raise CoordinationUnavailable(
                f"{len(exc.missing)} files have fewer than {copies} verified copies on live "
                f"nodes") from None
        except EtcdError as exc:
            raise CoordinationUnavailable(str(exc)) from None

    async def drop_copies(self, manifest: mf.StepManifest, names: list[str]) -> None:
        """This node's copies of these files of `manifest` are gone (found bad and
        quarantined): the records stop counting it as their holder, not as one that left, and
        the step's commit record is touched, so that the other holders restore a copy. Raises
        CoordinationUnavailable if etcd does not take it."""
        files = {n: e.xxh3 for n in names if (e := manifest.entry(n)) is not None}
        try:
            found = await self.records.drop_holders(manifest.path, self.node_id, files)
            if found:
                await self.records.touch_commit(manifest.path)
        except EtcdError as exc:
            raise CoordinationUnavailable(str(exc)) from None

    async def drop_lost_copies(self, holds: Callable[[str, str, str], bool],
                               stored: Callable[[str], bool]) -> int:
        """At start: take this node out of the holders of every committed file it is listed
        for but does not hold (`holds(step path, name, xxh3)`: that file of the step, with
        that content, is resident here; an empty RAM dir, lost files), not as a node that
        left: the loss was not chosen, so the survivors restore those copies. Only steps
        whose commit record lists this node are read; each step changed gets its commit
        record written again (without this node if it holds none of its files), so that
        every node holding its files plans again at once. A step that then has no holder left
        and is not in the store (`stored(step path)`; every holder came back without its
        copies: the prefix's earlier incarnation) has its records removed
        (`CommitRecords.remove_unheld`), not obeyed. The copies dropped; raises EtcdError if
        etcd does not answer."""
        dropped = 0
        for commit in await self.records.commits():
            if self.node_id not in commit.holders:
                continue
            files = await self.records.files(commit.step)
            lost = {name: r.xxh3 for name, r in files.items()
                    if self.node_id in r.holders and not holds(commit.step, name, r.xxh3)}
            if not lost:
                continue
            await self.records.drop_holders(commit.step, self.node_id, lost)
            still = any(self.node_id in r.holders for name, r in files.items()
                        if name not in lost)
            record = await self.records.touch_commit(commit.step,
                                                     drop=None if still else self.node_id)
            log.warning("%s: %d files listed as held here are not in RAM (lost): no longer "
                        "counted here, the other holders restore their copies", commit.step,
                        len(lost))
            dropped += len(lost)
            if (record is not None and not record.holders and not stored(commit.step)
                    and await self.records.remove_unheld(commit.step)):
                log.warning("%s v%d: no node holds any of its files and no store has it: its "
                            "records left etcd", commit.step, record.version)
        return dropped

    async def file_record(self, step_path: str, name: str) -> FileRecord | None:
        """One file's record as etcd has it now (None if none, or unreadable; EtcdError if
        etcd does not answer)."""
        kv = await self.records.etcd.get(self.records.file_key(step_path, name))
        try:
            return FileRecord.decode(kv.value) if kv is not None else None
        except (ValueError, KeyError, TypeError) as exc:
            log.info("could not read the record of %s/%s: %s", step_path, name, exc)
            return None

    async def writers_of(self, manifest: mf.StepManifest) -> dict[str, str] | None:
        """Which node wrote each file of this committed version, from its records."""
        records = await self.placements(manifest)
        return None if records is None else {name: r.node for name, r in records.items()}

    async def placements(self, manifest: mf.StepManifest,
                         holds_copy: HoldsCopy = lambda _path, _name, _xxh3: False
                         ) -> dict[str, FileRecord] | None:
        """Who holds each file of this committed version, from its records: None unless
        etcd has the step's commit record at this version (or does not answer). A record
        left with another node's bytes of the same save, which lost the commit to this
        version, is made this version's if this node holds the committed file
        (`holds_copy`: the replicator's reads; `_take_committed`): else no node would copy
        the file, and the step would stay short of copies until the path is saved again."""
        try:
            record = await self.records.commit_of(manifest.path)
            if record is None or record.version != manifest.version:
                return None
            files = await self.records.files(manifest.path)
            lost = {e.name: files[e.name] for e in manifest.files
                    if e.name in files and files[e.name].xxh3 != e.xxh3
                    and holds_copy(manifest.path, e.name, e.xxh3)}
            if lost:  # (the commit record just read: no second read)
                files.update(await self._take_committed(manifest, record, lost))
        except EtcdError as exc:
            log.info("could not read the records of %s: %s", manifest.path, exc)
            return None
        return {e.name: files[e.name] for e in manifest.files
                if e.name in files and files[e.name].xxh3 == e.xxh3}

    async def learn_all(self, learn: Learn, stored: StoreState | None = None) -> None:
        """List every step committed in the cluster now (at start, before the mount answers;
        `follow` keeps the list current from then on, and lists a step missed here at its
        next change), with the persistent tier's state of each (`stored`)."""
        try:
            records = await self.records.commits()
        except EtcdError as exc:
            log.info("could not list the cluster's steps yet: %s", exc)
            return
        for record in records:
            await self._learn_one(record, learn, stored)

    async def _learn_one(self, record: CommitRecord, learn: Learn,
                         stored: StoreState | None = None) -> None:
        """List one committed step (from its manifest, its holders); a step whose records
        etcd does not give now is listed at its next change."""
        try:
            found = await self._manifest(record)
        except EtcdError as exc:
            log.info("could not read the records of %s: %s", record.step, exc)
            return
        if found is not None:
            learn(*found)
            if record.store is not None and stored is not None:
                stored(record.step, record.version, record.store)

    async def missed(self, owned: list[mf.StepManifest], listed: list[mf.StepManifest]
                     ) -> tuple[list[mf.StepManifest], list[Deletion]]:
        """What this node missed while it was down, from etcd: the steps it committed whose
        commit record never reached etcd (the daemon died between its commit and the record,
        or etcd was away), which have no commit record of that version and no tombstone
        covering them; and the deletions (tombstones) covering steps listed here. Raises
        EtcdError if etcd does not answer."""
        in_cluster = {record.step: record.version for record in await self.records.commits()}
        deleted = await self.records.deletions()
        unpublished = [m for m in owned if in_cluster.get(m.path, 0) < m.version
                       and not _covers(deleted.get(m.path), m)]
        gone = [deleted[m.path] for m in listed if _covers(deleted.get(m.path), m)]
        return unpublished, gone

    async def manifest_of(self, step_path: str, *, patient: bool = True
                          ) -> tuple[mf.StepManifest, list[str]] | None:
        """The step's committed manifest and the nodes holding its files, as etcd says (None
        if it is not committed in the cluster, or etcd does not answer). Not `patient`: None
        at once while etcd does not answer (its last request found no endpoint answering):
        a question asked on the way to something else does not wait a request's timeout."""
        if not patient and self.records.etcd.last_failure is not None:
            return None
        try:
            record = await self.records.commit_of(step_path)
            if record is None:
                return None
            return await self._manifest(record)
        except EtcdError as exc:
            log.info("could not ask etcd about %s: %s", step_path, exc)
            return None

    async def _manifest(self, record: CommitRecord
                        ) -> tuple[mf.StepManifest, list[str]] | None:
        """The committed manifest and the nodes holding its files: from a peer if one that
        holds the step gives it, else made from etcd's file records if they add up to the
        commit record. If they do not, the commit record is read again: a newer commit
        (the re-save that was rewriting the records has committed) is sought in turn, a few
        times at most; the same one means the records are of another version than it
        describes (a re-save under way): None, the step is not listed from this record
        (the re-save's commit will come as an event of its own)."""
        for _round in range(MANIFEST_ROUNDS):
            if record.holders:
                holders = sorted({*record.holders, record.committer})
                manifest = await self._from_peers(record, holders)
                if manifest is not None:
                    return manifest, holders
            found = await self._from_records(record)
            if found is not None:
                return found
            current = await self.records.commit_of(record.step)
            if current is None or current.version == record.version:
                break
            record = current
        return None

    async def _from_peers(self, record: CommitRecord,
                          holders: list[str]) -> mf.StepManifest | None:
        """The manifest from the committer, else another holder (a few are asked)."""
        if self._fetch is None:
            return None
        others = [h for h in holders if h not in (record.committer, self.node_id)]
        sources = ([record.committer] if record.committer != self.node_id else []) + others
        for source in sources[:PEER_SOURCES]:
            try:
                manifest = await self._fetch(source, record.step, record.version)
            except (OSError, ManifestUnavailable, trio.TooSlowError) as exc:
                log.info("could not get the manifest of %s v%d from %s: %s", record.step,
                         record.version, source, exc or "timed out")
                continue
            if (len(manifest.files) != record.files
                    or manifest.committed_ns != record.committed_ns
                    or record.digest not in (None, manifest.content_digest)):
                log.warning("%s sent a manifest of %s that its commit record does not "
                            "describe: ignored", source, record.step)
                continue
            self.manifests_from_peers += 1
            return manifest
        return None

    async def _from_records(self, record: CommitRecord
                            ) -> tuple[mf.StepManifest, list[str]] | None:
        number = record.number
        if number is None and not record.single_file:  # a record older than `number`
            number = self._step_number(os.path.basename(record.step))
        files = await self.records.files(record.step)
        entries = [_entry(name, r) for name, r in sorted(files.items())]
        if (number is None and not record.single_file) or None in entries or \
                len(entries) != record.files:
            log.warning("the commit record of %s does not match its file records: ignored",
                        record.step)
            return None
        manifest = mf.StepManifest(record.step, mf.NO_STEP if number is None else number,
                                   record.version, record.committer, record.committed_ns,
                                   tuple(e for e in entries if e is not None),
                                   record.single_file)
        # A commit record without a digest (written before digests were) cannot tell this
        # version's records from a re-save's: refused rather than risk listing a manifest of
        # two versions, whose reads would fail their hashes or return the wrong bytes. Such a
        # step is listed only from a peer's manifest (checked as before: files, commit time).
        if manifest.content_digest != record.digest:
            log.warning("the file records of %s are not those of its commit v%d (%s): "
                        "no manifest made from them", record.step, record.version,
                        "a re-save under way?" if record.digest else
                        "the commit record has no digest")
            return None
        holders = sorted({h for r in files.values() for h in r.holders} | {record.committer})
        return manifest, holders

    async def follow(self, learn: Learn,
                     removed: Callable[[str], None] = lambda _step: None,
                     stored: StoreState | None = None) -> None:
        """List every commit of the other nodes as it happens (the existing ones first); a
        commit record that leaves etcd (a delete, or a step no node holds any more) is
        `removed(step path)`; the persistent tier's state of a version (`CommitRecord.store`:
        in the store, or retired from it), whoever wrote it there, is `stored(...)`."""
        send, receive = trio.open_memory_channel[CommitEvent](64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.records.follow_commits, send)
            async for event in receive:
                record = event.record
                if record is None:
                    removed(event.step)
                    continue
                if self._own_commit(event):
                    continue
                known = self._known(record.step, record.version) if self._known else None
                if known is not None and known.committed_ns != record.committed_ns:
                    # Another node's commit of the version this node committed at the same
                    # moment, which etcd took: its manifest is read, and taken here
                    # (`StepCopies.learn`).
                    known = None
                if known is not None and record.holders:  # a touch: holders added, stored
                    learn(known, sorted({*record.holders, record.committer}))
                    if record.store is not None and stored is not None:
                        stored(record.step, record.version, record.store)
                    continue
                await self._learn_one(record, learn, stored)

    def _own_commit(self, event: CommitEvent) -> bool:
        """Whether the event is this node's own commit record, just written by `publish`:
        this node holds that version already, so its records need not be read again. Later
        changes of the record (holders added) are read as any other."""
        version = self._published.pop(event.step, None)
        record = event.record
        return (record is not None and event.created and record.committer == self.node_id
                and record.version == version)

    async def forget(self, step_path: str, version: int, committed_ns: int) -> None:
        """A delete of the step (up to `version`, committed at `committed_ns`): a tombstone,
        then its records leave etcd (not those of a newer version, nor, when the step has no
        commit record, the seal records of a re-save under way). CoordinationUnavailable while
        etcd does not take it."""
        deletion = Deletion(step_path, version, committed_ns)
        try:
            async with self._one_change(step_path):
                record = await self.records.commit_of(step_path)
                if record is None:
                    await self.records.add_tombstone(deletion)
                elif record.version <= version or 0 < record.committed_ns <= committed_ns:
                    await self.records.delete_step(deletion)
        except EtcdError as exc:
            raise CoordinationUnavailable(str(exc)) from None


def _covers(deletion: Deletion | None, manifest: mf.StepManifest) -> bool:
    return deletion is not None and manifest.committed_ns <= deletion.committed_ns


def _entry(name: str, record: FileRecord) -> mf.FileEntry | None:
    if record.entry is None:
        return None
    try:
        entry = mf.entry_from_fields(list(record.entry))
    except mf.ManifestError:
        return None
    return entry if entry.name == name else None


def _number(manifest: mf.StepManifest) -> int | None:
    """The step number a commit record carries (None: a loose file has none)."""
    return None if manifest.step == mf.NO_STEP else manifest.step
