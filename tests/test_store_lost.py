"""A store that lost what tierfs put in it (a bucket deleted and made again under a running
mount, a store directory emptied, a mount without the store the steps went to): tierfs checks
what the store holds before it acts on its own "persisted" mark. No copy leaves RAM for a
store that lacks it, the step goes up again, `tierfs verify` writes no manifest whose files
the store lacks, and a step in no tier is shown lost, never persisted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MountFactory, fill, tierfs, wait_until
from tests.test_crash import save
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = pytest.mark.fuse


def step_files(seed: int) -> dict[str, bytes]:
    return {"shard.distcp": os.urandom(2 << 20) + bytes([seed]), ".metadata": b"m%d" % seed}


def stored_keys(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    reply = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for o in reply.get("Contents", [])}


def make_bucket_again(client: Any, bucket: str) -> None:
    """What an operator's `aws s3 rb --force` and `aws s3 mb` do."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    client.delete_bucket(Bucket=bucket)
    client.create_bucket(Bucket=bucket)


def test_a_bucket_made_again_gets_its_steps_again_before_they_leave_ram(
        mounts: MountFactory, s3_server: SeaweedS3, s3_env: dict[str, str],
        bucket: str) -> None:
    """The issue's case: with --keep-ram 1, the next step reaching the bucket made again
    evicted the older step's only copy onto nothing. Now the store is asked first: the
    older step goes up again, and leaves RAM only once the store holds it."""
    client = s3_server.client()
    mnt = mounts.mount("--persist", f"s3://{bucket}/ckpt", "--keep-ram", "1", env=s3_env)
    first = step_files(1)
    save(mnt / "run/step_1", first)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert "ckpt/run/step_1/.tierfs-manifest" in stored_keys(client, bucket, "ckpt/")

    make_bucket_again(client, bucket)
    save(mnt / "run/step_2", step_files(2))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")

    def step_1_stored() -> bool:
        keys = stored_keys(client, bucket, "ckpt/run/step_1/")
        return keys.get("ckpt/run/step_1/shard.distcp") == len(first["shard.distcp"]) and \
            "ckpt/run/step_1/.tierfs-manifest" in keys

    wait_until(step_1_stored, timeout=60)
    wait_until(lambda: mnt.step("run/step_1")["ram"] is False, timeout=30)  # now it may go
    assert mnt.step("run/step_1")["persisted"] is True
    assert "the persistent tier lacks 2 of the 2 files of run/step_1 v1" in mnt.log()
    for name, data in first.items():
        assert (mnt / "run/step_1" / name).read_bytes() == data


