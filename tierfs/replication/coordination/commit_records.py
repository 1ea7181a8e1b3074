"""Shard and commit records of multi-node steps, in etcd: a commit moves no data.

Each node seals the files its ranks wrote into a step and records each one:

    /<prefix>/steps/<step>/files/<path>   {"node", "size", "xxh3", "holders": [...],
                                           "left": [...]}

(`<step>` is the step's path with '/' percent-encoded, so it is one key segment; `<path>` is the
file's path inside the step). The node that receives the step's `.metadata` learns from it which
files the step has, waits until a record exists for every one (`wait_for_files`), and then
writes

    /<prefix>/commits/<step>              {"committer", "files", "at"}

Before its files, each node that writes into a step directory says so, once per save:

    /<prefix>/steps/<step>/writers/<node> {"base": the committed version the save is over}

so that whichever node commits the step (a tracker's close, its quiet rules) asks the others
for the files they write, and the commit takes them all: DeepSpeed's and Megatron-LM's ranks
write their files of one step on every node, with no `.metadata` to name them.

in one transaction that succeeds only if the key is absent, so of two racing committers exactly
one wins and both learn the same commit. Every node follows `/<prefix>/commits/`: it learns each
commit there within one watch event, and no node ever sees the other nodes' per-file records
unless it asks for them (a 16,000-file step costs each uninvolved node one event, not 16,000).

A file's `holders` are the nodes that hold a verified copy of it now, and only those: it starts
as its writer and grows as replicas are verified (`add_holders`); a node whose copy leaves RAM
deliberately takes itself out before its bytes go (`leave_files`, guarded in the transaction:
the record must still list K + 1 other live holders, or the store holds the file): the K + 1
rule, so no eviction ever leaves a file with fewer copies; a node that leaves on the store's
strength is listed in `left`, so that `restore_plan` does not replace that copy; a node that
finds at start that it lost copies (an empty RAM dir) takes itself out without being listed in
`left` (`drop_holders`): the survivors restore those.
A node that sent a file to the persistent tier marks it `stored` (`mark_stored`), and the node
that wrote a step's manifest there sets the commit record's `store` (`note_store`): a step's
upload is shared by the nodes holding its files (`coordination.upload_plans`).
`left` is absent from records written before it existed (read as empty). Every change is a
batch of compare-and-swap transactions on the records' versions (`_change_holders`), so
concurrent updates are never lost. Values are small JSON; a step is many small keys, never
one large value (etcd refuses values over 1.5 MiB by default).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import quote, unquote

import trio

from tierfs.replication.coordination.etcd import (
    MAX_TXN_OPS,
    ClusterUrl,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    Snapshot,
    WatchEvent,
    retry_unavailable,
)
from tierfs.replication.coordination.step_reads import StepReads
from tierfs.shared_uploads import PERSISTED, RETIRED

log = logging.getLogger(__name__)


class CommitTimeout(EtcdError):
    """Some files the step names were not recorded by any node in time (`found`: the records
    of the others)."""

    def __init__(self, step: str, missing: list[str],
                 found: dict[str, FileRecord] | None = None) -> None:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                          if len(missing) > 5 else "")
        super().__init__(f"step {step}: no node recorded {shown}")
        self.step = step
        self.missing = missing
        self.found = found or {}


@dataclass(frozen=True)
class FileRecord:
    node: str  # the node that wrote and sealed the file
    size: int
    xxh3: str  # xxh3-128, hex, as in the step's manifest
    holders: tuple[str, ...]  # nodes holding a verified copy now, sorted
    # The file's whole manifest entry (manifest.entry_fields: mode, mtime, owner, chunk
    # hashes), so that every node can make the step's manifest from the records alone.
    entry: tuple[Any, ...] | None = None
    # Nodes that let their copy leave RAM deliberately (never holders at the same time),
    # sorted: `placement.restore_plan` does not replace their copies.
    left: tuple[str, ...] = ()
    # The committed version of the step its writer listed when it sealed the file (0: none):
    # a record of an older save has a lower one, so a re-save's commit does not take it for
    # one of its own files (`fresh_for`). None in a record written before the field was.
    base: int | None = None
    # The persistent tier holds this content under the step's path (the node that uploaded
    # it says so once its request succeeded): the node writing the step's manifest to the
    # store waits for every file's mark (`coordination.upload_plans`). A record written again
    # (a re-save) has none.
    stored: bool = False

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"node": self.node, "size": self.size, "xxh3": self.xxh3,
                                  "holders": list(self.holders)}
        if self.entry is not None:
            fields["entry"] = list(self.entry)
        if self.left:  # absent when empty: the records of older versions read the same
            fields["left"] = list(self.left)
        if self.base is not None:
            fields["base"] = self.base
        if self.stored:  # absent when not: older daemons' records read the same
            fields["stored"] = True
        return _json(fields)

    @classmethod
    def decode(cls, value: bytes) -> FileRecord:
        fields = json.loads(value)
        holders = _node_ids(fields["holders"], "holders")
        left = _node_ids(fields.get("left", []), "left")
        entry = fields.get("entry")
        base = fields.get("base")
        return cls(str(fields["node"]), int(fields["size"]), str(fields["xxh3"]),
                   holders, tuple(entry) if isinstance(entry, list) else None, left,
                   None if base is None else int(base), fields.get("stored") is True)

    def fresh_for(self, base: int) -> bool:
        """Whether the record may be of a file saved over committed version `base` (0: a
        step not committed before): not of an earlier save of the step."""
        return self.base is None or self.base >= base

    def with_holder(self, node: str) -> FileRecord:
        """`node` holds a verified copy (again: it is no longer one that left)."""
        return replace(self, holders=tuple(sorted({*self.holders, node})),
                       left=tuple(n for n in self.left if n != node))

    def without_holder(self, node: str) -> FileRecord:
        """`node`'s copy is lost (not a deliberate leave: the survivors restore it)."""
        return replace(self, holders=tuple(n for n in self.holders if n != node))

    def left_by(self, node: str) -> FileRecord:
        """`node` let its copy go deliberately; nothing changes unless it was a holder."""
        if node not in self.holders:
            return self
        return replace(self.without_holder(node), left=tuple(sorted({*self.left, node})))

    @classmethod
    def sealed(cls, node: str, size: int, xxh3: str, entry: tuple[Any, ...] | None = None,
               base: int | None = None) -> FileRecord:
        """The record of a file just sealed by `node`, its only holder (over committed
        version `base` of the step)."""
        return cls(node, size, xxh3, (node,), entry, base=base)


