"""Unmodified savers through a real mount with a file:// persistent tier: each checkpoint
commits with no extra call (its step goes quiet, or the saver starts the next one), `tierfs
flush` persists it, a fresh node (empty RAM dir, same store) reads it back, and the saver's own
rotation deletes stick. Step names as trainers write them; nested directories are part of
their step."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, getxattr, tierfs, wait_until
from tierfs.fs.model.nodes import DEFAULT_STEP_PATTERN
from tierfs.mount_helper.config import ConfigError, resolve

pytestmark = pytest.mark.frameworks

IDLE = "0.3"  # --commit-idle in these tests: seconds of quiet before a step commits


def test_default_step_pattern_knows_trainers_names() -> None:
    def number(name: str) -> int | None:
        match = re.match(DEFAULT_STEP_PATTERN, name)
        return int(match.group(1)) if match else None

    for name, expected in [("step_100", 100), ("step-100", 100), ("global_step100", 100),
                           ("checkpoint-500", 500), ("iter_0000100", 100), ("100", 100),
                           ("ckpt_7", 7)]:
        assert number(name) == expected, name
    for name in ("run11", "layer_3", "mp_rank_00", "v2", "level49", "checkpoint-best"):
        assert number(name) is None, name


def test_commit_idle_option(tmp_path: Path) -> None:
    assert resolve(str(tmp_path), {}, {}, None).commit_idle == 5.0
    assert resolve(str(tmp_path), {"commit_idle": "0.5"}, {}, None).commit_idle == 0.5
    with pytest.raises(ConfigError, match="--commit-idle must be a positive"):
        resolve(str(tmp_path), {"commit_idle": "0"}, {}, None)


def write(path: Path, data: bytes) -> None:
    """Plain file I/O, as every saver does it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def state(mnt: Mount, step: str) -> str:
    return getxattr(mnt / step, "user.tierfs.state")


def committed(mnt: Mount, step: str, version: int = 1) -> bool:
    info = mnt.step(step)
    return info is not None and info["state"] == "committed" and info["version"] == version


def store_mount(mounts: MountFactory, store: Path, *extra: str) -> Mount:
    return mounts.mount("--persist", f"file://{store}", "--commit-idle", IDLE, *extra)


def check_fresh_node(mounts: MountFactory, store: Path, expected: dict[str, bytes],
                     gone: list[str]) -> Mount:
    """A new node (empty RAM dir) on the same store lists and reads every committed file."""
    fresh = mounts.mount("--persist", f"file://{store}")
    for rel, data in expected.items():
        assert (fresh / rel).read_bytes() == data, rel
    for rel in gone:
        assert not (fresh / rel).exists(), rel
    return fresh