def test_verify_writes_no_manifest_whose_files_the_store_lacks(mounts: MountFactory,
                                                               tmp_path: Path) -> None:
    """Steps that left RAM, then the store lost them (step_1 whole, step_2 one file):
    `tierfs verify` reports the lost files and writes nothing into the store; the steps are
    shown incomplete, no longer persisted, and what the store still holds stays readable."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1")
    saved = {number: step_files(number) for number in (1, 2, 3)}
    for number, files in saved.items():
        save(mnt / f"run/step_{number}", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: not mnt.step("run/step_1")["ram"] and not mnt.step("run/step_2")["ram"])
    shutil.rmtree(store / "run/step_1")  # the store loses it; its mark stays
    (store / "run/step_2/shard.distcp").unlink()

    done = tierfs("verify", str(mnt / "run"), "--json", check=False)
    assert done.returncode == 1, done.stderr
    lost = {step["path"]: sorted(step["lost"]) for step in json.loads(done.stdout)["steps"]}
    assert lost == {"run/step_1": [".metadata", "shard.distcp"], "run/step_2": ["shard.distcp"],
                    "run/step_3": []}
    assert not (store / "run/step_1").exists()  # no manifest written back, nothing else
    for number, files in ((1, 2), (2, 1)):
        status = mnt.step(f"run/step_{number}")
        assert status["persisted"] is False and status["state"] == "incomplete"
        assert status["lost"]["files"] == files
        assert "the persistent tier held it and no longer does" in json.dumps(status["lost"])
    assert (mnt / "run/step_2/.metadata").read_bytes() == saved[2][".metadata"]
    assert os.readlink(mnt / "run/latest") == "step_3"


def test_the_steps_a_store_lost_are_checked_at_mount(mounts: MountFactory,
                                                     tmp_path: Path) -> None:
    """The RAM dir's marks are checked against the store at mount: a step in RAM that the
    store lost goes up again, one that had left RAM is lost (not persisted, `latest` moves
    back); and a mount without the store such steps went to is refused with one line."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1")
    saved = {number: step_files(number) for number in (1, 2)}
    for number, files in saved.items():
        save(mnt / f"run/step_{number}", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: mnt.step("run/step_1")["ram"] is False)
    tierfs("umount", str(mnt.mountpoint))

    done = tierfs("mount", str(mnt.mountpoint), "--ram-dir", str(mnt.ram_dir), check=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert (f"tierfs: RAM dir {mnt.ram_dir} records 1 step whose files are only in a "
            "persistent tier (run/step_1): mount with --persist") in done.stderr

    shutil.rmtree(store / "run")  # both steps gone from the store; its mark stays
    again = mounts.remount(mnt)
    lost = again.step("run/step_1")
    assert lost["persisted"] is False and lost["state"] == "incomplete"
    assert os.readlink(again / "run/latest") == "step_2"
    wait_until(lambda: (store / "run/step_2/.tierfs-manifest").exists(), timeout=30)
    wait_until(lambda: again.step("run/step_2")["persisted"])
    assert (store / "run/step_2/shard.distcp").read_bytes() == saved[2]["shard.distcp"]
    assert not (store / "run/step_1").exists()


def test_a_persisted_mark_with_no_room_waits_and_the_upload_is_not_repeated(
        small_shm: Path, mounts: MountFactory, tmp_path: Path) -> None:
    """The RAM dir's file system full (a shared /dev/shm) when an upload ends: the persisted
    mark cannot be written. Before, the step went up again and again (about 100,000 log lines
    in 5 minutes) and `flush` timed out with ENOSPC. Now the mark waits for room, the step
    counts as persisted (the store holds it) but stays in RAM until its mark is on disk, and
    the log says it once."""
    store, away = tmp_path / "store", tmp_path / "store.away"
    store.mkdir()
    ram_dir = small_shm / "ram"
    mnt = mounts.mount("--persist", f"file://{store}", ram_dir=ram_dir)
    store.rename(away)  # the upload waits for the store...
    files = {"shard.distcp": os.urandom(100_000), ".metadata": b"m"}
    save(mnt / "run/step_1", files)
    wait_until(lambda: "upload of run/step_1 v1 failed" in mnt.log())
    fill(small_shm / "other-user")  # ...while another user fills /dev/shm
    away.rename(store)

    wait_until(lambda: "the persisted mark of run/step_1 v1 cannot be written" in mnt.log(),
               timeout=60)
    done = tierfs("flush", str(mnt.mountpoint), "--timeout", "20", check=False)
    assert done.returncode == 0, done.stderr
    assert mnt.step("run/step_1")["persisted"] is True and mnt.step("run/step_1")["ram"]
    log = mnt.log()
    assert log.count("Step run/step_1: persisted to") == 1
    assert log.count("cannot be written") == 1 and "Traceback" not in log

    (small_shm / "other-user").unlink()
    mark = ram_dir / "tree/run/step_1/.tierfs-persisted"
    wait_until(lambda: mark.exists() and mark.read_text() == "1 persisted\n", timeout=10)
    # (logged once the mark is on disk: the line may come just after the file)
    wait_until(lambda: "the persisted mark of run/step_1 v1 is written" in mnt.log(), timeout=10)
    assert mnt.log().count("Step run/step_1: persisted to") == 1
