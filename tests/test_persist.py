"""The persistent tier through a real mount: uploads in the contract's layout, persist-every,
keep-persist retention, flush, status and xattrs; file:// here, S3 in test_s3.py."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import MountFactory, getxattr, tierfs, wait_until
from tests.test_crash import save
from tierfs import manifest as mf
from tierfs.mount_helper.mounts import is_mounted

pytestmark = pytest.mark.fuse


def step_files(seed: int) -> dict[str, bytes]:
    return {"__0_0.distcp": os.urandom(3 << 20), "__1_0.distcp": bytes([seed]) * 1000,
            ".metadata": b"meta%d" % seed}


def test_committed_steps_reach_file_store_in_plain_layout(mounts: MountFactory,
                                                         tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    files = step_files(1)
    save(mnt / "run1/step_100", files)
    done = tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert "every committed step is in" in done.stdout
    for name, data in files.items():
        assert (store / "run1/step_100" / name).read_bytes() == data
    manifest = mf.decode((store / "run1/step_100/.tierfs-manifest").read_bytes())
    assert {f.name: f.size for f in manifest.files} == {k: len(v) for k, v in files.items()}
    assert mnt.step("run1/step_100")["persisted"] is True
    assert getxattr(mnt / "run1/step_100", "user.tierfs.tiers") == "ram,persist"
    assert getxattr(mnt / "run1/step_100/.metadata", "user.tierfs.tiers") == "ram,persist"
    assert f"Step run1/step_100: persisted to file://{store} in " in mnt.log()

    # a re-save replaces the step in the store; the manifest names the new version
    files2 = step_files(2)
    save(mnt / "run1/step_100", files2)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert (store / "run1/step_100/__0_0.distcp").read_bytes() == files2["__0_0.distcp"]
    assert mf.decode((store / "run1/step_100/.tierfs-manifest").read_bytes()).version == 2

    # after a restart the step is known to be persisted and not uploaded again
    mnt.kill9()
    again = mounts.remount(mnt)
    assert again.step("run1/step_100")["persisted"] is True
    assert again.status()["persist"]["pending_steps"] == 0


def test_persist_every_and_keep_persist(mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--persist-every", "20",
                       "--keep-persist", "2")
    for number in (10, 20, 30, 40, 50, 60):
        save(mnt / f"job/step_{number}", step_files(number))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert sorted(os.listdir(store / "job")) == ["step_40", "step_60"]
    steps = {s["path"]: s for s in mnt.status()["steps"]}
    assert [p for p, s in steps.items() if s["persisted"]] == ["job/step_40", "job/step_60"]
    assert all(s["state"] == "committed" and s["ram"] for s in steps.values())
    assert "retention removed job/step_20" in mnt.log()


def test_persist_mistakes_stop_the_mount(mounts: MountFactory, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mp"
    mountpoint.mkdir()
    ram = str(mounts.new_ram_dir())
    for url, message in [(f"file://{tmp_path}/missing", "does not exist"),
                         ("ftp://host/x", "use s3://bucket/prefix or file:///abs/path"),
                         ("s3://ab/x", "bucket names have 3 to 63 characters")]:
        done = tierfs("mount", str(mountpoint), "--ram-dir", ram, "--persist", url, check=False)
        assert done.returncode == 1 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_flush_without_persistent_tier(mounts: MountFactory) -> None:
    mnt = mounts.mount()
    assert "nothing to flush" in tierfs("flush", str(mnt.mountpoint)).stdout


def test_flush_right_after_a_save_waits_for_the_step_to_commit(mounts: MountFactory,
                                                               tmp_path: Path) -> None:
    """The job's last save (a saver with no completion mark, as `torch.save`), then `tierfs
    flush` at once, as an epilog does: the step and a loose file commit by themselves within
    --commit-idle, the flush waits for that and for the store, and exits 0 with both there
    (it exited 1 at once, saying they were not committed)."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--commit-idle", "3")
    model = os.urandom(1 << 20)
    (mnt / "run/step_5").mkdir(parents=True)
    (mnt / "run/step_5/model.pt").write_bytes(model)
    (mnt / "run/train.log").write_bytes(b"loss 0.1\n")
    assert mnt.step("run/step_5")["state"] == "writing"
    started = time.monotonic()
    done = tierfs("flush", str(mnt.mountpoint), "--timeout", "60", check=False)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    assert (store / "run/step_5/model.pt").read_bytes() == model
    assert (store / "run/step_5/.tierfs-manifest").exists()
    assert (store / "run/train.log").read_bytes() == b"loss 0.1\n"
    assert mnt.step("run/step_5")["persisted"] is True


def test_flush_says_at_once_what_keeps_a_step_from_committing(mounts: MountFactory,
                                                             tmp_path: Path) -> None:
    """A file held open for writing, or --commit-idle past the flush's --timeout: waiting
    cannot finish, so the flush exits 1 at once, naming the step and why; once the writer
    closes, the same flush waits for the quiet commit and exits 0."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--commit-idle", "3")
    (mnt / "run/step_1").mkdir(parents=True)
    with open(mnt / "run/step_1/model.pt", "wb") as held:
        held.write(b"half")
        held.flush()
        started = time.monotonic()
        done = tierfs("flush", str(mnt.mountpoint), "--timeout", "120", check=False)
        assert done.returncode == 1
        assert time.monotonic() - started < 30  # not its timeout
        assert ("1 step is not committed, so in no tier but this node's RAM, and waiting will "
                "not commit 1 of them within --timeout: run/step_1 (files open for writing: "
                "model.pt)") in done.stderr, done.stderr
        held.write(b" and the rest")
    done = tierfs("flush", str(mnt.mountpoint), "--timeout", "60", check=False)
    assert done.returncode == 0, done.stderr
    assert (store / "run/step_1/model.pt").read_bytes() == b"half and the rest"

    other = tmp_path / "other"
    other.mkdir()
    slow = mounts.mount("--persist", f"file://{other}", "--commit-idle", "600")
    (slow / "r/step_2").mkdir(parents=True)
    (slow / "r/step_2/model.pt").write_bytes(b"two")
    started = time.monotonic()
    done = tierfs("flush", str(slow.mountpoint), "--timeout", "60", check=False)
    assert done.returncode == 1 and time.monotonic() - started < 30
    assert "r/step_2 (commits by itself in 9m5" in done.stderr, done.stderr


def test_keep_ram_evicts_persisted_steps_and_reads_them_back(mounts: MountFactory,
                                                            tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "2")
    saved = {n: step_files(n) | {"big.bin": os.urandom(20 << 20)} for n in (1, 2, 3, 4)}
    for number, files in saved.items():
        save(mnt / f"run/step_{number}", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    steps = {s["path"]: s for s in mnt.status()["steps"]}
    assert [steps[f"run/step_{n}"]["ram"] for n in (1, 2, 3, 4)] == [False, False, True, True]
    assert all(s["persisted"] and s["state"] == "committed" for s in steps.values())
    assert getxattr(mnt / "run/step_1", "user.tierfs.tiers") == "persist"
    assert getxattr(mnt / "run/step_1/big.bin", "user.tierfs.tiers") == "persist"
    assert mnt.status()["ram"]["used_bytes"] < 3 * (24 << 20)
    # reading an evicted file fetches it back, verified, byte-identical
    with open(mnt / "run/step_1/big.bin", "rb") as f:
        f.seek(9 << 20)
        assert f.read(1000) == saved[1]["big.bin"][9 << 20:(9 << 20) + 1000]
    for name, data in saved[1].items():
        assert (mnt / "run/step_1" / name).read_bytes() == data
    assert getxattr(mnt / "run/step_1/big.bin", "user.tierfs.tiers") == "ram,persist"
    assert "is back in RAM" in mnt.log()
    assert os.path.getsize(mnt / "run/step_2/big.bin") == 20 << 20

    # a restart keeps the evicted steps listed and readable
    mnt.kill9()
    again = mounts.remount(mnt)
    assert (again / "run/step_2/big.bin").read_bytes() == saved[2]["big.bin"]
    assert os.readlink(again / "run/latest") == "step_4"


def test_fresh_node_finds_the_history_and_never_serves_corrupt_bytes(
        mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    first = mounts.mount("--persist", f"file://{store}")
    saved = {n: step_files(n) | {"big.bin": os.urandom(12 << 20)} for n in (10, 20)}
    for number, files in saved.items():
        save(first / f"job/step_{number}", files)
    tierfs("flush", str(first.mountpoint), "--timeout", "60")
    tierfs("umount", str(first.mountpoint))
    (store / "job/step_30").mkdir()
    (store / "job/step_30/__0_0.distcp").write_bytes(b"upload interrupted: no manifest")
    shard = store / "job/step_20/big.bin"
    data = bytearray(shard.read_bytes())
    data[9 << 20] ^= 0xFF  # one flipped byte in the second chunk
    shard.write_bytes(bytes(data))

    fresh = mounts.mount("--persist", f"file://{store}")  # new, empty RAM dir
    steps = {s["path"]: s for s in fresh.status()["steps"]}
    assert sorted(steps) == ["job/step_10", "job/step_20"]
    assert not any(s["ram"] for s in steps.values())
    assert os.readlink(fresh / "job/latest") == "step_20"
    assert not (store / "job/step_30").exists()  # the incomplete upload was cleaned up
    for name, content in saved[10].items():
        assert (fresh / "job/step_10" / name).read_bytes() == content
    with open(fresh / "job/step_20/big.bin", "rb") as f:
        assert f.read(1 << 20) == saved[20]["big.bin"][:1 << 20]  # a good chunk
        f.seek(9 << 20)
        try:
            f.read(1000)
            raise AssertionError("corrupt bytes were served")
        except OSError as exc:
            assert exc.errno == 5
    assert "does not match its checksum" in fresh.log()


def test_step_removed_while_it_uploads_does_not_stop_the_daemon(mounts: MountFactory,
                                                                 tmp_path: Path) -> None:
    import shutil

    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    # more files than the uploader sends at once, so that later ones are gone when it gets there
    big = {f"__{r}_0.distcp": os.urandom(12 << 20) for r in range(24)} | {".metadata": b"m"}
    save(mnt / "run/step_1", big)
    shutil.rmtree(mnt / "run/step_1")  # most likely while its files are still uploading
    save(mnt / "run/step_2", step_files(2))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert (store / "run/step_2/.tierfs-manifest").exists()
    assert not (store / "run/step_1/.tierfs-manifest").exists() or \
        "Step run/step_1: persisted to" in mnt.log()
    assert mnt.status()["pid"] == mnt.pid  # still the same daemon, still serving


def test_a_store_away_for_a_while_gets_its_steps_once_back(mounts: MountFactory,
                                                            tmp_path: Path) -> None:
    """A file:// store whose volume goes away (here: its directory is moved) while a step
    commits: reads from it fail at once and the log says the store is unavailable; status
    says why the step is not persisted and since when; flush and umount name it, and umount
    refuses to leave it only in RAM; once the store is back the step goes up, no remount."""
    store, away = tmp_path / "store", tmp_path / "store.away"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1")
    for number in (1, 2):
        save(mnt / f"run/step_{number}", step_files(number))
        tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert mnt.step("run/step_1")["ram"] is False  # persisted, and left RAM
    store.rename(away)

    with pytest.raises(OSError) as read:
        (mnt / "run/step_1/__1_0.distcp").read_bytes()
    assert read.value.errno == errno.EIO
    assert f"the store file://{store} is unavailable: {store} is missing" in mnt.log()
    assert "no object run/step_1" not in mnt.log()

    files = step_files(3)
    save(mnt / "run/step_3", files)
    wait = wait_until(lambda: (mnt.step("run/step_3")["persist_wait"] or {}).get("failures")
                      and mnt.step("run/step_3")["persist_wait"])
    assert "is unavailable" in wait["reason"] and wait["since_ns"] <= time.time_ns()
    text = tierfs("status", str(mnt.mountpoint)).stdout
    assert f"warning: 1 step is not yet in file://{store}: run/step_3 (failing for " in text
    flush = tierfs("flush", str(mnt.mountpoint), "--timeout", "0.5", check=False)
    assert flush.returncode == 1
    assert "not yet in" in flush.stderr and "run/step_3 (failing for " in flush.stderr

    umount = tierfs("umount", str(mnt.mountpoint), check=False)
    assert umount.returncode == 1 and umount.stderr.count("\n") == 1, umount.stderr
    assert umount.stderr.startswith(f"tierfs: not unmounted: 1 committed step is only in "
                                    f"this node's RAM, not in file://{store}: run/step_3 (")
    assert is_mounted(mnt.mountpoint)

    away.rename(store)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    for name, data in files.items():
        assert (store / "run/step_3" / name).read_bytes() == data
    assert mnt.step("run/step_3")["persisted"] and mnt.step("run/step_3")["persist_wait"] is None
    tierfs("umount", str(mnt.mountpoint))


def test_a_mount_removes_what_uploads_cut_short_left_in_a_file_store(mounts: MountFactory,
                                                                      tmp_path: Path) -> None:
    """Temporary objects a killed daemon's uploads left (the listing never shows them, so
    before they stayed for good, also after `rm -rf` of their step): gone after a mount."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    save(mnt / "run/step_1", step_files(1))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    tierfs("umount", str(mnt.mountpoint))
    killed = subprocess.Popen(["true"])  # a daemon that is gone
    killed.wait()
    left = [store / f"run/step_1/.tierfs-upload-{socket.gethostname()}-{killed.pid}-0",
            store / f"run/step_2/.tierfs-upload-{socket.gethostname()}-{killed.pid}-1"]
    for path in left:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes(1 << 20))

    again = mounts.remount(mnt)
    wait_until(lambda: not any(path.exists() for path in left))
    assert not (store / "run/step_2").exists()
    assert "removed 2 temporary objects of uploads cut short" in again.log()
    subprocess.run(["rm", "-rf", str(again / "run/step_1")], check=True)
    wait_until(lambda: not (store / "run/step_1").exists())


def test_umount_force_leaves_unpersisted_steps_in_ram(mounts: MountFactory,
                                                      tmp_path: Path) -> None:
    """`umount --force` unmounts while the store is away and says what stays only in RAM; the
    next mount on that RAM dir uploads it."""
    store, away = tmp_path / "store", tmp_path / "store.away"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    store.rename(away)
    files = step_files(1)
    save(mnt / "run/step_1", files)
    wait_until(lambda: mnt.step("run/step_1")["persist_wait"]["failures"])
    done = tierfs("umount", str(mnt.mountpoint), "--force")
    assert not is_mounted(mnt.mountpoint)
    assert (f"tierfs: warning: 1 committed step is only in this node's RAM, not in "
            f"file://{store}: run/step_1 (failing for ") in done.stderr
    assert f"they stay in RAM dir {mnt.ram_dir}" in done.stderr

    away.rename(store)
    again = mounts.remount(mnt)
    tierfs("flush", str(again.mountpoint), "--timeout", "60")
    assert (store / "run/step_1/__0_0.distcp").read_bytes() == files["__0_0.distcp"]


def test_an_empty_store_where_steps_were_persisted_is_refused(mounts: MountFactory,
                                                              tmp_path: Path) -> None:
    """A store directory that is empty (its volume not mounted) while the RAM dir records
    steps persisted: the mount is refused with one line, and nothing is written into it. A
    store that was empty at mount is a "new store" in status."""
    store, away = tmp_path / "store", tmp_path / "store.away"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}")
    assert mnt.status()["persist"]["new_store"] is True
    assert f"persistent tier file://{store} (new store): " in \
        tierfs("status", str(mnt.mountpoint)).stdout
    save(mnt / "run/step_1", step_files(1))
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    tierfs("umount", str(mnt.mountpoint))

    store.rename(away)
    store.mkdir()  # where the volume should be mounted
    done = tierfs("mount", str(mnt.mountpoint), "--ram-dir", str(mnt.ram_dir), "--persist",
                  f"file://{store}", check=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert (f"tierfs: persistent tier file://{store} is empty, but RAM dir {mnt.ram_dir} "
            "records 1 step as persisted (run/step_1): is the store's volume mounted?") \
        in done.stderr
    assert not is_mounted(mnt.mountpoint) and list(store.iterdir()) == []

    store.rmdir()
    away.rename(store)
    again = mounts.remount(mnt)
    assert again.status()["persist"]["new_store"] is False
    assert "(new store)" not in tierfs("status", str(again.mountpoint)).stdout
    assert again.step("run/step_1")["persisted"]


def test_du_counts_a_step_whichever_tier_holds_it(mounts: MountFactory, tmp_path: Path) -> None:
    """`du` of a step is the size of its files whether they are in RAM, left RAM (only in the
    store), or on a fresh node that has read nothing yet (st_blocks: the size in 512-byte
    blocks, as mountpoint-s3 reports it)."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1")
    files = {"model.pt": os.urandom(300_007), "optim.pt": os.urandom(1_000_001),
             ".metadata": b"m"}
    for number in (1, 2):
        save(mnt / f"run/step_{number}", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    assert mnt.step("run/step_1")["ram"] is False  # beyond --keep-ram: only in the store
    in_blocks = sum(-(-len(data) // 512) for data in files.values())

    def du_bytes(step_dir: Path) -> int:
        done = subprocess.run(["du", "-s", "--block-size=1", str(step_dir)], check=True,
                              capture_output=True, text=True)
        return int(done.stdout.split()[0]) - os.stat(step_dir).st_blocks * 512

    assert os.stat(mnt / "run/step_1/optim.pt").st_blocks == -(-1_000_001 // 512)
    assert du_bytes(mnt / "run/step_1") == in_blocks * 512
    assert du_bytes(mnt / "run/step_2") == in_blocks * 512  # in RAM: the same answer
    fresh = mounts.mount("--persist", f"file://{store}")
    assert fresh.step("run/step_2")["ram"] is False
    assert du_bytes(fresh / "run/step_2") == in_blocks * 512
