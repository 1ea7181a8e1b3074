"""Real frameworks, unmodified, through a real mount with a file:// persistent tier: every
checkpoint they write commits with no extra call, `tierfs flush` persists it, their own rotation
deletes stick (also on a fresh node), and a fresh node (empty RAM dir, same store) reads the
newest one back and resumes from it. The frameworks run in subprocesses (tests/framework_jobs.py)
with HF_HUB_OFFLINE=1: tiny models built in code, random data, no download."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, MountFactory, free_port, tierfs, wait_until

pytestmark = pytest.mark.frameworks

JOBS = Path(__file__).with_name("framework_jobs.py")
IDLE = "1"  # --commit-idle: above the pauses inside one save of these tiny models


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip when a framework is not installed (find_spec: no import in the test process)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


def run_job(tmp_path: Path, *args: str) -> dict[str, Any]:
    """One framework job in a subprocess; its last line of output is a JSON result."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"),
               TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, str(JOBS), *args], capture_output=True, text=True,
                          timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def store_node(mounts: MountFactory, store: Path) -> Mount:
    """A node on the shared store; a new one each call has an empty RAM dir."""
    return mounts.mount("--persist", f"file://{store}", "--commit-idle", IDLE)


def steps_under(mnt: Mount, run: str) -> dict[str, str]:
    return {s["path"]: s["state"] for s in mnt.status()["steps"]
            if s["path"].startswith(run + "/")}


def commits_logged(mnt: Mount, step: str) -> int:
    return len(re.findall(rf"Step {re.escape(step)}( v\d+)?: RAM commit in", mnt.log()))


def wait_committed(mnt: Mount, run: str, expected: list[str], timeout: float = 10) -> None:
    """Wait until the steps under `run` are exactly `expected`, all committed; else fail with
    what status shows."""
    want = dict.fromkeys(expected, "committed")
    try:
        wait_until(lambda: steps_under(mnt, run) == want, timeout=timeout)
    except AssertionError:
        assert steps_under(mnt, run) == want


