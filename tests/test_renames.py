"""Renames stick in every tier (issue 24): `mv run1 run1-old` or `mv step_5 step_5.bak` after
the steps were persisted renames them in the store too, by copies inside the store (no byte of
an evicted step is fetched back or sent again), and the old names never come back: not after a
restart, not on a fresh node with the same store, not on a peer. Also: a change of mode of a
committed file reaches the store as a new version without its bytes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tests.harness import Cluster
from tests.test_deletes import assert_files, deletes_done, files, listed, save_step
from tests.test_s3 import persist_args
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.seaweed import SeaweedS3
from tierfs.fs.lifecycle.deletes import PERSIST, Deletes

pytestmark = pytest.mark.fuse


class Store:
    """One persistent tier for the test: its mount options, environment and object keys."""

    def __init__(self, args: list[str], env: dict[str, str] | None,
                 objects: Callable[[], list[str]]) -> None:
        self.args, self.env, self.objects = args, env, objects

    def steps(self, run: str) -> set[str]:
        """The names below `run/` in the store, one level down."""
        return {key.split("/")[1] for key in self.objects() if key.startswith(run + "/")}


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "file":
        root = tmp_path / "store"
        root.mkdir()

        def file_keys() -> list[str]:
            return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                          if p.is_file() and not p.name.startswith(".tierfs-store"))

        yield Store(["--persist", f"file://{root}"], None, file_keys)
        return
    server: SeaweedS3 = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("bucket")
    env = request.getfixturevalue("s3_env")

    def s3_keys() -> list[str]:
        pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                          Prefix="ckpt/")
        return sorted(o["Key"][len("ckpt/"):] for page in pages
                      for o in page.get("Contents", []))

    yield Store(persist_args(server, bucket), env, s3_keys)


def test_renames_of_renames_find_the_old_objects(tmp_path: Path) -> None:
    """The record of renames (kept across a restart) says where the bytes of a new name may
    still be in the store: `mv step_2 step_2.bak`, then `mv run1 run1-old` before either
    reached it; a single file too. Finished renames name nothing."""
    deletes = Deletes(tmp_path / "deleted", [PERSIST])
    deletes.record("run1/step_2", 1, 10, moved_to="run1/step_2.bak")
    deletes.record("run1/step_2.bak", 2, 20, moved_to="run1-old/step_2.bak")
    deletes.record("run1/last.ckpt", 1, 30, moved_to="run1-old/last.ckpt")
    again = Deletes(tmp_path / "deleted")
    assert again.sources("run1-old/step_2.bak/sub/x") == [
        ("run1/step_2.bak", "run1/step_2.bak/sub/x"), ("run1/step_2", "run1/step_2/sub/x")]
    assert again.old_keys("run1-old/last.ckpt") == ["run1/last.ckpt"]
    assert again.old_keys("run1-old/step_2.bakery/x") == []
    for tomb in again.pending():
        again.done(tomb, PERSIST)
    assert again.old_keys("run1-old/step_2.bak/sub/x") == []


def test_a_later_delete_at_a_renamed_steps_old_name_keeps_the_rename_waiting(
        tmp_path: Path) -> None:
    """`mv step_2 step_2.bak`, then a new step_2 removed (saved and deleted, or in a cluster
    only begun: its removal covers what was committed before it) before the rename reached the
    store: the old objects stay the new name's bytes there until it has its own (the delete
    worker waits for it, `may_clean`), then go with the later version's. Before, the later
    delete dropped the rename from its record, and the old objects, the only copy in the store
    of a step that had left RAM, were removed at once."""
    deletes = Deletes(tmp_path / "deleted", [PERSIST])
    deletes.record("run1/step_2", 1, 10, moved_to="run1/step_2.bak")
    deletes.record("run1/step_2", 0, 20)
    again = Deletes(tmp_path / "deleted")
    for log in (deletes, again):
        assert log.old_keys("run1/step_2.bak/x") == ["run1/step_2/x"]
        tomb, = log.pending()
        assert (tomb.moved_to, tomb.committed_ns) == ("run1/step_2.bak", 20)


def test_renamed_steps_and_run_dirs_never_come_back(mounts: MountFactory,
                                                    store: Store) -> None:
    mnt = mounts.mount(*store.args, "--keep-ram", "1", env=store.env)
    saved = {n: files(n) for n in (1, 2, 3)}
    for number, content in saved.items():
        save_step(mnt / f"run1/step_{number}", content)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60", env=store.env)
    wait_until(lambda: not mnt.step("run1/step_1")["ram"]
               and not mnt.step("run1/step_2")["ram"], timeout=30)  # only in the store

    os.rename(mnt / "run1/step_2", mnt / "run1/step_2.bak")  # no step name any more
    os.rename(mnt / "run1", mnt / "run1-old")
    assert not (mnt / "run1").exists()
    wait_until(lambda: deletes_done(mnt) and "run1" not in {k.split("/")[0]
                                                           for k in store.objects()}, timeout=60)
    assert store.steps("run1-old") >= {"step_1", "step_3", "step_2.bak"}
    expected = ["run1-old/step_1", "run1-old/step_2.bak/.metadata",
                "run1-old/step_2.bak/__0_0.distcp", "run1-old/step_2.bak/sub/extra",
                "run1-old/step_3"]
    assert listed(mnt) == expected
    # nothing came back into RAM: the store copied the renamed objects itself
    assert not mnt.step("run1-old/step_1")["ram"]
    assert mnt.step("run1-old/step_1")["persisted"]

    def check(node: Mount) -> None:
        assert listed(node) == expected
        assert not (node / "run1").exists()
        assert_files(node / "run1-old/step_1", saved[1])
        assert_files(node / "run1-old/step_2.bak", saved[2])
        assert_files(node / "run1-old/step_3", saved[3])

    mnt.kill9()
    again = mounts.remount(mnt, *store.args, env=store.env)
    check(again)
    tierfs("umount", str(again.mountpoint), env=store.env)
    fresh = mounts.mount(*store.args, env=store.env)  # an empty RAM dir, the same store
    check(fresh)


def test_a_rename_undone_leaves_no_trace_of_the_middle_name(mounts: MountFactory,
                                                             store: Store) -> None:
    """`mv run run_q; mv run_q run` right after a flush, and `mv step_1 step_2; mv step_2
    step_1` of a persisted step: once `tierfs flush` returns, the store holds no object of
    the middle names, and a fresh node lists none of them (the two renames' records each
    waited for the other for ever: the middle name stayed in the store, listed on a fresh
    node, sometimes as `latest`, and flush said nothing of it)."""
    mnt = mounts.mount(*store.args, "--commit-idle", "1", env=store.env)
    saved = {n: files(n) for n in (1, 10)}
    for number, content in saved.items():
        save_step(mnt / f"run/step_{number}", content)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60", env=store.env)

    os.rename(mnt / "run", mnt / "run_q")
    os.rename(mnt / "run_q", mnt / "run")
    os.rename(mnt / "run/step_1", mnt / "run/step_2")
    os.rename(mnt / "run/step_2", mnt / "run/step_1")
    expected = ["run/step_1", "run/step_10"]
    wait_until(lambda: listed(mnt) == expected and all(
        s["state"] == "committed" for s in mnt.status()["steps"]), timeout=30)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60", env=store.env)
    assert deletes_done(mnt)
    assert {key.split("/")[0] for key in store.objects()} == {"run"}
    assert store.steps("run") == {"step_1", "step_10"}
    tierfs("umount", str(mnt.mountpoint), env=store.env)

    fresh = mounts.mount(*store.args, env=store.env)
    assert listed(fresh) == expected
    assert sorted(os.listdir(fresh.mountpoint)) == ["run"]
    assert os.readlink(fresh / "run/latest") == "step_10"
    for number, content in saved.items():
        assert_files(fresh / f"run/step_{number}", content)


def test_a_rename_not_yet_in_the_store_is_finished_after_a_restart(
        mounts: MountFactory, tmp_path: Path) -> None:
    """Killed right after the rename: the old name's objects still hold the bytes of the new
    one (evicted here), and go only once the new name is in the store."""
    root = tmp_path / "store"
    root.mkdir()
    args = ["--persist", f"file://{root}", "--keep-ram", "1"]
    mnt = mounts.mount(*args)
    saved = {n: files(n) for n in (1, 2)}
    for number, content in saved.items():
        save_step(mnt / f"run/step_{number}", content)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: not mnt.step("run/step_1")["ram"], timeout=30)
    inode = os.stat(root / "run/step_1/__0_0.distcp").st_ino

    os.rename(mnt / "run/step_1", mnt / "run/step_01")
    mnt.kill9()
    again = mounts.remount(mnt, *args)
    wait_until(lambda: deletes_done(again) and not (root / "run/step_1").exists(), timeout=30)
    assert sorted(os.listdir(root / "run")) == ["step_01", "step_2"]
    assert os.stat(root / "run/step_01/__0_0.distcp").st_ino == inode  # a link, not a copy
    assert listed(again) == ["run/step_01", "run/step_2"]
    assert_files(again / "run/step_01", saved[1])
    tierfs("umount", str(again.mountpoint))
    fresh = mounts.mount("--persist", f"file://{root}")
    assert listed(fresh) == ["run/step_01", "run/step_2"]
    assert_files(fresh / "run/step_01", saved[1])


def test_a_chmod_after_the_commit_reaches_the_store_without_its_bytes(
        mounts: MountFactory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    args = ["--persist", f"file://{root}", "--keep-ram", "1", "--commit-idle", "0.5"]
    mnt = mounts.mount(*args)
    content = files(1)
    save_step(mnt / "run/step_1", content)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    shard = "run/step_1/__0_0.distcp"
    inode = os.stat(root / shard).st_ino
    version = mnt.step("run/step_1")["version"]

    os.chmod(mnt / shard, 0o640)
    wait_until(lambda: mnt.step("run/step_1")["version"] > version
               and mnt.step("run/step_1")["persisted"], timeout=30)
    assert os.stat(root / shard).st_ino == inode  # the object was not sent again
    save_step(mnt / "run/step_2", files(2))  # step_1 leaves RAM
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: not mnt.step("run/step_1")["ram"], timeout=30)
    assert os.stat(mnt / shard).st_mode & 0o7777 == 0o640
    tierfs("umount", str(mnt.mountpoint))
    fresh = mounts.mount("--persist", f"file://{root}")
    assert os.stat(fresh / shard).st_mode & 0o7777 == 0o640
    assert (fresh / shard).read_bytes() == content["__0_0.distcp"]


def test_peers_learn_a_rename(mounts: MountFactory, token_file: Path,  # noqa: F811
                              etcd_server: Etcd) -> None:
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = (cluster.start(n) for n in ("node0", "node1"))
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    content = files(1)
    save_step(node0 / "run/step_1", content)
    wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
    shutil.move(node0 / "run", node0 / "run-old")
    wait_until(lambda: all(listed(n) == ["run-old/step_1"] for n in (node0, node1)),
               timeout=30)
    wait_until(lambda: deletes_done(node0), timeout=30)
    node1.kill9()
    node1 = cluster.start("node1")
    wait_until(lambda: listed(node1) == ["run-old/step_1"], timeout=20)
    assert_files(node1 / "run-old/step_1", content)
