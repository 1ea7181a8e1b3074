"""Deletes stick: `rm -r` of a committed step (what HF Trainer's save_total_limit rotation does)
removes it from every tier: RAM, the persistent tier (manifest first, then data) and the peers'
copies. It never comes back: not after a restart, not on a fresh node, not from a peer that was
away, not even when the store was unreachable at the time of the delete."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_crash import save
from tests.test_s3 import persist_args
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = pytest.mark.cluster


def files(seed: int) -> dict[str, bytes]:
    return {"__0_0.distcp": os.urandom(2 << 20), "sub/extra": b"%d" % seed,
            ".metadata": b"meta%d" % seed}


def save_step(step_dir: Path, content: dict[str, bytes]) -> None:
    (step_dir / "sub").mkdir(parents=True, exist_ok=True)
    save(step_dir, content)


def assert_files(step_dir: Path, content: dict[str, bytes]) -> None:
    for name, data in content.items():
        assert (step_dir / name).read_bytes() == data, name


def listed(mnt: Mount) -> list[str]:
    return sorted(s["path"] for s in mnt.status()["steps"])


def deletes_pending(mnt: Mount) -> int:
    return mnt.status().get("deletes", {}).get("pending", 0)


def deletes_done(mnt: Mount) -> bool:
    return deletes_pending(mnt) == 0


def store_steps(store: Path, run: str = "run") -> list[str]:
    return sorted(os.listdir(store / run)) if (store / run).exists() else []


def test_deletes_stick_across_restart_and_fresh_node(mounts: MountFactory,
                                                     tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1")
    saved = {n: files(n) for n in (1, 2, 3, 4)}
    for number, content in saved.items():
        save_step(mnt / f"run/step_{number}", content)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: not mnt.step("run/step_1")["ram"], timeout=30)
    used = mnt.status()["ram"]["used_bytes"]

    shutil.rmtree(mnt / "run/step_1")  # evicted: only in the store
    shutil.rmtree(mnt / "run/step_4")  # the newest, in RAM and in the store
    with open(mnt / "run/step_3/__0_0.distcp", "r+b") as f:  # being re-saved...
        f.write(b"new")
    shutil.rmtree(mnt / "run/step_3")  # ...and deleted: its committed version goes too
    assert listed(mnt) == ["run/step_2"]
    assert os.readlink(mnt / "run/latest") == "step_2"
    wait_until(lambda: deletes_done(mnt) and store_steps(store) == ["step_2"], timeout=30)
    assert mnt.status()["ram"]["used_bytes"] < used - (2 << 20)  # step_4's RAM is free

    mnt.kill9()
    again = mounts.remount(mnt)
    assert listed(again) == ["run/step_2"]
    assert_files(again / "run/step_2", saved[2])

    # saved again after the delete: a new commit, which the delete does not cover
    save_step(again / "run/step_4", files(44))
    tierfs("flush", str(again.mountpoint), "--timeout", "60")
    assert store_steps(store) == ["step_2", "step_4"]
    tierfs("umount", str(again.mountpoint))
    fresh = mounts.mount("--persist", f"file://{store}")  # an empty RAM dir
    assert listed(fresh) == ["run/step_2", "run/step_4"]
    assert (fresh / "run/step_4/sub/extra").read_bytes() == b"44"

    shutil.rmtree(fresh / "run")  # a whole run directory
    wait_until(lambda: deletes_done(fresh) and store_steps(store) == [], timeout=30)
    tierfs("umount", str(fresh.mountpoint))
    assert listed(mounts.mount("--persist", f"file://{store}")) == []


def test_a_delete_while_s3_is_down_is_finished_after_a_restart(
        mounts: MountFactory, s3_env: dict[str, str], tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "s3") as s3:
        s3.client().create_bucket(Bucket="deletes")
        env = dict(s3_env, AWS_ENDPOINT_URL=s3.endpoint)
        args = persist_args(s3, "deletes")
        mnt = mounts.mount(*args, env=env)
        saved = {n: files(n) for n in (1, 2)}
        for number, content in saved.items():
            save_step(mnt / f"run/step_{number}", content)
        tierfs("flush", str(mnt.mountpoint), "--timeout", "60", env=env)

        def keys(step: str) -> list[str]:
            reply = s3.client().list_objects_v2(Bucket="deletes", Prefix=f"ckpt/run/{step}/")
            return [o["Key"] for o in reply.get("Contents", [])]

        assert len(keys("step_1")) == 4
        s3.stop()
        shutil.rmtree(mnt / "run/step_1")
        mnt.kill9()  # the delete is recorded in the RAM dir, not done
        s3.start()
        again = mounts.remount(mnt, *args, env=env)
        assert listed(again) == ["run/step_2"]  # although the store still had it at start
        wait_until(lambda: deletes_done(again) and keys("step_1") == [], timeout=30)
        assert "deleted run/step_1 from s3://deletes/ckpt" in again.log()
        fresh = mounts.mount(*args, env=env)
        assert listed(fresh) == ["run/step_2"]
        assert_files(fresh / "run/step_2", saved[2])


def test_deletes_reach_the_peers_and_a_peer_back_later_does_not_undo_them(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0, node1, node2 = (cluster.start(n) for n in ("node0", "node1", "node2"))
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    for number in (1, 2, 3):
        save_step(node0 / f"run/step_{number}", files(number))
    wait_until(lambda: all(node0.step(f"run/step_{n}")["replicas"] == ["node1"]
                           for n in (1, 2, 3)), timeout=30)
    wait_until(lambda: listed(node2) == [f"run/step_{n}" for n in (1, 2, 3)], timeout=15)
    replica = node1.ram_dir / "objects"
    before = len(os.listdir(replica))

    shutil.rmtree(node2 / "run/step_1")  # deleted on a node that holds no copy
    wait_until(lambda: all(listed(n) == ["run/step_2", "run/step_3"]
                           for n in (node0, node1, node2)), timeout=15)
    wait_until(lambda: len(os.listdir(replica)) == before - 3, timeout=15)  # node1 freed it

    node1.kill9()  # away, with its replica of step_2, while step_2 is deleted
    shutil.rmtree(node0 / "run/step_2")
    node1 = cluster.start("node1")
    wait_until(lambda: listed(node1) == ["run/step_3"], timeout=20)
    save_step(node0 / "run/step_4", files(4))  # node1 follows the commits since it came back
    wait_until(lambda: node2.step("run/step_4") is not None, timeout=15)
    for node in (node0, node1, node2):
        assert listed(node) == ["run/step_3", "run/step_4"], node.mountpoint
    wait_until(lambda: deletes_done(node0) and deletes_done(node2), timeout=20)