@needs("transformers", "safetensors", "accelerate")
def test_hf_trainer_save_rotate_resume(mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    node = store_node(mounts, store)
    assert run_job(tmp_path, "hf", str(node / "out"), "6")["global_step"] == 6
    # Every checkpoint committed by itself, also checkpoint-2 before save_total_limit removed it.
    wait_committed(node, "out", ["out/checkpoint-4", "out/checkpoint-6"])
    for n in (2, 4, 6):
        assert commits_logged(node, f"out/checkpoint-{n}") >= 1, n
    assert os.readlink(node / "out/latest") == "checkpoint-6"
    manifest_files = node.step("out/checkpoint-6")["files"]
    assert manifest_files == len(os.listdir(node / "out/checkpoint-6")) >= 7
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    wait_until(lambda: sorted(os.listdir(store / "out")) == ["checkpoint-4", "checkpoint-6"])
    weights = (node / "out/checkpoint-6/model.safetensors").read_bytes()
    tierfs("umount", str(node.mountpoint))

    # A fresh node finds the newest checkpoint in the store and the Trainer resumes from it;
    # its rotation then deletes checkpoint-4, which this node has only in the store.
    fresh = store_node(mounts, store)
    assert sorted(steps_under(fresh, "out")) == ["out/checkpoint-4", "out/checkpoint-6"]
    assert (fresh / "out/checkpoint-6/model.safetensors").read_bytes() == weights
    resumed = run_job(tmp_path, "hf", str(fresh / "out"), "8", "resume")
    assert resumed == {"global_step": 8, "steps_run": 2}
    wait_committed(fresh, "out", ["out/checkpoint-6", "out/checkpoint-8"])
    tierfs("flush", str(fresh.mountpoint), "--timeout", "60")
    wait_until(lambda: sorted(os.listdir(store / "out")) == ["checkpoint-6", "checkpoint-8"])

    third = store_node(mounts, store)
    assert sorted(steps_under(third, "out")) == ["out/checkpoint-6", "out/checkpoint-8"]
    assert not (third / "out/checkpoint-2").exists()
    assert not (third / "out/checkpoint-4").exists()
    state = json.loads((third / "out/latest/trainer_state.json").read_text())
    assert state["global_step"] == 8


@needs("safetensors")
def test_torch_save_and_safetensors_steps(mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    node = store_node(mounts, store)
    run_job(tmp_path, "save", str(node / "run"), "1", "2", "3")
    # step_1 and step_2 commit when the next step is made, step_3 once quiet: no call at all.
    wait_committed(node, "run", ["run/step_1", "run/step_2", "run/step_3"])
    assert [node.step(f"run/step_{n}")["files"] for n in (1, 2, 3)] == [2, 2, 2]
    run_job(tmp_path, "load", str(node / "run"), "1", "2", "3")
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    assert sorted(os.listdir(store / "run")) == ["step_1", "step_2", "step_3"]

    fresh = store_node(mounts, store)
    assert os.readlink(fresh / "run/latest") == "step_3"
    run_job(tmp_path, "load", str(fresh / "run"), "1", "2", "3")


@needs("lightning")
def test_lightning_checkpoints_and_resume(mounts: MountFactory, tmp_path: Path) -> None:
    """Lightning's ModelCheckpoint writes single files (`epoch=0-step=2.ckpt`) outside any step
    directory: each commits when its writer closes it, like a step (a file step); so does
    `last.ckpt` (`save_last=True`), a loose file written whole at each save, from which a
    fresh node resumes (`fit(ckpt_path="last")`)."""
    store = tmp_path / "store"
    store.mkdir()
    node = store_node(mounts, store)
    assert run_job(tmp_path, "lightning", str(node / "run"), "4")["global_step"] == 4
    ckpts = ["run/epoch=0-step=2.ckpt", "run/epoch=0-step=4.ckpt", "run/last.ckpt"]
    assert all((node / ckpt).is_file() for ckpt in ckpts)
    wait_committed(node, "run", ckpts, timeout=3)
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    data = (node / "run/last.ckpt").read_bytes()
    tierfs("umount", str(node.mountpoint))

    fresh = store_node(mounts, store)
    assert (fresh / "run/last.ckpt").read_bytes() == data
    resumed = run_job(tmp_path, "lightning", str(fresh / "run"), "6", "last")
    assert resumed == {"global_step": 6, "start_step": 4}
    # (named last-v1.ckpt: the resumed state names the first node's last.ckpt, another path)
    wait_committed(fresh, "run", [*ckpts, "run/epoch=0-step=6.ckpt", "run/last-v1.ckpt"])


@needs("lightning")
def test_lightning_last_link_comes_back_on_a_fresh_node(mounts: MountFactory,
                                                        tmp_path: Path) -> None:
    """`ModelCheckpoint(save_last="link")` makes `last.ckpt` a relative symbolic link to the
    newest checkpoint: part of the run directory's committed state, so that `fit(ckpt_path=
    "last")` on a fresh node resumes (it trained from step 0 when the link was lost). A link
    out of the mount stays in this node's RAM dir only, and status says so."""
    store = tmp_path / "store"
    store.mkdir()
    node = store_node(mounts, store)
    assert run_job(tmp_path, "lightning-link", str(node / "run"), "4")["global_step"] == 4
    assert os.readlink(node / "run/last.ckpt") == "epoch=0-step=4.ckpt"
    os.symlink("/etc/hostname", node / "run/outside")
    wait_until(lambda: (store / "run/.tierfs-links").exists(), timeout=15)
    assert node.status()["ram_only_links"] == ["run/outside"]
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    tierfs("umount", str(node.mountpoint))

    fresh = store_node(mounts, store)
    assert os.readlink(fresh / "run/last.ckpt") == "epoch=0-step=4.ckpt"
    assert not os.path.lexists(fresh / "run/outside")
    resumed = run_job(tmp_path, "lightning-link", str(fresh / "run"), "6", "last")
    assert resumed == {"global_step": 6, "start_step": 4}
    # (named last-v1.ckpt: the resumed state names the first node's last.ckpt, another path)
    links = {p.name: os.readlink(p) for p in (fresh / "run").glob("last*.ckpt")}
    assert "epoch=0-step=6.ckpt" in links.values(), links
    wait_until(lambda: b"epoch=0-step=6.ckpt" in (store / "run/.tierfs-links").read_bytes(),
               timeout=15)


@needs("deepspeed")
def test_deepspeed_save_and_resume_on_a_fresh_node(mounts: MountFactory, tmp_path: Path) -> None:
    """DeepSpeed's real engine (CPU, gloo, ZeRO stage 1): its `latest` file comes after its
    step committed (its checkpoint engine's commit lasts past --commit-idle, as a barrier with
    slower nodes does) and is a real file there, never tierfs's link (it was EISDIR). With
    --persist-every 4 and saves at 2, 4, 6, the store's `latest` names global_step4, the
    newest step the store has, so a fresh node's `load_checkpoint` resumes from it."""
    store = tmp_path / "store"
    store.mkdir()
    node = mounts.mount("--persist", f"file://{store}", "--commit-idle", IDLE,
                        "--persist-every", "4")
    first = run_job(tmp_path, "deepspeed", str(node / "ds"), "6", str(free_port()))
    assert sorted(first["saved"]) == ["2", "4", "6"]
    assert (node / "ds/latest").read_text() == "global_step6"
    assert not os.path.islink(node / "ds/latest")
    # beside the steps: its recovery scripts, loose files like `latest`
    wait_committed(node, "ds", ["ds/global_step2", "ds/global_step4", "ds/global_step6",
                                "ds/latest", "ds/zero_to_fp32.py", "ds/zero_to_torch.py"])
    assert node.status()["own_latest"] == ["ds"]
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    assert (store / "ds/latest").read_text() == "global_step4"  # never past the store
    assert [name for name in sorted(os.listdir(store / "ds")) if "global_step" in name] == [
        "global_step4"]
    tierfs("umount", str(node.mountpoint))

    fresh = store_node(mounts, store)
    resumed = run_job(tmp_path, "deepspeed", str(fresh / "ds"), "8", str(free_port()),
                      "resume")
    assert resumed["loaded_step"] == 4
    assert resumed["weights_at_load"] == first["saved"]["4"]
    assert resumed["global_step"] == 8 and sorted(resumed["saved"]) == ["6", "8"]
    assert (fresh / "ds/latest").read_text() == "global_step8"


@needs("deepspeed")
def test_deepspeed_saving_fast_leaves_the_store_a_tracker_to_resume_from(
        mounts: MountFactory, tmp_path: Path) -> None:
    """DeepSpeed's own engine, saving at steps 2, 4 and 6 faster than --commit-idle (30 s
    here; 5 s by default against saves seconds apart): its `latest` commits at each close,
    with the step it names, and with --persist-every 4 the store gets the version naming
    global_step4, the newest step it holds, although the current one names global_step6. A
    flush right after the job, then the node is lost: a fresh node's `load_checkpoint`
    resumes from step 4 (the store had no tracker: it returned None, training restarted at
    step 0)."""
    store = tmp_path / "store"
    store.mkdir()
    node = mounts.mount("--persist", f"file://{store}", "--commit-idle", "30",
                        "--persist-every", "4")
    first = run_job(tmp_path, "deepspeed", str(node / "ds"), "6", str(free_port()), "nowait")
    assert sorted(first["saved"]) == ["2", "4", "6"]
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    assert (store / "ds/latest").read_text() == "global_step4"
    assert (node / "ds/latest").read_text() == "global_step6"
    node.kill9()

    fresh = store_node(mounts, store)
    resumed = run_job(tmp_path, "deepspeed", str(fresh / "ds"), "8", str(free_port()),
                      "resume", "nowait")
    assert resumed["loaded_step"] == 4
    assert resumed["weights_at_load"] == first["saved"]["4"]


@needs("transformers", "safetensors", "accelerate")
def test_hf_trainer_killed_in_a_save_leaves_latest_on_the_step_before(
        mounts: MountFactory, tmp_path: Path) -> None:
    """HF Trainer killed (SIGKILL) in the middle of writing checkpoint-4, before its RNG state
    and trainer_state.json: the files it wrote commit once quiet, but checkpoint-2 has
    trainer_state.json and checkpoint-4 does not, so `latest` names checkpoint-2, here and on
    a fresh node, and status says what checkpoint-4 lacks (`latest` named checkpoint-4, and a
    resume from it failed on the missing trainer_state.json). The Trainer resumes from
    `latest` on the fresh node and saves checkpoint-4 whole again."""
    store = tmp_path / "store"
    store.mkdir()
    node = store_node(mounts, store)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    died = subprocess.run([sys.executable, str(JOBS), "hf", str(node / "out"), "6",
                           "die-at=4"], capture_output=True, text=True, timeout=180, env=env)
    assert died.returncode == -9, died.stderr[-2000:]
    assert not (node / "out/checkpoint-4/trainer_state.json").exists()
    wait_committed(node, "out", ["out/checkpoint-2", "out/checkpoint-4"])
    assert os.readlink(node / "out/latest") == "checkpoint-2"
    assert node.step("out/checkpoint-4")["unfinished"] == "trainer_state.json"
    assert node.step("out/checkpoint-2")["unfinished"] is None
    assert ("warning: out/checkpoint-4 was committed without trainer_state.json" in
            tierfs("status", str(node.mountpoint)).stdout)
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    tierfs("umount", str(node.mountpoint))

    fresh = store_node(mounts, store)
    assert os.readlink(fresh / "out/latest") == "checkpoint-2"
    assert fresh.step("out/checkpoint-4")["unfinished"] == "trainer_state.json"
    resumed = run_job(tmp_path, "hf", str(fresh / "out"), "6",
                      f"resume={fresh / 'out/latest'}")
    assert resumed == {"global_step": 6, "steps_run": 4}
    wait_committed(fresh, "out", ["out/checkpoint-4", "out/checkpoint-6"])
    assert (fresh / "out/checkpoint-4/trainer_state.json").exists()
    assert fresh.step("out/checkpoint-4")["unfinished"] is None
    assert os.readlink(fresh / "out/latest") == "checkpoint-6"


@needs("deepspeed")
def test_deepspeed_custom_tags_are_steps(mounts: MountFactory, tmp_path: Path) -> None:
    """`save_checkpoint(dir, tag="mytag_N")`: no step name, but DeepSpeed's `latest` names each
    tag, so each is a step (numbered N), committed whole, subject to --persist-every, a step
    again after a restart and on a fresh node, which resumes from it (their files committed
    one by one as loose files, --persist-every ignored)."""
    store = tmp_path / "store"
    store.mkdir()
    args = ("--persist", f"file://{store}", "--commit-idle", IDLE, "--persist-every", "4")
    node = mounts.mount(*args)
    first = run_job(tmp_path, "deepspeed", str(node / "ds"), "6", str(free_port()), "nowait",
                    "tag=mytag_")
    tags = ["ds/mytag_2", "ds/mytag_4", "ds/mytag_6"]
    wait_until(lambda: all((node.step(t) or {}).get("state") == "committed" for t in tags),
               timeout=15)
    assert [(node.step(t)["step"], node.step(t)["kind"]) for t in tags] == [
        (2, "dir"), (4, "dir"), (6, "dir")]
    assert not [s["path"] for s in node.status()["steps"] if s["path"].startswith("ds/mytag_")
                and s["path"] not in tags]
    tierfs("flush", str(node.mountpoint), "--timeout", "60")
    assert sorted(n for n in os.listdir(store / "ds") if n.startswith("mytag")) == ["mytag_4"]
    assert (store / "ds/mytag_4/.tierfs-manifest").is_file()
    assert (store / "ds/latest").read_text() == "mytag_4"
    tierfs("umount", str(node.mountpoint))
    again = mounts.remount(node, *args)
    assert [(again.step(t) or {}).get("state") for t in tags] == ["committed"] * 3
    tierfs("umount", str(again.mountpoint))

    fresh = store_node(mounts, store)
    assert fresh.step("ds/mytag_4")["step"] == 4
    resumed = run_job(tmp_path, "deepspeed", str(fresh / "ds"), "8", str(free_port()),
                      "resume", "nowait", "tag=mytag_")
    assert resumed["loaded_step"] == 4
    assert resumed["weights_at_load"] == first["saved"]["4"]
