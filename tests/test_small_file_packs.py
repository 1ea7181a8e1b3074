"""A step of many small files in the persistent tier (real SeaweedFS, real mounts): its files
stay plain objects with their bytes, its small files are packed beside them, and a fresh node
reads the step back with a handful of requests, not one per file; a pack that is corrupt,
short or gone still reads back right (file by file); a renamed, a deleted and a retired step
leave no pack behind at the old name."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tests.test_s3 import persist_args
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = pytest.mark.fuse

SMALL_FILES = 400  # well above packs.MIN_FILES; a handful of requests against 401
FILE_BYTES = 4096
PREFIX = "ckpt/"


def small_files(seed: int, count: int = SMALL_FILES) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"t{i:05}.distcp": rng.randbytes(FILE_BYTES) for i in range(count)}


def save_step(step: Path, files: dict[str, bytes]) -> None:
    step.mkdir(parents=True)
    for name, data in files.items():
        (step / name).write_bytes(data)
    (step / ".metadata").write_bytes(b"m" * 100)  # commits it, as DCP's does


def stored(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    """Key (below the step's prefix) -> size of every object under `prefix`."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                              Prefix=PREFIX + prefix)
    return {o["Key"][len(PREFIX + prefix):]: o["Size"] for page in pages
            for o in page.get("Contents", [])}


def read_back(node: Mount, step: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (node / step / name).read_bytes() == data, name


def requests(node: Mount) -> int:
    return node.status()["persist"]["read_requests"]


def test_a_fresh_node_reads_a_packed_step_back_with_a_handful_of_requests(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str, s3_env: dict[str, str]
        ) -> None:
    """A fresh node reads a step of 400 small files back out of its packs: a handful of GETs
    (the index and the packs), not one per file."""
    mnt = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    files = small_files(1)
    save_step(mnt / "run/step_1", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=s3_env)

    # the store's plain objects are as they were: every file's bytes under its own key
    client = s3_server.client()
    keys = stored(client, bucket, "run/step_1/")
    assert {name for name in keys if not name.startswith(".tierfs-")} == {*files, ".metadata"}
    for name, data in files.items():
        body = client.get_object(Bucket=bucket, Key=f"{PREFIX}run/step_1/{name}")["Body"]
        assert body.read() == data
    assert {".tierfs-pack-0", ".tierfs-packs", ".tierfs-manifest"} <= set(keys)
    assert keys[".tierfs-pack-0"] == SMALL_FILES * FILE_BYTES + 100  # with .metadata
    assert mnt.status()["persist"]["pack_bytes"] >= keys[".tierfs-pack-0"]

    fresh = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    before = requests(fresh)
    read_back(fresh, "run/step_1", files)
    assert requests(fresh) - before <= 10


@pytest.mark.parametrize("damage", ["corrupt", "short", "deleted"])
def test_a_damaged_pack_still_reads_back_right(mounts: MountFactory, s3_server: SeaweedS3,
                                               bucket: str, s3_env: dict[str, str],
                                               damage: str) -> None:
    """A pack is a cache: every file is checked against the manifest, and a pack found bad
    sends its step's reads to the plain objects."""
    mnt = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    files = small_files(2, 200)
    save_step(mnt / "run/step_1", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=s3_env)
    client = s3_server.client()
    key = f"{PREFIX}run/step_1/.tierfs-pack-0"
    pack = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    if damage == "corrupt":  # same size, other bytes in every file
        client.put_object(Bucket=bucket, Key=key, Body=bytes(b ^ 0xFF for b in pack))
    elif damage == "short":
        client.put_object(Bucket=bucket, Key=key, Body=pack[:len(pack) // 2])
    else:
        client.delete_object(Bucket=bucket, Key=key)

    fresh = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    read_back(fresh, "run/step_1", files)
    assert "packs of run/step_1" in fresh.log()
    assert requests(fresh) > len(files)  # file by file


def test_renamed_deleted_and_retired_steps_leave_no_pack_behind(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str, s3_env: dict[str, str]
        ) -> None:
    """A step renamed while in RAM is packed anew at its new name, one renamed after it left
    RAM gets its old name's packs copied; the old names keep nothing, nor do a removed step
    and one retention retired."""
    args = persist_args(s3_server, bucket, "--keep-ram", "2", "--keep-persist", "3")
    mnt = mounts.mount(*args, env=s3_env)
    saved = {number: small_files(number, 100) for number in (1, 2, 3, 4, 5)}
    for number in (1, 2, 3):
        save_step(mnt / f"run/step_{number}", saved[number])
    tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=s3_env)
    wait_until(lambda: not mnt.step("run/step_1")["ram"], timeout=30)  # only in the store
    client = s3_server.client()

    os.rename(mnt / "run/step_1", mnt / "run/step_11")  # its files only in the store
    os.rename(mnt / "run/step_3", mnt / "run/step_13")  # its files in RAM
    shutil.rmtree(mnt / "run/step_2")

    def steps() -> set[str]:
        return {key.split("/")[0] for key in stored(client, bucket, "run/")}

    wait_until(lambda: steps() == {"step_11", "step_13"}, timeout=60)
    for name in ("step_11", "step_13"):
        keys = stored(client, bucket, f"run/{name}/")
        assert {".tierfs-pack-0", ".tierfs-packs", ".tierfs-manifest"} <= set(keys), name
    fresh = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    before = requests(fresh)
    read_back(fresh, "run/step_13", saved[3])
    read_back(fresh, "run/step_11", saved[1])
    assert requests(fresh) - before <= 10
    assert "are not used" not in fresh.log()

    # retention keeps three steps of the run: the oldest (step_11) goes, packs and all
    for number in (4, 5):
        save_step(mnt / f"run/step_1{number}", saved[number])
    tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=s3_env)
    wait_until(lambda: steps() == {"step_13", "step_14", "step_15"}, timeout=60)
    assert not stored(client, bucket, "run/step_11/")
