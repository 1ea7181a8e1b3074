"""Other users: a daemon run by root with --allow-other --uid USER serves a job running as
USER (torch.save and a DCP save and load; HF Trainer resumed on a fresh node, which shows the
job's directories as they were), and `tierfs status`/`flush` work for that user and
for any other; only root, the daemon's user and the root's owner may commit. (Without
--allow-other other users get EACCES: tests/faults/test_permissions.py.)

The users are real ones, made with useradd and removed with userdel -r. Their processes run
with `runuser`, in a mount namespace of their own where the interpreter and the checkout are
reachable: they may live under directories they cannot enter (/root/.pyenv, a 0700 temp dir);
the tierfs mount is seen there as it is outside, since the namespace is a copy taken after
mounting.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import MountFactory, tierfs, wait_until
from tierfs.mount_helper.mounts import is_mounted

pytestmark = pytest.mark.fuse

WORKTREE = Path(__file__).resolve().parent.parent
RunAs = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def trainer(public_dir: Path) -> Iterator[str]:
    """A fresh unprivileged user, unique to this run."""
    name = f"tfs{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-m", "-d", str(public_dir / f"home-{name}"), "-s",
                    "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True)


def _blocked_ancestors(paths: list[Path]) -> dict[Path, set[str]]:
    """Every directory on these paths that others cannot enter, with the names under it that
    the paths go through."""
    blocked: dict[Path, set[str]] = {}
    for path in paths:
        for parent in reversed(path.parents):
            if parent != path.parents[-1] and not parent.stat().st_mode & stat.S_IXOTH:
                blocked.setdefault(parent, set()).add(path.relative_to(parent).parts[0])
    return blocked


@pytest.fixture
def run_as(public_dir: Path) -> RunAs:
    """Run `python ARGS` as a user, as `runuser -u USER -- python ...`."""
    python = Path(sys.executable)
    # The interpreter (/root/.pyenv), the venv and this checkout (a clone in a 0700 temp dir)
    # may each lie under a directory the user cannot enter.
    blocked = _blocked_ancestors([python.resolve(), python, WORKTREE])

    def run(user: str, *args: str, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        command = ["runuser", "-u", user, "--", "env", f"PYTHONPATH={WORKTREE}",
                   *(f"{k}={v}" for k, v in (env or {}).items()), str(python), *args]
        if blocked:
            # In a private mount namespace, each blocked directory is covered by an enterable
            # one that holds only the entries on those paths (bound first, covered outermost
            # first, so that inner ones are reached through the outer covers).
            binds, covers = [], []
            for index, (directory, names) in enumerate(sorted(blocked.items())):
                shim = public_dir / f"shim{index}"
                for name in names:
                    (shim / name).mkdir(parents=True, exist_ok=True)
                    binds.append(f"mount --bind '{directory / name}' '{shim / name}'")
                shim.chmod(0o755)
                covers.append(f"mount --rbind '{shim}' '{directory}'")
            script = " && ".join([*binds, *covers, 'exec "$@"'])
            command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                       script, "sh", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                              cwd=public_dir)
        if check:
            assert done.returncode == 0, done.stderr[-3000:]
        return done

    return run


def test_a_job_as_another_user_checkpoints_through_a_root_mount(
        public_dir: Path, trainer: str, run_as: RunAs, mounts: MountFactory) -> None:
    mountpoint = public_dir / "checkpoints"
    mountpoint.mkdir(mode=0o755)
    mnt = mounts.mount("--allow-other", "--uid", trainer, mountpoint=mountpoint)
    user = pwd.getpwnam(trainer)
    root = os.stat(mnt.mountpoint)
    assert (root.st_uid, root.st_gid) == (user.pw_uid, user.pw_gid)

    done = run_as(trainer, str(WORKTREE / "tests" / "user_job.py"), str(mnt / "run"))
    assert f"ok uid={user.pw_uid}" in done.stdout
    for relative in ("run", "run/step_100/model.pt", "run/step_200/.metadata"):
        assert os.stat(mnt / relative).st_uid == user.pw_uid, relative
    assert mnt.step("run/step_200")["state"] == "committed"

    # status and flush as that user, through the control socket its xattr names
    status = json.loads(run_as(trainer, "-m", "tierfs", "status", str(mnt.mountpoint),
                               "--json").stdout)
    assert status["pid"] == mnt.pid
    assert {s["path"] for s in status["steps"]} >= {"run/step_100", "run/step_200"}
    flushed = run_as(trainer, "-m", "tierfs", "flush", str(mnt.mountpoint))
    assert "nothing to flush" in flushed.stdout
    # the root's owner may commit
    run_as(trainer, "-m", "tierfs", "commit", str(mnt / "run/step_100"))
    assert mnt.step("run/step_100")["state"] == "committed"


def test_other_users_may_only_read_status(public_dir: Path, trainer: str, run_as: RunAs,
                                          mounts: MountFactory) -> None:
    mountpoint = public_dir / "shared"
    mountpoint.mkdir(mode=0o755)
    mnt = mounts.mount("--allow-other", "--root-mode", "1777", mountpoint=mountpoint)
    assert stat.S_IMODE(os.stat(mnt.mountpoint).st_mode) == 0o1777
    (mnt / "run/step_5").mkdir(parents=True)
    (mnt / "run/step_5/a.bin").write_bytes(b"x" * 1000)
    status = json.loads(run_as(trainer, "-m", "tierfs", "status", str(mnt.mountpoint),
                               "--json").stdout)
    assert status["steps"][0]["path"] == "run/step_5"
    refused = run_as(trainer, "-m", "tierfs", "commit", str(mnt / "run/step_5"), check=False)
    assert refused.returncode == 1
    assert "permission denied" in refused.stderr and "Traceback" not in refused.stderr
    assert mnt.step("run/step_5")["state"] == "writing"
    # the sticky, world-writable root lets the user make a directory of its own
    run_as(trainer, "-c", f"import os; os.mkdir({str(mnt / 'mine')!r})")
    assert os.stat(mnt / "mine").st_uid == pwd.getpwnam(trainer).pw_uid


def dir_attributes(root: Path, *relative: str) -> dict[str, tuple[int, int, int, int]]:
    """Owner, group, mode and mtime of each directory, as `ls -l` shows them."""
    found = {}
    for rel in relative:
        st = os.stat(root / rel)
        found[rel] = (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    return found


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="not installed: transformers")
def test_a_job_as_its_own_user_resumes_on_a_fresh_node(
        public_dir: Path, trainer: str, run_as: RunAs, mounts: MountFactory) -> None:
    """The documented deployment (daemon as root, --allow-other --uid USER), HF Trainer run
    as USER: a fresh node made from the store shows the job's directories with their owner,
    mode and times (they came back root:root 0755: the resumed Trainer's mkdir of its next
    checkpoint and its rotation's rm got EACCES, and a directory that kept other users out
    let them in), and the Trainer resumes, saves and rotates there."""
    store = public_dir / "store"
    store.mkdir()
    (public_dir / "hf-home").mkdir()
    shutil.chown(public_dir / "hf-home", trainer)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(public_dir / "hf-home"),
           "TOKENIZERS_PARALLELISM": "false"}
    options = ("--allow-other", "--uid", trainer, "--persist", f"file://{store}",
               "--commit-idle", "1")
    first = mounts.mount(*options, mountpoint=public_dir / "node0")
    job = str(WORKTREE / "tests" / "framework_jobs.py")
    run_as(trainer, "-c", f"import os; os.mkdir({str(first / 'out')!r}, 0o750)")
    run_as(trainer, job, "hf", str(first / "out"), "4", env=env)
    dirs = ("out", "out/checkpoint-2", "out/checkpoint-4")
    wait_until(lambda: {s["path"]: s["state"] for s in first.status()["steps"]} == {
        "out/checkpoint-2": "committed", "out/checkpoint-4": "committed"}, timeout=20)
    tierfs("flush", str(first.mountpoint), "--timeout", "60")
    before = dir_attributes(first.mountpoint, *dirs)
    uid = pwd.getpwnam(trainer).pw_uid
    assert {owner for owner, _gid, _mode, _mtime in before.values()} == {uid}
    assert before["out"][2] == 0o750
    tierfs("umount", str(first.mountpoint))

    fresh = mounts.mount(*options, mountpoint=public_dir / "node1")
    assert dir_attributes(fresh.mountpoint, *dirs) == before
    refused = run_as("nobody", "-c", f"import os; os.listdir({str(fresh / 'out')!r})",
                     check=False)
    assert "PermissionError" in refused.stderr
    resumed = json.loads(run_as(trainer, job, "hf", str(fresh / "out"), "6", "resume",
                                env=env).stdout.strip().splitlines()[-1])
    assert resumed == {"global_step": 6, "steps_run": 2}
    # its rotation removed checkpoint-2, a directory this node made from the store
    assert sorted(os.listdir(fresh / "out")) == ["checkpoint-4", "checkpoint-6", "latest"]


def test_another_user_s_umount_says_who_may(public_dir: Path, trainer: str, run_as: RunAs,
                                           mounts: MountFactory) -> None:
    """Another user's `tierfs umount` of a mount they may not unmount says who may, not
    fusermount3's "entry ... not found in /etc/mtab"."""
    mountpoint = public_dir / "shared"
    mountpoint.mkdir(mode=0o755)
    mnt = mounts.mount("--allow-other", mountpoint=mountpoint)
    for extra in ([], ["--flush"]):
        refused = run_as(trainer, "-m", "tierfs", "umount", str(mnt.mountpoint), *extra,
                         check=False)
        assert refused.returncode == 1
        assert refused.stderr == (f"tierfs: cannot unmount {mnt.mountpoint}: it was mounted by "
                                  "root, and only root may unmount it\n")
    assert is_mounted(mnt.mountpoint)


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "no-passthrough"])
def test_a_write_by_another_user_clears_set_id_bits(public_dir: Path, run_as: RunAs,
                                                     mounts: MountFactory,
                                                     passthrough: bool) -> None:
    """pjdfstest chmod/12.t: a file 04777, 02777 or 06777 written by another user (uid
    65534) is 0777 right after the write, as on every other Linux file system (with
    passthrough the bits stayed: the daemon takes clearing them on, and saw no write). A copy
    with `cp -a` or `rsync -a` to another file system would keep them."""
    mountpoint = public_dir / "shared"
    mountpoint.mkdir(mode=0o755)
    mnt = mounts.mount("--allow-other", "--root-mode", "1777",
                       *([] if passthrough else ["--no-passthrough"]), mountpoint=mountpoint)
    assert mnt.status()["passthrough"] is passthrough
    for mode, flags in ((0o4777, "O_WRONLY"), (0o2777, "O_RDWR"), (0o6777, "O_RDWR")):
        path = mnt / f"setid-{mode:o}"
        path.write_bytes(b"0")
        os.chmod(path, mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
        done = run_as("nobody", "-c", f"import os; fd = os.open({str(path)!r}, os.{flags}); "
                      "os.write(fd, b'x'); print(oct(os.fstat(fd).st_mode & 0o7777))")
        assert done.stdout.strip() == "0o777", mode
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o777, mode
    # root keeps them (CAP_FSETID)
    kept = mnt / "kept"
    kept.write_bytes(b"0")
    os.chmod(kept, 0o4755)
    with open(kept, "r+b") as f:
        f.write(b"x")
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o4755