@dataclass(frozen=True)
class CommitRecord:
    step: str
    committer: str
    files: int
    at: float  # Unix time of the commit
    version: int = 1  # the version of the step's manifest this commit made
    committed_ns: int = 0  # the manifest's commit time
    # Every node holding some file of this version (writers, then verified copies), sorted:
    # what a node that learns the commit lists as the step's holders without reading the
    # file records (a touch that adds one reaches every node in its watch event).
    holders: tuple[str, ...] = ()
    # The step's number (None: a loose file) and whether it is a single file (a file step or
    # a loose file), so that its manifest can be made from the file records alone.
    number: int | None = None
    single_file: bool = False
    # manifest.content_digest of this version's files: a manifest made from the file records
    # (which a re-save rewrites before its commit) is this version's only if it has this
    # digest. None in a record written before digests were: such a record vouches for no
    # manifest made from records (ClusterCommits._from_records refuses them).
    digest: str | None = None
    # This version in the persistent tier: PERSISTED once its manifest is there (written by
    # the node that wrote it), RETIRED once --keep-persist removed it; None: not (yet). Every
    # node takes it from the record's watch event, so each shows the step as the store has it.
    store: str | None = None

    def encode(self) -> bytes:
        return _json({"committer": self.committer, "files": self.files, "at": self.at,
                      "version": self.version, "committed_ns": self.committed_ns,
                      "holders": list(self.holders), "number": self.number,
                      "single_file": self.single_file, "digest": self.digest,
                      "store": self.store})

    @classmethod
    def decode(cls, step: str, value: bytes) -> CommitRecord:
        fields = json.loads(value)
        holders = fields.get("holders", [])
        if not isinstance(holders, list) or not all(isinstance(h, str) for h in holders):
            raise ValueError("holders must be a list of node ids")
        number = fields.get("number")
        digest = fields.get("digest")
        if digest is not None and not isinstance(digest, str):
            raise ValueError("digest must be a string")
        store = fields.get("store")
        if store not in (None, PERSISTED, RETIRED):
            raise ValueError(f"store must be {PERSISTED}, {RETIRED} or null")
        return cls(step, str(fields["committer"]), int(fields["files"]), float(fields["at"]),
                   int(fields.get("version", 1)), int(fields.get("committed_ns", 0)),
                   tuple(sorted(holders)), None if number is None else int(number),
                   bool(fields.get("single_file", False)), digest, store)


