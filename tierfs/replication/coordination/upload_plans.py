"""Who uploads which file of a committed step in a cluster (`tierfs.shared_uploads`), from the
step's records in etcd and the live members: every node reading the same records comes to the
same plan.

A file goes up from its writer while the writer is live and holds it, else from the first live
holder (sorted ids); the committer writes the manifest while it is live, else the first live
node among the holders of the step's files. A node that uploaded its files marks them stored
in their records (`CommitRecords.mark_stored`); the manifest's writer follows the records
until every file is marked (`wait_stored`), then records the version as persisted in the
commit record (`CommitRecords.note_store`), from whose watch event every node takes it.
Reading the records costs what the replicator's plan of the same step costs: one read of the
step's file records per node holding files of it, per attempt."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from tierfs import manifest as mf
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.commit_records import CommitTimeout, FileRecord
from tierfs.replication.coordination.etcd import EtcdError
from tierfs.shared_uploads import SharesUnavailable, UploadPlan

log = logging.getLogger(__name__)


class UploadPlans:
    """`tierfs.shared_uploads.SharedUploads` over the cluster's records."""

    def __init__(self, sealed: ClusterCommits, node_id: str,
                 is_up: Callable[[str], bool]) -> None:
        self.sealed = sealed
        self.records = sealed.records
        self.node_id = node_id
        self._is_up = is_up

    def _live(self, node: str) -> bool:
        return node == self.node_id or self._is_up(node)

    def _sender(self, record: FileRecord | None) -> str | None:
        """The node that sends a file to the store: its writer while live and holding it,
        else the first live holder; None if no live node holds it."""
        if record is None:
            return None
        if record.node in record.holders and self._live(record.node):
            return record.node
        return next((h for h in sorted(record.holders) if self._live(h)), None)

    async def plan(self, manifest: mf.StepManifest) -> UploadPlan | None:
        try:
            records = await self.records.files(manifest.path)
            commit = await self.records.commit_of(manifest.path)
        except EtcdError as exc:
            raise SharesUnavailable(f"the records of {manifest.path} cannot be read: "
                                    f"{exc}") from None
        if commit is None or commit.version != manifest.version:
            return None
        mine, stored, others = set(), set(), {}
        holders: set[str] = set()
        for entry in manifest.files:
            record = records.get(entry.name)
            if record is not None and record.xxh3 != entry.xxh3:
                record = None  # a record of another save: not this version's file
            if record is not None:
                holders.update(h for h in record.holders if self._live(h))
            if record is not None and record.stored:
                stored.add(entry.name)
                continue
            sender = self._sender(record)
            if sender == self.node_id:
                mine.add(entry.name)
            else:
                others[entry.name] = sender
        writer = commit.committer if self._live(commit.committer) else min(holders, default=None)
        return UploadPlan(frozenset(mine), frozenset(stored), others,
                          writes_manifest=writer == self.node_id)

    async def mark_stored(self, manifest: mf.StepManifest, names: set[str]) -> None:
        files = {n: e.xxh3 for n in names if (e := manifest.entry(n)) is not None}
        try:
            await self.records.mark_stored(manifest.path, files)
        except EtcdError as exc:
            raise SharesUnavailable(f"etcd did not take that {len(files)} files of "
                                    f"{manifest.path} are stored: {exc}") from None

    async def wait_stored(self, manifest: mf.StepManifest, names: set[str],
                          deadline: float) -> None:
        digests = {n: e.xxh3 for n in names if (e := manifest.entry(n)) is not None}
        try:
            await self.records.wait_for_files(
                manifest.path, list(digests), deadline,
                lambda record: record.stored and record.xxh3 in digests.values())
        except (CommitTimeout, EtcdError, trio.TooSlowError) as exc:
            log.debug("%s: not every file is stored yet: %s", manifest.path, exc)

    async def note_store(self, path: str, version: int | None, state: str) -> None:
        try:
            if version is None:
                commit = await self.records.commit_of(path)
                if commit is None:
                    return
                version = commit.version
            await self.records.note_store(path, version, state)
        except EtcdError as exc:
            raise SharesUnavailable(f"etcd did not take that {path} is {state}: "
                                    f"{exc}") from None
