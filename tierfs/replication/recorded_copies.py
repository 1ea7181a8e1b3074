"""Who holds each file of a committed version, as the cluster's file records say: a record
counts for a version only if it is of the same content (its digest is the manifest entry's),
whatever it was written for; and the steps that may have lost every copy of a file, judged
again from the records whenever members come and go (`recheck_losses`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import trio

from tierfs import manifest as mf
from tierfs.fs.model.ports import StepCopies
from tierfs.replication.coordination.cluster_commit import ClusterCommits
from tierfs.replication.coordination.commit_records import FileRecord
from tierfs.replication.peers.directory import PeerDirectory


def of_content(record: FileRecord | None, entry: mf.FileEntry | None) -> bool:
    """Whether `record` speaks of the content of `entry` (a record of another content, or of a
    file the version lacks, holds nothing of it)."""
    return record is not None and entry is not None and record.xxh3 == entry.xxh3


def _held_by(record: FileRecord | None, entry: mf.FileEntry) -> set[str]:
    return set(record.holders) if record is not None and of_content(record, entry) else set()


def holders_by_file(manifest: mf.StepManifest, records: Mapping[str, FileRecord]
                    ) -> dict[str, set[str]]:
    """Who holds each file of `manifest` (nobody, for a file without a record of its content)."""
    return {entry.name: _held_by(records.get(entry.name), entry) for entry in manifest.files}


def holders_of_recorded(manifest: mf.StepManifest, records: Mapping[str, FileRecord]
                        ) -> dict[str, set[str]]:
    """`holders_by_file` of only the files of `manifest` that `records` has."""
    return {name: _held_by(record, entry) for name, record in records.items()
            if (entry := manifest.entry(name)) is not None}


def recorded_holders_of(manifest: mf.StepManifest, peer: str, names: Iterable[str],
                        found: Mapping[str, FileRecord]) -> list[str]:
    """Those of `names` whose records, as etcd took them (`found`), count `peer` as a holder
    of this content."""
    return [name for name in names
            if name in found and peer in found[name].holders
            and of_content(found[name], manifest.entry(name))]


async def recheck_losses(tiers: StepCopies, directory: PeerDirectory, sealed: ClusterCommits,
                         judge_all: Callable[[], None]) -> None:
    """When a node goes or comes (or its grace ends), the steps that may have lost every copy
    of a file have their records read again, so that every node, also one holding nothing of
    a step, calls it incomplete (and `latest` skips it) or whole on what the records say now;
    then every step is judged (`judge_all`: the daemon logs a step that became incomplete or
    whole again)."""
    while True:
        changed = directory.changed
        generation = directory.generation
        for manifest in tiers.doubtful_steps(directory.may_be_up):
            records = await sealed.placements(manifest)
            if records is not None:
                tiers.note_placements(manifest, {n: set(r.holders) for n, r in records.items()},
                                      {n: r.node for n, r in records.items()})
        judge_all()
        if directory.generation == generation:
            await _either(changed, tiers.recheck_wanted)


async def _either(*events: trio.Event) -> None:
    """Until one of `events` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:
            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)