def test_torch_save_steps_commit_by_idle_and_next_step(mounts: MountFactory,
                                                      tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    store = tmp_path / "store"
    store.mkdir()
    # A long idle time: only the next step's mkdir can commit step_1 within the test.
    mnt = mounts.mount("--persist", f"file://{store}", "--commit-idle", "600")
    tensors = {"w": torch.arange(1000, dtype=torch.float32)}
    (mnt / "run/step_1").mkdir(parents=True)
    torch.save(tensors, mnt / "run/step_1/model.pt")
    assert state(mnt, "run/step_1") == "writing"
    (mnt / "run/step_2").mkdir()
    wait_until(lambda: committed(mnt, "run/step_1"))
    torch.save(tensors, mnt / "run/step_2/model.pt")
    assert state(mnt, "run/step_2") == "writing"
    # step_2 commits by itself only 600 s after its last change: the flush says so at once
    flushed = tierfs("flush", str(mnt.mountpoint), "--timeout", "60", check=False)
    assert flushed.returncode == 1 and "run/step_2 (commits by itself in " in flushed.stderr, \
        flushed.stderr
    wait_until(lambda: (store / "run/step_1/.tierfs-manifest").exists(), timeout=60)
    assert (store / "run/step_1/model.pt").exists()
    fresh = mounts.mount("--persist", f"file://{store}")
    loaded = torch.load(fresh / "run/step_1/model.pt", mmap=True)
    assert torch.equal(loaded["w"], tensors["w"])
    assert not (fresh / "run/step_2").exists()  # never committed: not in the store


def test_clean_umount_commits_quiet_steps(mounts: MountFactory) -> None:
    mnt = mounts.mount("--commit-idle", "600")
    write(mnt / "run/step_3/model.pt", b"weights" * 1000)
    assert state(mnt, "run/step_3") == "writing"
    tierfs("umount", str(mnt.mountpoint))
    again = mounts.remount(mnt)
    assert state(again, "run/step_3") == "committed"
    assert (again / "run/step_3/model.pt").read_bytes() == b"weights" * 1000
    # a re-save after that is a new version, also committed by the next clean unmount
    write(again / "run/step_3/model.pt", b"better" * 1000)
    tierfs("umount", str(again.mountpoint))
    third = mounts.remount(again)
    assert committed(third, "run/step_3", version=2)
    assert (third / "run/step_3/model.pt").read_bytes() == b"better" * 1000


def test_nested_directories_belong_to_their_step(mounts: MountFactory) -> None:
    mnt = mounts.mount("--commit-idle", IDLE)
    write(mnt / "run/step_2/model.pt", b"m")
    wait_until(lambda: committed(mnt, "run/step_2"))
    # A sub-directory, whatever its name, is part of the step: the step commits again with it.
    write(mnt / "run/step_2/layer_3/w.pt", b"l")
    write(mnt / "run/step_2/step_1/w.pt", b"s")
    wait_until(lambda: committed(mnt, "run/step_2", version=2))
    assert [s["path"] for s in mnt.status()["steps"]] == ["run/step_2"]
    assert state(mnt, "run/step_2") == "committed"
    assert os.readlink(mnt / "run/latest") == "step_2"
    # A step moved into another step becomes part of it.
    write(mnt / "run/step_5/a.pt", b"a")
    wait_until(lambda: committed(mnt, "run/step_5"))
    os.rename(mnt / "run/step_5", mnt / "run/step_2/step_5")
    wait_until(lambda: committed(mnt, "run/step_2", version=3))
    assert [s["path"] for s in mnt.status()["steps"]] == ["run/step_2"]
    # ... and the same after a restart
    tierfs("umount", str(mnt.mountpoint))
    again = mounts.remount(mnt)
    assert [(s["path"], s["version"], s["files"]) for s in again.status()["steps"]] == [
        ("run/step_2", 3, 4)]
    assert (again / "run/step_2/step_5/a.pt").read_bytes() == b"a"


def test_hf_trainer_shaped_checkpoints(mounts: MountFactory, tmp_path: Path) -> None:
    """transformers' Trainer: checkpoint-N/ with config, weights, optimizer, trainer state;
    save_total_limit=2 deletes the oldest checkpoint directory after each save."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = store_mount(mounts, store)
    out = mnt / "out"
    expected: dict[str, bytes] = {}
    gone: list[str] = []
    for step in (10, 20, 30):
        ckpt = out / f"checkpoint-{step}"
        files = {"config.json": json.dumps({"hidden": 8}).encode(),
                 "model.safetensors": os.urandom(200_000), "optimizer.pt": os.urandom(100_000),
                 "scheduler.pt": b"s%d" % step, "rng_state.pth": os.urandom(1000),
                 "trainer_state.json": json.dumps({"global_step": step}).encode()}
        for name, data in files.items():
            write(ckpt / name, data)
            expected[f"out/checkpoint-{step}/{name}"] = data
        wait_until(lambda s=step: committed(mnt, f"out/checkpoint-{s}"))
        if step > 20:  # rotation: rm -r of the oldest checkpoint
            old = out / f"checkpoint-{step - 20}"
            for name in os.listdir(old):
                os.unlink(old / name)
            os.rmdir(old)
            gone.append(f"out/checkpoint-{step - 20}")
            expected = {k: v for k, v in expected.items() if not k.startswith(gone[-1] + "/")}
    assert os.readlink(out / "latest") == "checkpoint-30"
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert sorted(os.listdir(store / "out")) == ["checkpoint-20", "checkpoint-30"]
    fresh = check_fresh_node(mounts, store, expected, gone)
    assert os.readlink(fresh / "out/latest") == "checkpoint-30"


def test_megatron_shaped_tree(mounts: MountFactory, tmp_path: Path) -> None:
    """Megatron-LM: iter_0000100/mp_rank_00/model_optim_rng.pt, and a tracker file beside."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = store_mount(mounts, store)
    expected = {}
    for it in (100, 200):
        for rank in ("mp_rank_00", "mp_rank_01"):
            rel = f"ckpt/iter_{it:07d}/{rank}/model_optim_rng.pt"
            expected[rel] = os.urandom(50_000)
            write(mnt / rel, expected[rel])
        write(mnt / "ckpt/latest_checkpointed_iteration.txt", str(it).encode())
    # The tracker file is a loose file: persisted once quiet, back on a fresh node.
    tracker = "ckpt/latest_checkpointed_iteration.txt"
    expected[tracker] = b"200"
    wait_until(lambda: committed(mnt, "ckpt/iter_0000100") and committed(mnt,
                                                                          "ckpt/iter_0000200"))
    wait_until(lambda: mnt.step(tracker)["state"] == "committed")
    assert [s["path"] for s in mnt.status()["steps"]] == [tracker, "ckpt/iter_0000100",
                                                          "ckpt/iter_0000200"]
    assert mnt.step("ckpt/iter_0000200")["files"] == 2
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    check_fresh_node(mounts, store, expected, [])


def test_megatron_tracker_in_the_store_never_names_a_step_it_lacks(mounts: MountFactory,
                                                                   tmp_path: Path) -> None:
    """Megatron-LM's order: the iteration's directory, then (rank 0, after a barrier longer than
    --commit-idle here) `latest_checkpointed_iteration.txt` naming it. With --persist-every 100
    and iterations 50, 100, 150, the store's tracker says 100, the newest iteration it has, so a
    fresh node resumes; iteration 200 then moves it. Plain file I/O: megatron-core 0.16.1 (the
    newest for Python 3.11) cannot save on a CPU-only torch (its torch_dist writer calls
    torch.cuda.synchronize)."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = store_mount(mounts, store, "--persist-every", "100")
    tracker = "ckpt/latest_checkpointed_iteration.txt"
    weights = {}

    def save(iteration: int, version: int) -> None:
        rel = f"ckpt/iter_{iteration:07d}/mp_rank_00/model_optim_rng.pt"
        weights[iteration] = os.urandom(30_000)
        write(mnt / rel, weights[iteration])
        wait_until(lambda: committed(mnt, f"ckpt/iter_{iteration:07d}"))
        write(mnt / tracker, str(iteration).encode())
        wait_until(lambda: committed(mnt, tracker, version))

    for version, iteration in enumerate((50, 100, 150), 1):
        save(iteration, version)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert sorted(n for n in os.listdir(store / "ckpt") if n.startswith("iter_")) == [
        "iter_0000100"]
    assert (store / tracker).read_text() == "100"  # not 150: the store lacks it
    assert mnt.step(tracker)["persisted"] is False  # its version saying 150 stays in RAM
    fresh = mounts.mount("--persist", f"file://{store}")
    resume = int((fresh / tracker).read_text())
    assert (fresh / f"ckpt/iter_{resume:07d}/mp_rank_00/model_optim_rng.pt").read_bytes() == (
        weights[100])

    save(200, 4)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert (store / tracker).read_text() == "200"


def test_megatron_iterations_faster_than_commit_idle_leave_a_tracker_to_resume_from(
        mounts: MountFactory, tmp_path: Path) -> None:
    """Megatron-LM's order with torch.save, iterations 0.15 s apart (its tracker rewritten far
    more often than --commit-idle, 5 s here as by default), --persist-every 2 and
    --keep-persist 2. A flush right after the job, then the node is lost: the store has a
    tracker naming the newest iteration it holds (it had none at all: the tracker was never
    quiet long enough to commit), which a fresh node loads."""
    import torch

    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--persist-every", "2",
                       "--keep-persist", "2")
    tracker = "ckpt/latest_checkpointed_iteration.txt"
    for iteration in range(1, 13):
        rank_dir = mnt / f"ckpt/iter_{iteration:07d}/mp_rank_00"
        rank_dir.mkdir(parents=True)
        torch.save({"iteration": iteration, "weight": torch.full((256, 256), iteration)},
                   rank_dir / "model_optim_rng.pt")
        write(mnt / tracker, str(iteration).encode())
        time.sleep(0.15)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert (store / tracker).read_text() == "12"
    assert sorted(n for n in os.listdir(store / "ckpt") if n.startswith("iter_")) == [
        "iter_0000010", "iter_0000012"]
    mnt.kill9()

    fresh = mounts.mount("--persist", f"file://{store}")
    resume = int((fresh / tracker).read_text())
    loaded = torch.load(fresh / f"ckpt/iter_{resume:07d}/mp_rank_00/model_optim_rng.pt")
    assert loaded["iteration"] == resume == 12
    assert torch.equal(loaded["weight"], torch.full((256, 256), 12))


def test_deepspeed_shaped_tree(mounts: MountFactory, tmp_path: Path) -> None:
    """DeepSpeed: global_stepN/ with model and ZeRO optimizer states, and its own `latest`
    file naming the newest tag; rotation removes old tags."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = store_mount(mounts, store)
    expected = {}
    for step in (100, 200):
        tag = f"global_step{step}"
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            expected[f"run/{tag}/{name}"] = os.urandom(40_000)
            write(mnt / f"run/{tag}/{name}", expected[f"run/{tag}/{name}"])
        write(mnt / "run/latest", tag.encode())
        wait_until(lambda t=tag: committed(mnt, f"run/{t}"))
    assert (mnt / "run/latest").read_bytes() == b"global_step200"  # its own file wins
    for name in os.listdir(mnt / "run/global_step100"):
        os.unlink(mnt / "run/global_step100" / name)
    os.rmdir(mnt / "run/global_step100")
    expected = {k: v for k, v in expected.items() if "global_step100" not in k}
    expected["run/latest"] = b"global_step200"  # a loose file: persisted once quiet
    wait_until(lambda: mnt.step("run/latest")["state"] == "committed")
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: not (store / "run/global_step100").exists())
    check_fresh_node(mounts, store, expected, ["run/global_step100"])


def test_dcp_step_without_metadata_waits_for_it(mounts: MountFactory) -> None:
    """A DCP save cut short (shards, no .metadata) never commits by itself: it waits for its
    .metadata, which then commits it at once."""
    mnt = mounts.mount("--commit-idle", IDLE)
    write(mnt / "run/step_1/__0_0.distcp", b"shard")
    (mnt / "run/step_2").mkdir()  # the next step does not commit it either
    wait_until(lambda: ".metadata" in (mnt.step("run/step_1")["waiting_for"] or ""))
    assert state(mnt, "run/step_1") == "writing"
    write(mnt / "run/step_1/.metadata", b"meta")
    assert state(mnt, "run/step_1") == "committed"
