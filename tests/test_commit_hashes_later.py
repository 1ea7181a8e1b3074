"""A saver's commit does not wait for its files' hashes (issue 25, fs.model.pending_commits).

Hashing is made observably late for real: the daemon's hash threads are all taken (the control
socket's `hold_hashes`) while an unmodified DCP save runs in a process of its own. The save
returns, the step is `committed` and `latest` names it, yet nothing of it reaches the store
until the hashes are in; a daemon killed in between comes back with the step committed,
hashed, then persisted; a writer rewriting a file of the step meanwhile starts a new version
and the committed bytes stay as they were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import xxhash

from tests.conftest import Mount, MountFactory, getxattr, pid_alive, tierfs, wait_until
from tierfs import manifest as mf
from tierfs import reserved
from tierfs.mount_helper import control
from tierfs.mount_helper.mounts import is_mounted

pytestmark = pytest.mark.frameworks

SAVE = """
import sys, torch, torch.distributed.checkpoint as dcp
state = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 8 MiB
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[1], thread_count=2))
"""


def hold_hashes(mnt: Mount, hold: bool) -> None:
    socket_path, _root, _rel = control.locate(str(mnt.mountpoint))
    control.request(socket_path, {"cmd": "hold_hashes", "hold": hold})


def save_with_hashes_held(mnt: Mount, step: Path) -> None:
    """An unmodified DCP save into `step`, every hash thread of the daemon taken meanwhile: it
    must return (a commit that waited for the hashes would wait until the timeout)."""
    step.parent.mkdir(parents=True, exist_ok=True)
    hold_hashes(mnt, True)
    saved = subprocess.run([sys.executable, "-c", SAVE, str(step)], capture_output=True,
                           text=True, timeout=60)
    assert saved.returncode == 0, saved.stderr


def hashes_of(step: Path) -> dict[str, str]:
    return {p.name: xxhash.xxh3_128_hexdigest(p.read_bytes())
            for p in sorted(step.iterdir()) if p.is_file()}


def manifest_of(mnt: Mount, relpath: str) -> mf.StepManifest | None:
    path = mnt.ram_dir / "tree" / relpath / mf.MANIFEST_NAME
    return mf.decode(path.read_bytes()) if path.exists() else None


def saved_to_a_store(mounts: MountFactory, tmp_path: Path, relpath: str
                     ) -> tuple[Mount, Path, Path]:
    """A mount persisting to a file:// store, and a DCP save into `relpath` with its hashes
    held: (the mount, the store, the step)."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    step = mnt / relpath
    save_with_hashes_held(mnt, step)
    return mnt, store, step


def test_dcp_save_returns_before_its_files_are_hashed(mounts: MountFactory,
                                                      tmp_path: Path) -> None:
    mnt, store, step = saved_to_a_store(mounts, tmp_path, "run/step_1")
    # Committed and named by `latest` at once, its hashes not in: no manifest, nothing stored.
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert os.readlink(mnt / "run/latest") == "step_1"
    line = mnt.step("run/step_1")
    assert line is not None
    assert (line["state"], line["hashing"], line["persisted"], line["version"]) == (
        "committed", True, False, 1)
    assert manifest_of(mnt, "run/step_1") is None
    assert (mnt.ram_dir / "tree/run/step_1" / reserved.PENDING).exists()
    assert not (store / "run").exists() or not any((store / "run").rglob("*"))
    expected = hashes_of(step)  # read back while hashing is held: the committed bytes
    hold_hashes(mnt, False)
    line = wait_until(lambda: (s := mnt.step("run/step_1")) and s["persisted"] and s, 30)
    assert (line["state"], line["hashing"], line["version"]) == ("committed", False, 1)
    manifest = manifest_of(mnt, "run/step_1")
    assert manifest is not None and manifest.version == 1
    assert {e.name: e.xxh3 for e in manifest.files} == expected
    for name, digest in expected.items():
        assert getxattr(step / name, "user.tierfs.xxh3") == digest
        assert xxhash.xxh3_128_hexdigest((store / "run/step_1" / name).read_bytes()) == digest
    assert not (mnt.ram_dir / "tree/run/step_1" / reserved.PENDING).exists()
    assert not [n for n in os.listdir(mnt.ram_dir / "objects") if n.startswith(reserved.SNAPSHOT)]
    tierfs("verify", str(step), "--no-repair")
    assert "Traceback" not in mnt.log()


def test_daemon_killed_before_the_hashes_finishes_the_commit_at_start(
        mounts: MountFactory, tmp_path: Path) -> None:
    mnt, store, step = saved_to_a_store(mounts, tmp_path, "run/step_3")
    assert getxattr(step, "user.tierfs.state") == "committed"
    expected = hashes_of(step)
    mnt.kill9()  # the commit made, its hashes not: SIGKILL
    assert not (store / "run/step_3").exists()
    mnt = mounts.remount(mnt)
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert os.readlink(mnt / "run/latest") == "step_3"
    manifest = manifest_of(mnt, "run/step_3")
    assert manifest is not None and manifest.version == 1
    assert {e.name: e.xxh3 for e in manifest.files} == expected
    assert hashes_of(step) == expected
    wait_until(lambda: (s := mnt.step("run/step_3")) and s["persisted"], 30)
    assert {n: xxhash.xxh3_128_hexdigest((store / "run/step_3" / n).read_bytes())
            for n in expected} == expected
    assert "hashed now" in mnt.log()
    tierfs("verify", str(step), "--no-repair")


