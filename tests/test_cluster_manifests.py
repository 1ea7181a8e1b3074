"""Committed manifests travel between peers on demand: a node that holds no file of a step
learns its commit from the commit record alone and fetches the manifest from a node that has
it (in chunks), never reading etcd's per-file records of the step."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import trio

from tests.conftest import MountFactory, free_port, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401
from tests.test_crash import save
from tests.test_etcd_cluster import grpc_requests
from tests.test_layer_replication import TOKEN, members_a_and_b
from tierfs import manifest as mf
from tierfs.cluster.etcd import PAGE_SIZE
from tierfs.devtools.etcd import Etcd
from tierfs.replication import peer_manifest
from tierfs.replication.protocol import ProtocolError
from tierfs.replication.server import PeerServer

FILES = 3000  # several pages of file records per reader, had they been read


def test_a_node_without_files_lists_and_reads_a_step_without_its_file_records(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    for node_id in cluster.ports:
        cluster.nodes[node_id] = mounts.mount(*cluster.args(node_id), "--replicas", "0")
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    node0, node1, node2 = (cluster.nodes[f"node{i}"] for i in range(3))
    files = {f"f{i:05d}": b"%d" % i for i in range(FILES)} | {".metadata": b"m"}
    before = grpc_requests(etcd_server)
    save(node0 / "job/step_1", files)
    for node in (node1, node2):
        wait_until(lambda n=node: (n.step("job/step_1") or {}).get("state") == "committed",
                   timeout=30)
    ranges = (grpc_requests(etcd_server) - before)["Range"]
    # the committer reads the step's records once (paged); the other two nodes read none
    pages = math.ceil(FILES / PAGE_SIZE)
    assert ranges <= pages + 2, (ranges, pages)
    listed = node2.step("job/step_1")
    assert listed["files"] == len(files) and not listed["ram"]
    assert os.readlink(node2 / "job/latest") == "step_1"
    for name in ("f00000", f"f{FILES - 1:05d}", ".metadata"):
        assert (node2 / "job/step_1" / name).read_bytes() == files[name]


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
        with pytest.raises(ProtocolError, match="not committed here"):
            await fetcher.fetch("b", manifest.path, manifest.version + 1)
        nursery.cancel_scope.cancel()
