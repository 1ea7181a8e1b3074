"""Committed manifests travel between peers on demand: a node that holds no file of a step
learns its commit from the commit record alone and fetches the manifest from a node that has
it (in chunks), never reading etcd's per-file records of the step. When no peer gives it, it is
made from those records, but only if they add up to the commit record's content digest."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from tests.conftest import Mount, MountFactory, free_port, getxattr, wait_until
from tests.harness import Cluster
from tests.test_crash import save
from tests.test_etcd_cluster import commits, grpc_requests, new_cluster, step_manifest
from tests.test_layer_replication import TOKEN, members_a_and_b
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd
from tierfs.replication.coordination.cluster_commit import ManifestUnavailable
from tierfs.replication.coordination.commit_records import CommitRecord
from tierfs.replication.coordination.etcd import PAGE_SIZE
from tierfs.replication.peers import peer_manifest
from tierfs.replication.peers.server import PeerServer

pytestmark = pytest.mark.cluster

FILES = 3000  # several pages of file records per reader, had they been read


def test_a_node_without_files_lists_and_reads_a_step_without_its_file_records(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0, node1, node2 = cluster.start_all("--replicas", "0")
    files = {f"f{i:05d}": b"%d" % i for i in range(FILES)} | {".metadata": b"m"}
    before = grpc_requests(etcd_server)
    save(node0 / "job/step_1", files)
    for node in (node1, node2):  # (not `tierfs status`: it reads the records it shows)
        wait_until(lambda n=node: _state(n, "job/step_1") == "committed", timeout=30)
    ranges = (grpc_requests(etcd_server) - before)["Range"]
    # the committer reads the step's records once (paged); the other two nodes read none
    pages = math.ceil(FILES / PAGE_SIZE)
    assert ranges <= pages + 2, (ranges, pages)
    listed = node2.step("job/step_1")
    assert listed["files"] == len(files) and not listed["ram"]
    assert os.readlink(node2 / "job/latest") == "step_1"
    for name in ("f00000", f"f{FILES - 1:05d}", ".metadata"):
        assert (node2 / "job/step_1" / name).read_bytes() == files[name]


def _state(node: Mount, step: str) -> str | None:
    try:
        return getxattr(node / step, "user.tierfs.state")
    except OSError:  # not listed there yet
        return None


def big_manifest(files: int) -> mf.StepManifest:
    """A committed manifest of many large files (each with its chunk hashes): megabytes."""
    chunks = tuple(f"{i:016x}" for i in range(24))
    entries = tuple(mf.FileEntry(f"rank{i:05d}/__{i}_0.distcp", 24 * mf.CHUNK_SIZE,
                                 f"{i:032x}", 1, 0o644, chunks) for i in range(files))
    return mf.StepManifest("run/step_9", 9, 3, "b", 123, entries)


async def test_a_manifest_of_many_files_is_fetched_in_several_chunks(
        tmp_path: Path, etcd_server: Etcd) -> None:
    manifest = big_manifest(20_000)
    size = len(mf.encode(manifest))
    assert size > 2 * peer_manifest.CHUNK  # no single frame could carry it

    def committed(path: str, version: int) -> mf.StepManifest | None:
        return manifest if (path, version) == (manifest.path, manifest.version) else None

    server = peer_manifest.ManifestServer(committed)
    port = free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(PeerServer("b", TOKEN, {"a", "b"},
                                       {"MANIFEST": server.on_manifest}).run,
                            "127.0.0.1", port)
        membership = await members_a_and_b(nursery, etcd_server, port)
        fetcher = peer_manifest.ManifestFetcher(membership)
        fetched = await fetcher.fetch("b", manifest.path, manifest.version)
        assert fetched == manifest
        assert server.served_parts == math.ceil(size / peer_manifest.CHUNK) >= 3
        with pytest.raises(ManifestUnavailable, match="not committed here"):
            await fetcher.fetch("b", manifest.path, manifest.version + 1)
        nursery.cancel_scope.cancel()


NAMES = sorted([".metadata", "__0_0.distcp", "__1_0.distcp"])


async def test_a_manifest_from_records_mixing_two_versions_is_refused(
        etcd_server: Etcd) -> None:
    """n1 has no peer to ask, so it makes the manifest from the file records: while a re-save
    of the step has sealed some files again (the commit record still says v1) they mix two
    versions and are refused; once v2 commits they make v2, even for a node still holding the
    v1 commit record it learned before."""
    cluster = new_cluster(etcd_server)
    n0, _etcd = commits(cluster, "n0")
    n1, _etcd1 = commits(cluster, "n1")  # no fetch: the records are all it has
    v1 = step_manifest("run/step_1", NAMES, "n0")
    await n0.record_sealed(v1.path, list(v1.files))
    await n0.publish(v1, set(NAMES))
    found = await n1.manifest_of(v1.path)
    assert found is not None and found[0] == v1  # the normal path
    record_v1 = await n1.records.commit_of(v1.path)
    assert record_v1 is not None

    shard = replace(v1.entry("__0_0.distcp"), size=99, xxh3="f" * 32,  # type: ignore[arg-type]
                    chunks=("f" * 16,))
    await n0.record_sealed(v1.path, [shard], base=1)  # the re-save's first seal (over v1)
    assert await n1.manifest_of(v1.path) is None
    assert record_v1.digest == v1.content_digest

    v2 = replace(v1, version=2, committed_ns=v1.committed_ns + 1,
                 files=tuple(shard if e.name == shard.name else e for e in v1.files))
    await n0.publish(v2, set(NAMES))
    found = await n1.manifest_of(v1.path)
    assert found is not None and found[0] == v2
    found = await n1._manifest(record_v1)  # the v1 event, read late: the newer commit is taken
    assert found is not None and found[0] == v2


async def test_a_commit_record_without_a_digest_makes_no_manifest_from_records(
        etcd_server: Etcd) -> None:
    """A commit record written before digests were cannot tell one version's records from a
    re-save's: it is read as before, but no manifest is made from the records for it."""
    cluster = new_cluster(etcd_server)
    n0, _etcd = commits(cluster, "n0")
    n1, _etcd1 = commits(cluster, "n1")
    manifest = step_manifest("run/step_1", NAMES, "n0")
    await n0.publish(manifest, set(NAMES))
    key = n0.records.commit_key(manifest.path)
    kv = await n0.records.etcd.get(key)
    assert kv is not None
    old = {k: v for k, v in json.loads(kv.value).items() if k != "digest"}
    await n0.records.etcd.put(key, json.dumps(old).encode())
    record = await n1.records.commit_of(manifest.path)
    assert record == replace(CommitRecord.decode(manifest.path, kv.value), digest=None)
    assert await n1.manifest_of(manifest.path) is None