def test_a_daemon_stopped_while_hashing_exits_and_finishes_the_commit_at_start(
        mounts: MountFactory, tmp_path: Path) -> None:
    """SIGTERM while a committed step's hashes are not in, and another step waits for a
    hash at the unmount's last commits: the daemon stops (it used to wait for its held hash
    threads forever), and the next one finishes both."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--commit-idle", "300")
    quiet = mnt / "run/step_8"  # committed by the unmount, its file hashed then, in a thread
    quiet.mkdir(parents=True)
    (quiet / "weights.bin").write_bytes(os.urandom(1 << 20))
    step = mnt / "run/step_7"
    save_with_hashes_held(mnt, step)
    expected = hashes_of(step)
    os.kill(mnt.pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(mnt.pid), timeout=20)
    mnt = mounts.remount(mnt)
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert getxattr(quiet, "user.tierfs.state") == "committed"
    assert hashes_of(step) == expected
    wait_until(lambda: all((s := mnt.step(f"run/step_{n}")) and s["persisted"]
                           for n in (7, 8)), 30)
    assert {e.name: e.xxh3 for e in manifest_of(mnt, "run/step_7").files} == expected
    tierfs("verify", str(step), "--no-repair")


def test_umount_flush_waits_for_the_hashes_and_the_store(mounts: MountFactory,
                                                          tmp_path: Path) -> None:
    """`tierfs umount` right after a save whose hashes are still being computed: it refuses
    (the step is due in the store and not there yet: `tierfs flush` said nothing waited, and
    the unmount's last commits waited for the hashes), `tierfs flush` waits for it; with
    --flush it waits for the hashes, then the store, then unmounts; nothing is left to
    finish at the next start."""
    mnt, store, step = saved_to_a_store(mounts, tmp_path, "run/step_9")
    expected = hashes_of(step)
    refused = tierfs("umount", str(mnt.mountpoint), check=False)
    assert refused.returncode != 0 and "not unmounted" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and is_mounted(mnt.mountpoint)
    waited = tierfs("flush", str(mnt.mountpoint), "--timeout", "1", check=False)
    assert waited.returncode != 0 and "run/step_9 (hashing)" in waited.stderr, waited.stderr
    threading.Timer(1.0, hold_hashes, (mnt, False)).start()  # the hashes finish meanwhile
    tierfs("umount", "--flush", str(mnt.mountpoint))
    assert not is_mounted(mnt.mountpoint)
    assert {n: xxhash.xxh3_128_hexdigest((store / "run/step_9" / n).read_bytes())
            for n in expected} == expected
    assert not (mnt.ram_dir / "tree/run/step_9" / reserved.PENDING).exists()
    mnt = mounts.remount(mnt)
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert "hashed now" not in mnt.log()  # this mount's own log: nothing was left pending


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "no-passthrough"])
def test_a_writer_during_the_hashes_starts_a_new_version(mounts: MountFactory,
                                                          passthrough: bool) -> None:
    mnt = mounts.mount(*(() if passthrough else ("--no-passthrough",)))
    step = mnt / "run/step_5"
    save_with_hashes_held(mnt, step)
    expected = hashes_of(step)
    shard = sorted(n for n in expected if n.endswith(".distcp"))[0]
    with open(step / shard, "r+b") as f:  # rewrites the committed file while it is hashed
        f.seek(4096)
        f.write(b"x" * 8192)
    rewritten = xxhash.xxh3_128_hexdigest((step / shard).read_bytes())
    assert rewritten != expected[shard]
    assert getxattr(step, "user.tierfs.state") == "writing"  # a new version, being written
    hold_hashes(mnt, False)
    # The committed version is the save's bytes, whole, and stays readable.
    manifest = wait_until(lambda: manifest_of(mnt, "run/step_5"), 30)
    assert manifest.version == 1
    assert {e.name: e.xxh3 for e in manifest.files} == expected
    for entry in manifest.files:
        held = (mnt.ram_dir / "objects" / entry.xxh3).read_bytes()
        assert xxhash.xxh3_128_hexdigest(held) == entry.xxh3
    assert xxhash.xxh3_128_hexdigest((step / shard).read_bytes()) == rewritten
    tierfs("commit", str(step))
    second = manifest_of(mnt, "run/step_5")
    assert second is not None and second.version == 2
    assert second.entry(shard).xxh3 == rewritten
    assert getxattr(step, "user.tierfs.state") == "committed"
    tierfs("verify", str(step), "--no-repair")
    assert "Traceback" not in mnt.log()


def test_verify_and_prefetch_right_after_the_save(mounts: MountFactory,
                                                  tmp_path: Path) -> None:
    """A step shown `committed` whose hashes are still to come: `tierfs prefetch` finds it
    whole in RAM at once, and `tierfs verify` waits for the hashes (hashing the only copy is
    what checks it) and reports the step; both used to fail ("not a committed step", "holds
    no committed step") while status and the xattr said committed."""
    mnt, _store, step = saved_to_a_store(mounts, tmp_path, "run/step_2")
    expected = hashes_of(step)
    assert getxattr(step, "user.tierfs.state") == "committed"
    fetched = tierfs("prefetch", str(step), check=False, timeout=30)
    assert fetched.returncode == 0, fetched.stderr
    threading.Timer(1.0, hold_hashes, (mnt, False)).start()  # the hashes finish meanwhile
    done = tierfs("verify", str(step), "--no-repair", "--json", check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    (report,) = json.loads(done.stdout)["steps"]
    assert (report["path"], report["version"], report["files"], report["ok"]) == (
        "run/step_2", 1, len(expected), True)
    assert next(t for t in report["tiers"] if t["tier"] == "ram")["good"] == len(expected)
    assert {e.name: e.xxh3 for e in manifest_of(mnt, "run/step_2").files} == expected
