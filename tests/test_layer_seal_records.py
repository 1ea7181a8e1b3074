"""A cluster node records each file it seals in etcd (the committer of a multi-node step waits
for those records): a `Namespace` driven through its Operations with no mount, whose
`SealedCollector` is the real `ClusterCommits` on a real etcd."""

from __future__ import annotations

import collections
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from tests.test_layer_eviction import EtcdHarness, new_cluster, wait_for_records
from tierfs.devtools.etcd import Etcd as EtcdServer

pytestmark = pytest.mark.store


async def test_a_save_of_many_small_files_records_their_seals_without_a_task_per_file(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """Small files are sealed at their close: each joins the next batch of seals at once, and
    one task writes the batches (a task per file, each waiting for its batch, cost a cluster
    node a third more CPU per small file than a lone mount). Every seal is recorded."""
    h = EtcdHarness(tmp_path / "ram", new_cluster(etcd_server))
    spawned: collections.Counter[str] = collections.Counter()
    spawn = h.ns.background.spawn

    def counted(work: Callable[..., Awaitable[object]], *args: object) -> None:
        spawned[getattr(work, "__name__", repr(work))] += 1
        spawn(work, *args)

    h.ns.background.spawn = counted  # type: ignore[method-assign]
    names = [f"f{i:04}" for i in range(300)]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            for name in names:
                await h.write_file(f"run/step_1/{name}", os.urandom(4096))
            found = await wait_for_records(h, "run/step_1", lambda r: len(r) == len(names))
            assert sorted(found) == names and {r.node for r in found.values()} == {"n0"}
            seal_tasks = spawned["_record_sealed"] + spawned["_write_seals"]
            assert seal_tasks <= 10, spawned
            nursery.cancel_scope.cancel()
    finally:
        h.close()


async def test_a_file_sealed_after_its_close_is_recorded_once_its_hash_is_in(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """A file too large to hash at its close is hashed in the background; its record follows
    the hash, with the digest of its bytes."""
    from tierfs import manifest as mf

    h = EtcdHarness(tmp_path / "ram", new_cluster(etcd_server))
    data = os.urandom(8 << 20)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.ns.background.run)
            await h.write_file("run/step_1/big", data)
            await h.write_file("run/step_1/small", b"s")
            found = await wait_for_records(h, "run/step_1", lambda r: len(r) == 2)
            assert found["big"].xxh3 == mf.hash_bytes(data)
            assert found["small"].xxh3 == mf.hash_bytes(b"s")
            nursery.cancel_scope.cancel()
    finally:
        h.close()
