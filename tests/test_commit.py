"""Step commit through a real mount: the three triggers, states, xattrs, `latest`, re-save and
the commit that waits for its writers."""

from __future__ import annotations

import errno
import os

import pytest
import xxhash

from tests.conftest import Mount, MountFactory, getxattr, tierfs

pytestmark = pytest.mark.fuse


def write_step(step_dir, files: dict[str, bytes], metadata: bytes | None = b"meta") -> None:  # type: ignore[no-untyped-def]
    """What DCP's FileSystemWriter does: shards, then .metadata.tmp renamed to .metadata."""
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (step_dir / name).write_bytes(data)
    if metadata is not None:
        (step_dir / ".metadata.tmp").write_bytes(metadata)
        os.rename(step_dir / ".metadata.tmp", step_dir / ".metadata")


def test_metadata_rename_commits_with_xattrs(mnt: Mount) -> None:
    shard = os.urandom(3 << 20)
    write_step(mnt / "run1/step_100", {"__0_0.distcp": shard})
    step = mnt / "run1/step_100"
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert getxattr(step, "user.tierfs.tiers") == "ram"
    assert getxattr(step / "__0_0.distcp", "user.tierfs.tiers") == "ram"
    assert getxattr(step / "__0_0.distcp", "user.tierfs.xxh3") == xxhash.xxh3_128_hexdigest(shard)
    names = os.listxattr(step)
    assert "user.tierfs.state" in names and "user.tierfs.tiers" in names
    status = mnt.step("run1/step_100")
    assert status["committed_ns"] > 0 and status["changed_ns"] is None
    status = {k: v for k, v in status.items() if not k.endswith("_ns")}
    assert status == {"path": "run1/step_100", "step": 100, "state": "committed", "version": 1,
                      "files": 2, "bytes": len(shard) + 4, "ram": True,
                      "ram_bytes": len(shard) + 4, "replicas": [], "copies": 1,
                      "persisted": False, "waiting_for": None, "kind": "dir",
                      "persist_wait": None, "copies_wait": None, "lost": None,
                      "hashing": False, "unfinished": None, "commit_outlook": None}
    assert mnt.step("run1") is None  # holds steps: a run directory, not a step
    with pytest.raises(OSError) as info:
        os.setxattr(step, "user.tierfs.state", b"writing")
    assert info.value.errno == errno.EROFS


def test_metadata_written_in_place_commits(mnt: Mount) -> None:
    (mnt / "ckpt/global_step7").mkdir(parents=True)
    (mnt / "ckpt/global_step7/model.pt").write_bytes(b"weights")
    assert getxattr(mnt / "ckpt/global_step7", "user.tierfs.state") == "writing"
    (mnt / "ckpt/global_step7/.metadata").write_bytes(b"m")
    assert getxattr(mnt / "ckpt/global_step7", "user.tierfs.state") == "committed"


def test_directory_renamed_onto_step_name_commits(mnt: Mount) -> None:
    (mnt / "run/tmp-save").mkdir(parents=True)
    (mnt / "run/tmp-save/weights.pt").write_bytes(b"w" * 1000)
    os.rename(mnt / "run/tmp-save", mnt / "run/checkpoint-500")
    assert getxattr(mnt / "run/checkpoint-500", "user.tierfs.state") == "committed"
    assert os.readlink(mnt / "run/latest") == "checkpoint-500"


def test_tierfs_commit_command(mnt: Mount) -> None:
    (mnt / "run/step_3").mkdir(parents=True)
    (mnt / "run/step_3/state.pt").write_bytes(b"s" * 123)
    assert getxattr(mnt / "run/step_3", "user.tierfs.state") == "writing"
    done = tierfs("commit", str(mnt / "run/step_3"))
    assert "committed run/step_3 version 1: 1 files" in done.stdout
    assert getxattr(mnt / "run/step_3", "user.tierfs.state") == "committed"
    (mnt / "run/notes").mkdir()
    refused = tierfs("commit", str(mnt / "run/notes"), check=False)
    assert refused.returncode == 1
    assert "not a step directory" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stderr.count("\n") == 1


def test_latest_names_highest_committed_step_not_newest(mnt: Mount) -> None:
    write_step(mnt / "run/step_200", {"a": b"200"})
    write_step(mnt / "run/step_100", {"a": b"100"})  # committed later, lower number
    write_step(mnt / "run/step_300", {"a": b"300"}, metadata=None)  # not committed
    assert os.readlink(mnt / "run/latest") == "step_200"
    assert (mnt / "run/latest/a").read_bytes() == b"200"
    assert "latest" in os.listdir(mnt / "run")
    assert "latest" not in os.listdir(mnt)  # no committed step directly under the root
    with pytest.raises(OSError) as info:
        os.utime(mnt / "run/latest", follow_symlinks=False)
    assert info.value.errno == errno.EROFS
    os.rename(mnt / "run/step_100/a", mnt / "run/step_100/b")  # a real entry can take the name
    os.rename(mnt / "run/step_100/b", mnt / "run/latest")  # (`mv -T tmp latest`)
    assert (mnt / "run/latest").read_bytes() == b"100"
    assert not os.path.islink(mnt / "run/latest")
    os.unlink(mnt / "run/latest")  # the run directory keeps its own `latest`: no link comes back
    assert not os.path.lexists(mnt / "run/latest")
    assert mnt.status()["own_latest"] == ["run"]


