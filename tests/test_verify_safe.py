"""`tierfs verify` is safe: `--no-repair` changes and removes nothing, a repair copies only from
a copy that is itself verified good against the manifest (size included), and a RAM copy that
disagrees with its manifest when no other copy matches is kept, never destroyed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import xxhash

from tests.conftest import Mount, MountFactory, getxattr, tierfs
from tests.faults.results_io import flip_byte
from tests.test_crash import save

pytestmark = pytest.mark.fuse

SHARD = "shard"


def verify(mnt: Mount, relpath: str, *extra: str) -> tuple[int, dict]:
    done = tierfs("verify", str(mnt / relpath), "--json", *extra, check=False)
    return done.returncode, json.loads(done.stdout)


def tier(report: dict, name: str) -> dict:
    (step,) = report["steps"]
    return next(t for t in step["tiers"] if t["tier"] == name)


def object_of(mnt: Mount, path: Path) -> Path:
    return mnt.ram_dir / "objects" / getxattr(path, "user.tierfs.xxh3")


def persisted_step(mounts: MountFactory, tmp_path: Path) -> tuple[Mount, Path, bytes]:
    """A mount with a file:// store holding run/step_1 (one 3 MiB shard), flushed."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    data = os.urandom(3 << 20)
    save(mnt / "run/step_1", {SHARD: data, ".metadata": b"m"})
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    return mnt, store, data


def test_no_repair_changes_nothing(mounts: MountFactory, tmp_path: Path) -> None:
    mnt, store, data = persisted_step(mounts, tmp_path)
    obj = object_of(mnt, mnt / "run/step_1" / SHARD)
    flip_byte(obj, 1000)
    bad = obj.read_bytes()
    with open(store / "run/step_1" / SHARD, "ab") as f:
        f.write(b"longer than its manifest says")  # every chunk still matches
    stored = (store / "run/step_1" / SHARD).read_bytes()
    code, report = verify(mnt, "run/step_1", "--no-repair")
    assert code == 1
    assert tier(report, "ram")["bad"] == [SHARD]
    assert tier(report, "persist")["bad"] == [SHARD]
    # nothing changed, nothing removed: the RAM object, the tree, the store, the listing
    assert obj.read_bytes() == bad
    assert os.path.samefile(obj, mnt.ram_dir / "tree/run/step_1" / SHARD)
    assert (store / "run/step_1" / SHARD).read_bytes() == stored
    assert mnt.step("run/step_1")["ram"] and mnt.step("run/step_1")["persisted"]
    assert not (mnt.ram_dir / "quarantine").exists()


def test_a_copy_no_repair_found_bad_is_not_served_again(mounts: MountFactory,
                                                        tmp_path: Path) -> None:
    """`--no-repair` changes nothing, but the bad RAM copy it found is never served: before,
    the next read returned the flipped byte (the copy had been verified at start, so no open
    checked it again). Now its next open takes it out of service (its bytes kept) and the
    read comes from the store, verified."""
    mnt, store, data = persisted_step(mounts, tmp_path)
    path = mnt / "run/step_1" / SHARD
    obj = object_of(mnt, path)
    flip_byte(obj, 1000)
    code, report = verify(mnt, "run/step_1", "--no-repair")
    assert code == 1 and tier(report, "ram")["bad"] == [SHARD]
    assert not (mnt.ram_dir / "quarantine").exists()  # nothing changed by the report
    assert path.read_bytes() == data
    assert (mnt.ram_dir / "quarantine/run/step_1" / f"{SHARD}.v1").exists()
    assert "its next open takes it out of service" in mnt.log()


def test_repair_comes_only_from_a_verified_copy(mounts: MountFactory, tmp_path: Path) -> None:
    """A RAM copy and a store copy that agree with each other but not with the manifest (a
    wrong seal, or the same bytes damaged twice): neither replaces the other, the RAM copy's
    bytes are kept and reported, and a verified copy, once there, repairs it."""
    mnt, store, data = persisted_step(mounts, tmp_path)
    flip_byte(object_of(mnt, mnt / "run/step_1" / SHARD), 5)
    flip_byte(store / "run/step_1" / SHARD, 5)
    damaged = (store / "run/step_1" / SHARD).read_bytes()
    code, report = verify(mnt, "run/step_1")
    assert code == 1
    ram = tier(report, "ram")
    assert ram["bad"] == [SHARD] and not ram["repaired"]
    (kept,) = ram["kept"]
    assert Path(kept).read_bytes() == damaged  # the RAM copy's bytes, not destroyed
    assert (store / "run/step_1" / SHARD).read_bytes() == damaged  # nor "repaired" from RAM

    # the operator puts a good copy back in the store: the next verify repairs RAM from it
    (store / "run/step_1" / SHARD).write_bytes(data)
    code, report = verify(mnt, "run/step_1")
    assert code == 0, report
    assert tier(report, "ram")["repaired"] == [SHARD]
    assert (mnt / "run/step_1" / SHARD).read_bytes() == data
    assert not Path(kept).exists()


def test_a_wrong_empty_seal_is_not_repaired_to_empty(mounts: MountFactory) -> None:
    """The manifest says a file is empty but RAM holds bytes (the issue's `echo hello > x`):
    with no other copy at all, verify must not "repair" the bytes to the empty content."""
    mnt = mounts.mount()
    save(mnt / "run/step_1", {"x": b"", ".metadata": b"m"})
    assert getxattr(mnt / "run/step_1/x", "user.tierfs.xxh3") == xxhash.xxh3_128_hexdigest(b"")
    (object_of(mnt, mnt / "run/step_1/x")).write_bytes(b"hello\n")
    code, report = verify(mnt, "run/step_1")
    assert code == 1
    ram = tier(report, "ram")
    assert ram["bad"] == ["x"] and not ram["repaired"]
    assert [Path(p).read_bytes() for p in ram["kept"]] == [b"hello\n"]
