"""Single-file checkpoints (file steps: `epoch=0-step=5.ckpt`, `model_1000.pt`) and the other
loose files outside step directories (`last.ckpt`, `config.json`): through real mounts with a
file:// persistent tier. A file step commits when its writer closes it (or a rename puts it in
place); a loose file too if its writer wrote it whole, else once it is quiet (an appended log);
both are persisted, come back on a fresh node, are
versioned and evicted like steps, and their deletes stick on every tier."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tierfs.fs.model.nodes import DEFAULT_FILE_STEP_PATTERN

pytestmark = pytest.mark.fuse

IDLE = "1"


def file_step_number(name: str) -> int | None:
    match = re.match(DEFAULT_FILE_STEP_PATTERN, name)
    return None if match is None else int(match.group(1))


@pytest.mark.parametrize(("name", "number"), [
    ("epoch=0-step=5.ckpt", 5), ("epoch=3-step=120-v1.ckpt", 120), ("model_1000.pt", 1000),
    ("ckpt-500.safetensors", 500), ("step_100.pt", 100), ("checkpoint-7.bin", 7),
    ("iter_0000100.pt", 100), ("global_step30.pt", 30),
    ("last.ckpt", None), ("last-v1.ckpt", None), ("config.json", None),
    ("latest_checkpointed_iteration.txt", None), ("latest", None),
    ("mp_rank_00_model_states.pt", None), ("run11.pt", None), ("v2.pt", None),
])
def test_file_step_pattern(name: str, number: int | None) -> None:
    assert file_step_number(name) == number


def store_node(mounts: MountFactory, store: Path, *extra: str) -> Mount:
    """A node on the shared store; a new one each call has an empty RAM dir."""
    return mounts.mount("--persist", f"file://{store}", "--commit-idle", IDLE, *extra)


def state(mnt: Mount, path: str) -> str | None:
    step = mnt.step(path)
    return None if step is None else step["state"]


def wait_state(mnt: Mount, path: str, want: str | None, timeout: float = 10) -> None:
    try:
        wait_until(lambda: state(mnt, path) == want, timeout=timeout)
    except AssertionError:
        assert state(mnt, path) == want


def flush(mnt: Mount) -> None:
    tierfs("flush", str(mnt.mountpoint), "--timeout", "30")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


def test_file_steps_commit_at_close_persist_and_come_back(mounts: MountFactory,
                                                          store: Path) -> None:
    node = store_node(mounts, store, "--commit-idle", "60")  # no quiet commit in this test
    (node / "run").mkdir()
    lightning = node / "run/epoch=0-step=5.ckpt"
    torch_save = node / "run/model_1000.pt"
    lightning.write_bytes(b"L" * 300_000)
    with open(os.open(torch_save, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(b"T" * 1000)
    # Committed by the close alone: no call, no wait for --commit-idle.
    for path in ("run/epoch=0-step=5.ckpt", "run/model_1000.pt"):
        wait_state(node, path, "committed", timeout=3)
    assert node.step("run/epoch=0-step=5.ckpt")["step"] == 5
    assert node.step("run/model_1000.pt")["files"] == 1
    flush(node)
    assert (store / "run/epoch=0-step=5.ckpt").read_bytes() == b"L" * 300_000  # as in the mount
    assert (store / "run/model_1000.pt").read_bytes() == b"T" * 1000
    assert node.step("run/model_1000.pt")["persisted"]
    mode = stat.S_IMODE(os.stat(torch_save).st_mode)
    tierfs("umount", str(node.mountpoint))

    fresh = store_node(mounts, store)
    assert sorted(os.listdir(fresh / "run")) == ["epoch=0-step=5.ckpt", "model_1000.pt"]
    assert state(fresh, "run/model_1000.pt") == "committed"
    assert (fresh / "run/epoch=0-step=5.ckpt").read_bytes() == b"L" * 300_000
    assert (fresh / "run/model_1000.pt").read_bytes() == b"T" * 1000
    assert stat.S_IMODE(os.stat(fresh / "run/model_1000.pt").st_mode) == mode == 0o600


def test_rewrite_is_v2_and_rm_sticks_everywhere(mounts: MountFactory, store: Path) -> None:
    node = store_node(mounts, store)
    (node / "run").mkdir()
    ckpt = node / "run/step_100.pt"
    ckpt.write_bytes(b"one")
    wait_state(node, "run/step_100.pt", "committed")
    ckpt.write_bytes(b"two!")
    wait_until(lambda: (node.step("run/step_100.pt") or {}).get("version") == 2)
    assert ckpt.read_bytes() == b"two!"
    (node / "run/step_200.pt").write_bytes(b"next")
    wait_state(node, "run/step_200.pt", "committed")
    flush(node)
    assert (store / "run/step_100.pt").read_bytes() == b"two!"

    # Lightning's save_top_k rotation: the old checkpoint goes, from every tier.
    os.unlink(ckpt)
    wait_until(lambda: not (store / "run/step_100.pt").exists())
    assert not [n for n in os.listdir(store / "run") if "step_100" in n]
    assert node.step("run/step_100.pt") is None
    tierfs("umount", str(node.mountpoint))

    fresh = store_node(mounts, store)
    assert os.listdir(fresh / "run") == ["step_200.pt"]
    assert (fresh / "run/step_200.pt").read_bytes() == b"next"
    os.unlink(fresh / "run/step_200.pt")  # a delete of a file only in the store
    wait_until(lambda: not (store / "run/step_200.pt").exists())
    tierfs("umount", str(fresh.mountpoint))
    third = store_node(mounts, store)
    assert not (third / "run/step_200.pt").exists()
    assert not (third / "run/step_100.pt").exists()


def test_keep_ram_evicts_file_steps_and_reads_them_back(mounts: MountFactory,
                                                        store: Path) -> None:
    node = store_node(mounts, store, "--keep-ram", "1")
    (node / "run").mkdir()
    datas = {n: bytes([n]) * 200_000 for n in (1, 2, 3)}
    for n, data in datas.items():
        (node / f"run/ckpt-{n}.safetensors").write_bytes(data)
        wait_state(node, f"run/ckpt-{n}.safetensors", "committed")
    flush(node)
    # Only the newest stays in RAM: the others are counted with the run's steps and leave.
    wait_until(lambda: [node.step(f"run/ckpt-{n}.safetensors")["ram"] for n in (1, 2, 3)]
               == [False, False, True])
    assert (node / "run/ckpt-1.safetensors").read_bytes() == datas[1]


def test_loose_files_persist_once_quiet_and_come_back(mounts: MountFactory,
                                                      store: Path) -> None:
    node = store_node(mounts, store)
    (node / "run").mkdir()
    loose = {"run/last.ckpt": b"last", "run/config.json": b"{}",
             # Megatron-LM's tracker of a release checkpoint names no step: a plain loose file
             "run/latest_checkpointed_iteration.txt": b"release\n", "notes.txt": b"top"}
    for path, data in loose.items():
        (node / path).write_bytes(data)
    for path in loose:
        wait_state(node, path, "committed")
        assert node.step(path)["step"] is None
    flush(node)
    assert {p: (store / p).read_bytes() for p in loose} == loose
    # A loose file is never what `latest` names.
    assert not (node / "run/latest").exists()
    tierfs("umount", str(node.mountpoint))

    fresh = store_node(mounts, store)
    assert sorted(os.listdir(fresh / "run")) == sorted(
        ["last.ckpt", "config.json", "latest_checkpointed_iteration.txt"])
    assert {p: (fresh / p).read_bytes() for p in loose} == loose


def test_file_inside_a_step_directory_is_part_of_the_step(mounts: MountFactory,
                                                          store: Path) -> None:
    node = store_node(mounts, store)
    (node / "run/step_5").mkdir(parents=True)
    (node / "run/step_5/mp_rank_00_model_states.pt").write_bytes(b"m")
    (node / "run/step_5/model_7.pt").write_bytes(b"x")
    wait_state(node, "run/step_5", "committed")
    assert node.step("run/step_5")["files"] == 2
    assert node.step("run/step_5/model_7.pt") is None
    flush(node)
    assert sorted(os.listdir(store / "run/step_5")) == [
        ".tierfs-manifest", "model_7.pt", "mp_rank_00_model_states.pt"]


def test_rename_of_a_temp_file_onto_a_file_step_name_commits(mounts: MountFactory,
                                                             store: Path) -> None:
    node = store_node(mounts, store, "--commit-idle", "60")
    (node / "run").mkdir()
    tmp = node / "run/x.tmp"
    tmp.write_bytes(b"saved")
    os.rename(tmp, node / "run/epoch=0-step=5.ckpt")
    wait_state(node, "run/epoch=0-step=5.ckpt", "committed", timeout=3)
    assert state(node, "run/x.tmp") is None
    flush(node)
    assert (store / "run/epoch=0-step=5.ckpt").read_bytes() == b"saved"
    assert not (store / "run/x.tmp").exists()


def test_status_warns_of_single_files_only_in_ram(mounts: MountFactory) -> None:
    node = mounts.mount("--commit-idle", IDLE)  # no persistent tier, no peer
    (node / "run").mkdir()
    (node / "run/model_5.pt").write_bytes(b"5")
    (node / "run/last.ckpt").write_bytes(b"last")
    wait_state(node, "run/last.ckpt", "committed")
    shown = tierfs("status", str(node.mountpoint)).stdout
    warning = next(line for line in shown.splitlines() if "only in this node's RAM" in line)
    assert "run/model_5.pt" in warning and "run/last.ckpt" in warning


def test_file_step_pattern_option(mounts: MountFactory) -> None:
    node = mounts.mount("--commit-idle", "60", "--file-step-pattern", r"^snap([0-9]+)\.data$")
    (node / "snap7.data").write_bytes(b"7")
    wait_state(node, "snap7.data", "committed", timeout=3)
    assert node.step("snap7.data")["step"] == 7
    (node / "model_5.pt").write_bytes(b"5")  # not a file step by this pattern: a loose file
    wait_state(node, "model_5.pt", "committed", timeout=3)  # written whole
    assert node.step("model_5.pt")["step"] is None
    bad = tierfs("mount", str(node.mountpoint) + "-x", "--file-step-pattern", "snap", check=False)
    assert bad.returncode != 0 and "--file-step-pattern" in bad.stderr


def test_tierfs_commit_of_a_loose_file(mounts: MountFactory) -> None:
    node = mounts.mount("--commit-idle", "60")
    (node / "train.log").write_bytes(b"step 1\n")  # written whole: committed at once
    wait_state(node, "train.log", "committed", timeout=3)
    with open(node / "train.log", "ab") as log:
        log.write(b"step 2\n")
    assert state(node, "train.log") == "writing"  # appended: it waits to be quiet
    tierfs("commit", str(node / "train.log"))
    assert state(node, "train.log") == "committed"
    assert node.step("train.log")["version"] == 2


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "no-passthrough"])
def test_a_file_step_is_held_in_ram_once(mounts: MountFactory, passthrough: bool) -> None:
    """torch.save's one big file: its bytes become the committed object as they are, not a
    private copy of them made while its writer still had it open (which held it twice in RAM
    and made the close wait for the copy)."""
    node = mounts.mount("--commit-idle", "60", *(() if passthrough else ("--no-passthrough",)))
    size = 8 << 20
    path = node / "model_7.pt"
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    wait_state(node, "model_7.pt", "committed", timeout=3)
    assert node.status()["ram"]["used_bytes"] < size * 1.5