@dataclass(frozen=True)
class Deletion:
    """A step deleted in the cluster: every version committed at or before `committed_ns`."""

    step: str
    version: int
    committed_ns: int


def _deletion(step: str, value: bytes) -> Deletion:
    fields = json.loads(value)
    return Deletion(step, int(fields.get("version", 0)), int(fields["committed_ns"]))


@dataclass(frozen=True)
class CommitEvent:
    kind: Literal["committed", "removed"]
    step: str
    record: CommitRecord | None  # None when removed
    created: bool = False  # the commit record's first write (not a later touch)


def _node_ids(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(h, str) for h in value):
        raise ValueError(f"{what} must be a list of node ids")
    return tuple(sorted(value))


def _json(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


class CommitRecords:
    """The records of one cluster (one `--cluster` prefix)."""

    def __init__(self, etcd: Etcd, cluster: ClusterUrl) -> None:
        self.etcd = etcd
        self._steps = cluster.key("steps") + "/"
        self.commits_prefix = cluster.key("commits") + "/"
        self._deleted = cluster.key("deleted") + "/"
        # The records of the steps read last, read again as what changed (`step_reads`).
        self.reads: StepReads[FileRecord] = StepReads(etcd, self.files_prefix,
                                                      FileRecord.decode)

    def files_prefix(self, step: str) -> str:
        return f"{self._steps}{quote(step, safe='')}/files/"

    def file_key(self, step: str, path: str) -> str:
        return self.files_prefix(step) + path

    def commit_key(self, step: str) -> str:
        return self.commits_prefix + quote(step, safe="")

    def writers_prefix(self, step: str) -> str:
        return f"{self._steps}{quote(step, safe='')}/writers/"

    # -- the nodes that write a save of a step

    async def note_writer(self, step: str, node: str, base: int) -> None:
        """`node` writes files of a save of the step over its committed version `base`."""
        await self.etcd.put(self.writers_prefix(step) + node,
                            json.dumps({"base": base}).encode())

    async def writers(self, step: str) -> dict[str, int]:
        """The nodes that wrote files of a save of the step, each with the version its save
        was over (its base: a record of an earlier save, committed since, names an older
        one)."""
        prefix = self.writers_prefix(step)
        snapshot = await self.etcd.get_prefix(prefix)
        found = {}
        for kv in snapshot.kvs:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                found[kv.key[len(prefix):]] = int(json.loads(kv.value)["base"])
        return found

    # -- file records

    async def record_files(self, step: str, records: dict[str, FileRecord]) -> None:
        """Record many sealed files at once (a few transactions, not one request per file)."""
        written = [(path, record.encode(), record) for path, record in sorted(records.items())]
        await self.etcd.put_all([(self.file_key(step, path), value)
                                 for path, value, _record in written])
        self.reads.wrote(step, written)

    async def files(self, step: str) -> dict[str, FileRecord]:
        """Every recorded file of the step, by path (read again as what changed since the
        last read: `step_reads`)."""
        return self.reads.decode(step, (await self.reads.read(step)).kvs)

    async def add_holder(self, step: str, path: str, node: str) -> FileRecord:
        """Count `node` as holding a verified copy of one file: one compare-and-swap on its
        record alone (the per-copy update `bench/simulate_cluster.py` models; the daemon
        uses `add_holders`)."""
        key = self.file_key(step, path)
        while True:  # compare-and-swap on the version: a concurrent update makes us read again
            kv = await self.etcd.get(key)
            if kv is None:
                raise EtcdError(f"step {step}: no record of {path}")
            record = FileRecord.decode(kv.value)
            updated = record.with_holder(node)
            if updated == record:
                return record
            if await self.etcd.put_if_version(key, updated.encode(), kv.version):
                return updated

    async def add_holders(self, step: str, node: str,
                          files: Mapping[str, str]) -> dict[str, FileRecord]:
        """Count `node` as holding a verified copy of each file of `files` ({path: xxh3}, the
        content it verified): one read of those files' records, then compare-and-swap
        transactions (`Etcd.put_all_if_version`; a transaction that lost a race to a
        concurrent update is read and tried again). A record whose xxh3 differs (the path was
        sealed again meanwhile) is left as it is: a copy of v5 never holds v6. The records
        of `files` as they are now (paths without a record are left out)."""
        return await self._change_holders(step, files, lambda _path, r: r.with_holder(node))

    async def take_committed(self, step: str, version: int,
                             records: Mapping[str, FileRecord],
                             committed: Mapping[str, FileRecord]) -> dict[str, FileRecord]:
        """The committed `version`'s records (`committed`, by path) in place of `records`,
        records of another content written for the same save or an earlier one (`base`
        below `version`): a node that wrote the same path with other bytes in the same save
        and lost the commit to this version (HF's `save_on_each_node`, two nodes committing
        at once), whose record would otherwise keep every copy of the committed content from
        being counted. Compare-and-swap on each record as it was read: a record written again
        meanwhile (a later save) is left. The records as they are now."""
        stale = {path: record.xxh3 for path, record in records.items()
                 if path in committed and record.xxh3 != committed[path].xxh3
                 and record.base is not None and record.base < version}
        return await self._change_holders(step, stale, lambda path, _r: committed[path])

    async def leave_files(self, step: str, node: str, files: Mapping[str, str], need: int = 0,
                          live: Callable[[str], bool] = lambda _node: True
                          ) -> dict[str, FileRecord]:
        """`node` lets its copies of `files` ({path: xxh3}) leave RAM deliberately: it is no
        longer a holder, but only where the record, as it is when the compare-and-swap takes
        it, still lists at least `need` other holders that are `live`: K + 1 for a step not
        persisted, so that a file never has fewer than K + 1 copies because one left; 0 once
        the store holds it. Only a node leaving on the store's strength (`need` 0) is listed
        in `left` (`placement.restore_plan` does not replace its copy); one leaving K + 1
        copies behind is simply no holder (if one of those is lost later, a copy is made
        again, on any node). The guard is in the transaction, not in what this node
        believed: a holder dropped meanwhile (it lost its copy) is not counted, and of two
        nodes leaving at once the second sees the first gone, so the copies never fall
        below K + 1. Batched as `add_holders`; the records as they are now."""

        def leave(_path: str, record: FileRecord) -> FileRecord:
            others = [h for h in record.holders if h != node and live(h)]
            if len(others) < need:
                return record
            return record.left_by(node) if need == 0 else record.without_holder(node)

        return await self._change_holders(step, files, leave)

    async def drop_holders(self, step: str, node: str,
                           files: Mapping[str, str | None]) -> dict[str, FileRecord]:
        """Stop counting `node` as a holder of each file of `files` ({path: xxh3, or None for
        any content}): its copies are lost (not there at start). Not listed in `left`, so the
        survivors restore them. Batched as `add_holders`."""
        return await self._change_holders(step, files, lambda _path, r: r.without_holder(node))

    async def mark_stored(self, step: str, files: Mapping[str, str]) -> dict[str, FileRecord]:
        """The persistent tier holds each file of `files` ({path: xxh3}) with that content:
        marked in its record (not in a record of another content). Batched as
        `add_holders`; the records as they are now."""
        return await self._change_holders(step, files,
                                          lambda _path, r: replace(r, stored=True))

    async def _change_holders(self, step: str, files: Mapping[str, str | None],
                              change: Callable[[str, FileRecord], FileRecord]
                              ) -> dict[str, FileRecord]:
        """Apply `change` (path, record) to the record of each file of `files` whose xxh3 is
        the one given (None: any), in compare-and-swap transactions, until none lost a race.
        The records as they are now."""
        while True:
            current = await self._current(step, files)
            updates = []
            for path, (kv, record) in current.items():
                updated = change(path, record)
                if updated != record and files[path] in (None, record.xxh3):
                    updates.append((path, kv, updated, updated.encode()))
            if await self.etcd.put_all_if_version(
                    [(kv.key, value, kv.version) for _path, kv, _record, value in updates]):
                self.reads.wrote(step, ((path, value, record)
                                        for path, _kv, record, value in updates))
                done = {path: record for path, _kv, record, _value in updates}
                return {path: done.get(path, record) for path, (_kv, record) in current.items()}

    async def _current(self, step: str, files: Collection[str]
                       ) -> dict[str, tuple[KeyValue, FileRecord]]:
        """The records of `files` as etcd holds them now, with their keys' versions. For
        more files than a transaction reads, of a step read before, the step's changes since
        (one request: the holders of 10,000 files read 128 keys per transaction took about
        a third of a second, ad hoc); else those files' keys alone (`Etcd.get_all`: a node
        changing its own few files of a 16,000-file step reads those, not the step)."""
        if len(files) > MAX_TXN_OPS and self.reads.kept(step):
            read = await self.reads.read(step)
            kvs = {path: read.kvs[path] for path in files if path in read.kvs}
        else:
            prefix = self.files_prefix(step)
            found = await self.etcd.get_all([self.file_key(step, path) for path in sorted(files)])
            kvs = {path: kv for kv in found.values() if (path := kv.key[len(prefix):]) in files}
        records = self.reads.decode(step, kvs, whole=False)
        return {path: (kvs[path], record) for path, record in records.items()}

    # -- commits

    async def wait_for_files(self, step: str, names: Collection[str], deadline: float,
                             accept: Callable[[FileRecord], bool] = lambda _record: True
                             ) -> dict[str, FileRecord]:
        """The records of `names` once every one exists (and is one `accept` takes: not of
        an earlier save): the step's records are mirrored (`Etcd.follow_prefix`: read once,
        then watched), until about one request timeout before `deadline` (trio time), then
        read once more. By the deadline, `CommitTimeout` naming the missing files, or
        `EtcdUnavailable` if etcd does not answer."""
        wanted = set(names)
        found: dict[str, FileRecord] = {}

        def taken() -> dict[str, FileRecord]:
            return {name: record for name, record in found.items() if accept(record)}

        send, receive = trio.open_memory_channel[Snapshot | list[WatchEvent]](16)
        # the last read gets one request timeout (half of what is left, if that is less)
        last_read_from = deadline - min(self.etcd.timeout,
                                        (deadline - trio.current_time()) / 2)
        with trio.move_on_at(last_read_from):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.etcd.follow_prefix, self.files_prefix(step), send)
                async for item in receive:
                    self._mirror(step, found, item)
                    if wanted <= set(taken()):
                        nursery.cancel_scope.cancel()
            return {name: found[name] for name in wanted}
        with trio.move_on_at(deadline) as last_read:
            found = await self.files(step)  # EtcdUnavailable if etcd is why we waited in vain
        if last_read.cancelled_caught:
            raise EtcdUnavailable(f"step {step}: etcd did not answer in time")
        if wanted <= set(taken()):  # recorded in the last instant
            return {name: found[name] for name in wanted}
        raise CommitTimeout(step, sorted(wanted - set(taken())), taken())

    def _mirror(self, step: str, found: dict[str, FileRecord],
                item: Snapshot | list[WatchEvent]) -> None:
        """Apply a snapshot (it replaces all) or a batch of changes to `found`."""
        if isinstance(item, Snapshot):
            found.clear()
            found.update(self.reads.decode_kvs(step, item.kvs))
            return
        prefix = self.files_prefix(step)
        for event in item:
            if event.kind == "delete":
                found.pop(event.kv.key[len(prefix):], None)
        found.update(self.reads.decode_kvs(step, [e.kv for e in item if e.kind == "put"],
                                           whole=False))

    async def delete_files(self, step: str, paths: Collection[str]) -> None:
        """Drop the records of these files of the step (a few transactions)."""
        await self.etcd.delete_all([self.file_key(step, path) for path in sorted(paths)])

    async def commit(self, step: str, committer: str, names: Collection[str],
                     timeout: float, version: int = 1,
                     committed_ns: int = 0) -> tuple[CommitRecord, bool]:
        """Commit the step once every file in `names` is recorded: (the commit, True) if this
        call wrote it, (the commit another node wrote first, False) otherwise. Within timeout
        (plus at most one request timeout), else `CommitTimeout` or `EtcdUnavailable`."""
        deadline = trio.current_time() + timeout
        await self.wait_for_files(step, names, deadline)
        return await self.commit_recorded(step, committer, len(names), deadline, version,
                                          committed_ns)

    async def commit_recorded(self, step: str, committer: str, files: int, deadline: float,
                              version: int = 1, committed_ns: int = 0,
                              holders: Collection[str] = (), number: int | None = None,
                              single_file: bool = False,
                              digest: str | None = None) -> tuple[CommitRecord, bool]:
        """`commit` once the caller knows every file is recorded: the transaction alone,
        answered by `deadline` (trio time) plus one request timeout."""
        record = CommitRecord(step, committer, files, time.time(), version, committed_ns,
                              tuple(sorted({*holders, committer})), number, single_file,
                              digest)
        key = self.commit_key(step)
        won: bool | None = None
        with trio.move_on_at(deadline + self.etcd.timeout):
            won = await retry_unavailable(lambda: self.etcd.put_if_absent(key, record.encode()),
                                          f"committing {step}")
        if won is None:
            raise EtcdUnavailable(f"step {step}: etcd did not answer the commit in time")
        if won:
            log.info("step %s committed in the cluster by %s (%d files)", step, committer,
                     files)
            return record, True
        winner = await self.commit_of(step)
        if winner is None:  # committed and deleted meanwhile: nothing left to commit
            raise EtcdError(f"step {step} was committed and then deleted meanwhile")
        return winner, False

    async def commit_of(self, step: str) -> CommitRecord | None:
        """The step's commit record, if it is committed."""
        kv = await self.etcd.get(self.commit_key(step))
        return CommitRecord.decode(step, kv.value) if kv is not None else None

    async def add_commit_holder(self, step: str, version: int, node: str) -> None:
        """Count `node` among the holders in the step's commit record of `version` (a
        compare-and-swap: concurrent additions are never lost). Written only when `node` is
        new there: each write is a watch event to every node (which takes the holders from
        it and reads nothing), so a step whose copies go to nodes that wrote files of it
        anyway (a multi-node step) costs none. Nothing if the record is of another
        version."""
        def added(record: CommitRecord) -> CommitRecord | None:
            if record.version != version or node in record.holders:
                return None
            return replace(record, holders=tuple(sorted({*record.holders, node})))

        await self._change_commit(step, added)

    async def _change_commit(self, step: str,
                             change: Callable[[CommitRecord], CommitRecord | None]
                             ) -> CommitRecord | None:
        """Write `change` of the step's commit record (None: nothing to write), in a
        compare-and-swap: a concurrent change is read and tried again. The record as it is
        then; nothing (None) if the step is not committed (or its record is malformed)."""
        key = self.commit_key(step)
        while True:
            kv = await self.etcd.get(key)
            if kv is None:
                return None
            try:
                current = CommitRecord.decode(step, kv.value)
                updated = change(current)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring the malformed commit record %s: %s", key, exc)
                return None
            if updated is None:
                return current
            if await self.etcd.put_if_version(key, updated.encode(), kv.version):
                return updated

    async def note_store(self, step: str, version: int, store: str) -> CommitRecord | None:
        """The persistent tier's state of the step's `version` (PERSISTED, RETIRED) in its
        commit record (nothing if the record is of another version): one watch event, from
        which every node takes it. The record as it is then."""
        return await self._change_commit(step, lambda record: None if (
            record.version != version or record.store == store) else replace(record,
                                                                             store=store))

    async def touch_commit(self, step: str, drop: str | None = None) -> CommitRecord | None:
        """Write the step's commit record again, without `drop` among its holders: a watch
        event that makes every node holding files of the step plan its copies again (after
        a node took itself out of the file records). The record as written (None if the step
        is not committed)."""
        return await self._change_commit(step, lambda record: replace(
            record, holders=tuple(h for h in record.holders if h != drop)))

    async def remove_unheld(self, step: str) -> bool:
        """Remove the records of a step that no node holds any more (an earlier incarnation
        of the cluster's prefix: every holder came back without its copies): its commit
        record if it names no holder, in a compare-and-delete (a commit written meanwhile
        stays), then the file records that name no holder (the seal records of a re-save
        under way name their writer, and stay). Whether the commit record went."""
        key = self.commit_key(step)
        kv = await self.etcd.get(key)
        try:
            if kv is None or CommitRecord.decode(step, kv.value).holders:
                return False
        except (ValueError, KeyError, TypeError):
            return False
        if not await self.etcd.delete_if_unchanged([(key, kv.mod_revision)]):
            return False
        prefix = self.files_prefix(step)
        snapshot = await self.etcd.get_prefix(prefix)
        files = self.reads.decode_kvs(step, snapshot.kvs)
        await self.etcd.delete_if_unchanged(
            [(item.key, item.mod_revision) for item in snapshot.kvs
             if (record := files.get(item.key[len(prefix):])) is not None
             and not record.holders])
        return True

    async def commits(self) -> list[CommitRecord]:
        """Every commit of the cluster now (a node starting: before it follows them)."""
        snapshot = await self.etcd.get_prefix(self.commits_prefix)
        events = (self._commit_event(kv) for kv in snapshot.kvs)
        return [e.record for e in events if e is not None and e.record is not None]

    async def delete_step(self, deletion: Deletion) -> None:
        """Remove the step's commit, then its file records, after leaving a tombstone."""
        await self.add_tombstone(deletion)
        await self.etcd.delete(self.commit_key(deletion.step))
        await self.etcd.delete_prefix(self._steps + quote(deletion.step, safe="") + "/")

    async def add_tombstone(self, deletion: Deletion) -> None:
        """Remember in etcd that the step was deleted up to `deletion` (a later tombstone of
        the same step is kept: an older delete retried late does not shorten it), so that a
        node back from a crash neither lists a deleted version nor writes its commit record
        (`deletions`)."""
        key = self._deleted + quote(deletion.step, safe="")
        value = _json({"version": deletion.version, "committed_ns": deletion.committed_ns})
        while True:  # compare-and-swap: a concurrent delete makes us read again
            kv = await self.etcd.get(key)
            if kv is None:
                if await self.etcd.put_if_absent(key, value):
                    return
                continue
            if _deletion(deletion.step, kv.value).committed_ns >= deletion.committed_ns:
                return
            if await self.etcd.put_if_version(key, value, kv.version):
                return

    async def deletions(self) -> dict[str, Deletion]:
        """Every step deleted in the cluster, by path: the last version deleted (versions
        committed no later are deleted, as `fs.lifecycle.deletes.Tombstone.covers`)."""
        snapshot = await self.etcd.get_prefix(self._deleted)
        found = {}
        for kv in snapshot.kvs:
            step = unquote(kv.key[len(self._deleted):])
            try:
                found[step] = _deletion(step, kv.value)
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring a malformed tombstone record %s", kv.key)
        return found

    async def follow_commits(self, send: trio.abc.SendChannel[CommitEvent]) -> None:
        """Every commit of the cluster, as `CommitEvent`s, until cancelled: the existing ones
        first (again after a compaction of the watch history: consumers must be idempotent),
        then each new commit or removal as it happens."""
        raw_send, raw_receive = trio.open_memory_channel[Snapshot | list[WatchEvent]](16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.etcd.follow_prefix, self.commits_prefix, raw_send)
            async for item in raw_receive:
                events = item.kvs if isinstance(item, Snapshot) else item
                for entry in events:
                    event = self._commit_event(entry)
                    if event is not None:
                        await send.send(event)

    def _commit_event(self, entry: KeyValue | WatchEvent) -> CommitEvent | None:
        kv = entry.kv if isinstance(entry, WatchEvent) else entry
        step = unquote(kv.key[len(self.commits_prefix):])
        if isinstance(entry, WatchEvent) and entry.kind == "delete":
            return CommitEvent("removed", step, None)
        try:
            return CommitEvent("committed", step, CommitRecord.decode(step, kv.value),
                               kv.version == 1)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the malformed commit record %s: %s", kv.key, exc)
            return None