def test_a_savers_own_latest_file_replaces_the_virtual_link(mounts: MountFactory) -> None:
    """A saver that writes its own `latest` FILE beside its steps (DeepSpeed's tag file, a
    custom tracker) after the step committed: the kernel would follow the virtual link to the
    step directory (EISDIR). `rm latest` makes room for good, also across a remount; DeepSpeed's
    `global_stepN` run directories never show the link."""
    mnt = mounts.mount()
    write_step(mnt / "run/step_1", {"a": b"1"})
    with pytest.raises(IsADirectoryError):
        open(mnt / "run/latest", "w")  # noqa: SIM115 - the kernel follows the link
    os.unlink(mnt / "run/latest")
    assert "latest" not in os.listdir(mnt / "run")
    (mnt / "run/latest").write_text("step_1")  # open(O_CREAT|O_TRUNC), as a saver does
    assert (mnt / "run/latest").read_text() == "step_1"
    write_step(mnt / "run/step_2", {"a": b"2"})  # a newer commit does not bring the link back
    assert (mnt / "run/latest").read_text() == "step_1"
    os.unlink(mnt / "run/latest")
    assert not os.path.lexists(mnt / "run/latest")
    # DeepSpeed's step directories: its own `latest` file, whenever it writes it
    write_step(mnt / "ds/global_step2", {"mp_rank_00_model_states.pt": b"m"})
    assert getxattr(mnt / "ds/global_step2", "user.tierfs.state") == "committed"
    assert not os.path.lexists(mnt / "ds/latest")
    (mnt / "ds/latest").write_text("global_step2")
    text = tierfs("status", str(mnt.mountpoint)).stdout
    assert "ds: 2 steps" in text and "its own `latest` is in use" in text
    assert "<- latest" not in text.split("ds/global_step2", 1)[1].splitlines()[0]
    assert mnt.status()["own_latest"] == ["ds", "run"]

    tierfs("umount", str(mnt.mountpoint))
    again = mounts.remount(mnt)
    assert not os.path.lexists(again / "run/latest")  # the choice stays
    (again / "run/latest").write_text("step_2")
    assert (again / "ds/latest").read_text() == "global_step2"
    assert again.status()["own_latest"] == ["ds", "run"]
    write_step(again / "other/step_7", {"a": b"7"})  # elsewhere the link is as before
    assert os.readlink(again / "other/latest") == "step_7"


def test_resave_creates_new_version_and_old_stays_until_commit(mnt: Mount) -> None:
    step = mnt / "run/step_5"
    write_step(step, {"shard": b"v1" * 1000})
    first = mnt.step("run/step_5")
    assert first["version"] == 1
    (step / "shard").write_bytes(b"v2" * 2000)
    assert getxattr(step, "user.tierfs.state") == "writing"
    assert "latest" not in os.listdir(mnt / "run")  # no committed step while re-saving
    (step / ".metadata.tmp").write_bytes(b"meta2")
    os.rename(step / ".metadata.tmp", step / ".metadata")
    second = mnt.step("run/step_5")
    assert second["state"] == "committed" and second["version"] == 2
    assert second["bytes"] == 4000 + 5
    assert (step / "shard").read_bytes() == b"v2" * 2000
    write_step(step, {"shard": b"v2" * 2000}, metadata=b"meta2")  # same bytes again
    assert mnt.step("run/step_5")["version"] == 2  # nothing changed, no new version


def test_commit_waits_for_open_writers(mnt: Mount) -> None:
    step = mnt / "run/step_9"
    step.mkdir(parents=True)
    with open(step / "slow_rank.distcp", "wb") as slow:
        slow.write(b"first half ")
        slow.flush()
        (step / ".metadata").write_bytes(b"m")  # another rank finished first
        assert getxattr(step, "user.tierfs.state") == "writing"
        slow.write(b"second half")
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert mnt.step("run/step_9")["bytes"] == len(b"first half second half") + 1


def test_deleting_a_committed_step(mnt: Mount) -> None:
    write_step(mnt / "run/step_1", {"a": b"1"})
    write_step(mnt / "run/step_2", {"a": b"2"})
    assert os.readlink(mnt / "run/latest") == "step_2"
    for name in os.listdir(mnt / "run/step_2"):
        os.unlink(mnt / "run/step_2" / name)
    os.rmdir(mnt / "run/step_2")
    assert os.readlink(mnt / "run/latest") == "step_1"
    assert [s["path"] for s in mnt.status()["steps"]] == ["run/step_1"]


def test_rm_r_of_a_run_directory_with_latest(mnt: Mount) -> None:
    import subprocess

    write_step(mnt / "run/step_1", {"a": b"1"})
    write_step(mnt / "run/step_2", {"a": b"2"})
    subprocess.run(["rm", "-r", str(mnt / "run")], check=True)
    assert os.listdir(mnt) == []
