"""What a user writes is what gets committed, whatever way the bytes reached the file.

With FUSE passthrough the daemon does not see writes, and the kernel sends a FLUSH at the close
of every duplicate of a descriptor: shell redirection, `dd`, a forked child that inherited the
descriptor, a shared mapping written after its descriptor was closed. Each pattern here must
commit the file's final bytes, keep them across a restart, and pass `tierfs verify
--no-repair`.
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from tests.conftest import Mount, MountFactory, fill, getxattr, tierfs, wait_until
from tests.test_commit_hashes_later import hold_hashes
from tierfs.devtools.s3_proxy import Fault, S3Proxy
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = pytest.mark.fuse

CONTENT = b"hello, committed bytes\n" * 1000


def shell_redirect(path: Path) -> None:
    subprocess.run(["sh", "-c", 'cat > "$1"', "sh", str(path)], input=CONTENT, check=True)


def dd(path: Path) -> None:
    subprocess.run(["dd", f"of={path}", "bs=4096", "status=none"], input=CONTENT, check=True)


def inherited_by_child(path: Path) -> None:
    """The parent opens and closes its descriptor first; a child it forked writes later."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    child = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time; time.sleep(0.3); "
         "os.write(int(sys.argv[1]), sys.stdin.buffer.read())", str(fd)],
        stdin=subprocess.PIPE, pass_fds=(fd,), close_fds=True)
    os.close(fd)
    child.communicate(CONTENT)
    assert child.returncode == 0


def closed_duplicate_first(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.close(os.dup(fd))
    os.write(fd, CONTENT)
    os.close(fd)


def mapped_after_close(path: Path) -> None:
    """numpy.memmap's way: the file sized and mapped, its descriptor closed, then the bytes
    written through the mapping (the kernel releases the file only when it is unmapped)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, len(CONTENT))
    mapping = mmap.mmap(fd, len(CONTENT))
    os.close(fd)
    mapping[:] = CONTENT
    mapping.flush()
    mapping.close()


PATTERNS: dict[str, Callable[[Path], None]] = {
    "shell-redirect": shell_redirect, "dd": dd, "forked-child": inherited_by_child,
    "dup-closed-first": closed_duplicate_first, "mapped-after-close": mapped_after_close,
}


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "through-daemon"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_every_write_pattern_commits_the_final_bytes(mounts: MountFactory, pattern: str,
                                                     passthrough: bool) -> None:
    mnt = mounts.mount() if passthrough else mounts.mount("--no-passthrough")
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    PATTERNS[pattern](step / "x")
    assert (step / "x").read_bytes() == CONTENT
    expected = xxhash.xxh3_128_hexdigest(CONTENT)
    assert getxattr(step / "x", "user.tierfs.xxh3") == expected
    tierfs("commit", str(step))
    assert mnt.step("run/step_1")["bytes"] == len(CONTENT)
    tierfs("verify", str(step), "--no-repair")
    tierfs("umount", str(mnt.mountpoint))
    mnt = mounts.remount(mnt)
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert (step / "x").read_bytes() == CONTENT
    assert getxattr(step / "x", "user.tierfs.xxh3") == expected


@pytest.mark.parametrize("passthrough", [True, False], ids=["passthrough", "through-daemon"])
def test_a_mapping_written_after_a_commit_starts_a_new_version(mounts: MountFactory,
                                                               passthrough: bool) -> None:
    """A shared mapping (its descriptor closed) still written when the step commits: the
    commit holds the bytes the file had then, and what the mapping writes afterwards is the
    next version once it is unmapped, here and after a restart."""
    mnt = mounts.mount() if passthrough else mounts.mount("--no-passthrough")
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    size = 1 << 20
    fd = os.open(step / "x", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    os.close(fd)
    try:
        mapping[:] = b"a" * size
        mapping.flush()
        tierfs("commit", str(step))
        assert mnt.step("run/step_1")["version"] == 1
        mapping[:] = b"b" * size
        mapping.flush()
    finally:
        mapping.close()
    tierfs("commit", str(step))
    assert mnt.step("run/step_1")["version"] == 2
    tierfs("verify", str(step), "--no-repair")
    tierfs("umount", str(mnt.mountpoint))
    mnt = mounts.remount(mnt)
    assert (step / "x").read_bytes() == b"b" * size
    assert getxattr(step / "x", "user.tierfs.xxh3") == xxhash.xxh3_128_hexdigest(b"b" * size)


def test_writes_after_a_commit_start_a_new_version(mnt: Mount) -> None:
    """A descriptor still open for writing when the step commits: the commit holds the bytes
    the file had then, and later writes through it make the step `writing` again."""
    step = mnt / "run/step_2"
    step.mkdir(parents=True)
    fd = os.open(step / "x", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"first")
        os.close(os.dup(fd))
        tierfs("commit", str(step))
        assert getxattr(step / "x", "user.tierfs.xxh3") == xxhash.xxh3_128_hexdigest(b"first")
        os.write(fd, b" second")
    finally:
        os.close(fd)
    tierfs("commit", str(step))
    assert (step / "x").read_bytes() == b"first second"
    assert getxattr(step / "x", "user.tierfs.xxh3") == \
        xxhash.xxh3_128_hexdigest(b"first second")
    assert mnt.step("run/step_2")["version"] == 2
    tierfs("verify", str(step), "--no-repair")


# -- a DCP step copied with `.metadata` first ----------------------------------------------------


@pytest.fixture(scope="module")
def dcp_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-shard DCP checkpoint on a plain directory, to be copied onto the mount."""
    import torch
    import torch.distributed.checkpoint as dcp

    step = tmp_path_factory.mktemp("dcp") / "step_5"
    state = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(64, 64)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(step), thread_count=2))
    assert len(list(step.glob("*.distcp"))) == 2
    return step


def test_metadata_copied_before_its_shards_waits_for_them(mounts: MountFactory,
                                                          dcp_step: Path) -> None:
    mnt = mounts.mount()
    step = mnt / "run/step_5"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes((dcp_step / ".metadata").read_bytes())
    assert getxattr(step, "user.tierfs.state") == "writing"
    done = tierfs("commit", str(step), check=False)
    assert done.returncode != 0 and "__0_0.distcp" in done.stderr, done.stderr
    assert not (mnt / "run/latest").exists()
    shards = sorted(dcp_step.glob("*.distcp"))
    (step / shards[0].name).write_bytes(shards[0].read_bytes())
    assert getxattr(step, "user.tierfs.state") == "writing"
    tierfs("umount", str(mnt.mountpoint))  # a restart in between must not commit it either
    mnt = mounts.remount(mnt)
    assert getxattr(step, "user.tierfs.state") == "writing"
    assert not (mnt / "run/latest").exists()
    (step / shards[1].name).write_bytes(shards[1].read_bytes())
    assert getxattr(step, "user.tierfs.state") == "committed"
    assert mnt.step("run/step_5")["files"] == 3


@pytest.mark.parametrize("tool", ["rsync", "cp", "tar"])
def test_a_dcp_step_copied_with_shell_tools_commits_whole(mounts: MountFactory, dcp_step: Path,
                                                          tmp_path: Path, tool: str) -> None:
    mnt = mounts.mount()
    (mnt / "run").mkdir()
    if tool == "rsync":
        subprocess.run(["rsync", "-a", str(dcp_step), str(mnt / "run")], check=True)
    elif tool == "cp":
        subprocess.run(["cp", "-r", str(dcp_step), str(mnt / "run")], check=True)
    else:
        archive = tmp_path / "step.tar"
        members = [".metadata", *sorted(p.name for p in dcp_step.glob("*.distcp"))]
        subprocess.run(["tar", "cf", str(archive), "-C", str(dcp_step.parent),
                        *(f"step_5/{name}" for name in members)], check=True)
        subprocess.run(["tar", "xf", str(archive), "-C", str(mnt / "run")], check=True)
    import torch
    import torch.distributed.checkpoint as dcp

    assert getxattr(mnt / "run/step_5", "user.tierfs.state") == "committed"
    state = {"a": torch.zeros(4096), "b": torch.zeros(64, 64)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(mnt / "run/latest")))
    assert torch.equal(state["a"], torch.arange(4096, dtype=torch.float32))
    assert mnt.step("run/step_5")["files"] == 3


# -- loads through `latest` while a step commits ---------------------------------------------------


def test_a_load_through_latest_never_mixes_two_steps(mnt: Mount) -> None:
    """A commit lands between the load's read of `.metadata` and of the shards: the load
    still reads step_100 whole, while any other process already sees step_200."""
    import torch
    import torch.distributed.checkpoint as dcp

    def state(value: float) -> dict[str, torch.Tensor]:
        return {"a": torch.full((256, 256), value), "b": torch.full((1024,), value)}

    run = mnt / "run"
    dcp.save(state(1.0), storage_writer=dcp.FileSystemWriter(str(run / "step_100"),
                                                              thread_count=2))

    class CommitMidLoad(dcp.FileSystemReader):
        def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
            dcp.save(state(2.0), storage_writer=dcp.FileSystemWriter(str(run / "step_200"),
                                                                      thread_count=2))
            seen = subprocess.run(["readlink", str(run / "latest")], capture_output=True,
                                  text=True, check=True).stdout.strip()
            assert seen == "step_200"  # another process sees the new step at once
            return super().read_data(plan, planner)

    loaded = state(0.0)
    dcp.load(loaded, storage_reader=CommitMidLoad(str(run / "latest")))
    assert torch.equal(loaded["a"], state(1.0)["a"]) and torch.equal(loaded["b"], state(1.0)["b"])


def test_a_load_that_plans_longer_than_the_grace_reads_the_step_of_its_metadata(
        mnt: Mount) -> None:
    """A rank that waits longer than the pin's grace between `.metadata` and its shards (DCP
    plans the load with every rank in between: a big job, a slow rank) while a newer step
    commits still reads the shards of the step whose `.metadata` it read. Before, the pin
    lapsed and the shards came from the newer step: one load of two checkpoints, which
    succeeded (the steps had the same layout) with the newer step's values."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierfs.fs.model.latest_pins import GRACE

    def state(value: float) -> dict[str, torch.Tensor]:
        return {"a": torch.full((256,), value)}

    run = mnt / "run"
    dcp.save(state(1.0), storage_writer=dcp.FileSystemWriter(str(run / "step_1")))

    class PlansSlowly(dcp.FileSystemReader):
        def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
            dcp.save(state(2.0), storage_writer=dcp.FileSystemWriter(str(run / "step_2")))
            time.sleep(GRACE + 1)
            return super().read_data(plan, planner)

    loaded = state(0.0)
    dcp.load(loaded, storage_reader=PlansSlowly(str(run / "latest")))
    assert torch.equal(loaded["a"], state(1.0)["a"])
    loaded = state(0.0)  # the next load: the newest step
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(run / "latest")))
    assert torch.equal(loaded["a"], state(2.0)["a"])


def test_a_new_load_through_latest_reads_the_newest_step_at_once(mnt: Mount) -> None:
    """A process that loads through `latest` again right after a load reads the newest step:
    after its own save (a job checking what it saved) and after another process's (an
    evaluator polling the run), not the step it loaded a moment before."""
    import torch
    import torch.distributed.checkpoint as dcp

    run = mnt / "run"

    def save(step: int, value: float) -> None:
        dcp.save({"w": torch.full((64,), value)},
                 storage_writer=dcp.FileSystemWriter(str(run / f"step_{step}")))

    def load_latest() -> float:
        loaded = {"w": torch.zeros(64)}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(run / "latest")))
        return float(loaded["w"][0])

    save(1, 1.0)
    assert load_latest() == 1.0
    save(2, 2.0)  # this process's own save
    assert load_latest() == 2.0
    other = ("import sys, torch, torch.distributed.checkpoint as dcp; "
             "dcp.save({'w': torch.full((64,), 3.0)}, "
             "storage_writer=dcp.FileSystemWriter(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", other, str(run / "step_3")], check=True, timeout=120)
    assert load_latest() == 3.0


def test_a_process_polling_one_file_through_latest_reads_each_new_step(mnt: Mount) -> None:
    """An evaluator that reads `run/latest/model.pt` every second reads each step once it is
    committed: opening again the one file its last load read, with nothing of the step open,
    is a new load. Before, each read within 10 s of the last kept the step that read saw, so
    a process polling faster than that never saw a newer step. A load of several files still
    reads one step whole while a commit lands between them."""
    from tests.test_crash import save

    run = mnt / "run"
    save(run / "step_1", {"model.pt": b"one", ".metadata": b"m1"})
    assert (run / "latest/model.pt").read_bytes() == b"one"
    save(run / "step_2", {"model.pt": b"two", ".metadata": b"m2"})
    assert (run / "latest/model.pt").read_bytes() == b"two"
    with open(run / "latest/model.pt", "rb") as model:  # a load of two files: one step
        save(run / "step_3", {"model.pt": b"three", ".metadata": b"m3"})
        assert (run / "latest/.metadata").read_bytes() == b"m2"
        assert model.read() == b"two"
    assert (run / "latest/model.pt").read_bytes() == b"two"  # within that load's grace


def test_at_log_level_debug_the_log_says_which_step_latest_names_for_each_process(
        mounts: MountFactory) -> None:
    """`--log-level debug`: the daemon's log tells which step `latest` named for a process,
    and that its open went through the link; at the default level it says neither."""
    from tests.test_crash import save

    quiet, chatty = mounts.mount(), mounts.mount("--log-level", "debug")
    for mnt in (quiet, chatty):
        save(mnt / "run/step_1", {"model.pt": b"one", ".metadata": b"m1"})
        assert (mnt / "run/latest/model.pt").read_bytes() == b"one"
    pid = os.getpid()
    assert f"latest for {pid} (thread {pid}): b'step_1'" in chatty.log()
    assert f"b'step_1'/b'model.pt' asked for through latest by thread {pid}" in chatty.log()
    assert "latest for" not in quiet.log() and "through latest" not in quiet.log()


def fresh_node_after_one_save(mounts: MountFactory, proxy: S3Proxy, bucket: str,
                              s3_env: dict[str, str]) -> Mount:
    """A node mounted on an empty RAM dir whose store, reached through `proxy`, holds one DCP
    step, run/step_1 (`w`: 64 ones), saved and flushed by another node since unmounted."""
    import torch
    import torch.distributed.checkpoint as dcp

    env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
    persist = ("--persist", f"s3://{bucket}/ckpt", "--s3-endpoint", proxy.endpoint)
    first = mounts.mount(*persist, env=env)
    dcp.save({"w": torch.full((64,), 1.0)},
             storage_writer=dcp.FileSystemWriter(str(first / "run/step_1")))
    tierfs("flush", str(first.mountpoint), "--timeout", "60", env=env)
    tierfs("umount", str(first.mountpoint), env=env)
    return mounts.mount(*persist, env=env)


def test_a_load_whose_metadata_comes_slowly_from_the_store_is_the_first_of_its_load(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str, s3_env: dict[str, str]) -> None:
    """On a fresh node a load through `latest` waits seconds for `.metadata` to come from a
    slow store, then opens its shard at once: the slow open is still the load's first, so once
    a newer step commits, the same process's next load reads it. Before, the open counted as
    one by the step's own name (it was answered long after the walk through the link), the
    shard's pinned the step without a load begun, and every later load of the process within
    the grace read the older step (in a cluster: some ranks the old step, some the new)."""
    import torch
    import torch.distributed.checkpoint as dcp

    with S3Proxy(s3_server.endpoint) as proxy:
        fresh = fresh_node_after_one_save(mounts, proxy, bucket, s3_env)
        proxy.plan = lambda request: (Fault("slow", delay=2.0)
                                      if request.path.endswith("/.metadata") else None)

        def load_latest() -> float:
            loaded = {"w": torch.zeros(64)}
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(fresh / "run/latest")))
            return float(loaded["w"][0])

        assert load_latest() == 1.0
        assert proxy.counts["fault:slow"] >= 1  # `.metadata` came slowly
        dcp.save({"w": torch.full((64,), 2.0)},
                 storage_writer=dcp.FileSystemWriter(str(fresh / "run/step_2")))
        assert load_latest() == 2.0


def test_a_load_whose_metadata_comes_slower_than_the_grace_reads_its_shards_from_its_step(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str, s3_env: dict[str, str]) -> None:
    """A fresh node's load through `latest` waits longer than the pin's grace for step_1's
    `.metadata` from a slow store; meanwhile step_2 commits there and another process looks
    at the link. The load still reads step_1's shards. Before, the pin lapsed while the open
    waited (nothing of it was counted until the open was answered): the shards came from
    step_2, one load of two checkpoints (in the partition suite: a rank's `.metadata` waiting
    for a holder it could not reach)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierfs.fs.model.latest_pins import GRACE

    with S3Proxy(s3_server.endpoint) as proxy:
        fresh = fresh_node_after_one_save(mounts, proxy, bucket, s3_env)
        proxy.plan = lambda request: (Fault("slow", delay=GRACE + 3)
                                      if request.path.endswith("step_1/.metadata") else None)
        load = ("import sys, torch, torch.distributed.checkpoint as dcp; w = torch.zeros(64); "
                "dcp.load({'w': w}, storage_reader=dcp.FileSystemReader(sys.argv[1])); "
                "print(float(w[0]))")
        loader = subprocess.Popen([sys.executable, "-c", load, str(fresh / "run/latest")],
                                  stdout=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: proxy.counts["fault:slow"] >= 1, timeout=60)
            asked = time.monotonic()
            dcp.save({"w": torch.full((64,), 2.0)},
                     storage_writer=dcp.FileSystemWriter(str(fresh / "run/step_2")))
            time.sleep(max(0.0, asked + GRACE + 1 - time.monotonic()))
            assert os.readlink(fresh / "run/latest") == "step_2"  # for any other process
            out, _ = loader.communicate(timeout=120)
        finally:
            loader.kill()
            loader.wait()
        assert loader.returncode == 0 and float(out) == 1.0


def test_a_process_whose_load_failed_sees_the_newest_step_at_once(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str, s3_env: dict[str, str]) -> None:
    """A fresh node's load through `latest` fails (the store is away as it reads a shard:
    EIO); a newer step commits; the same process's look at the link names the newer step at
    once. Before, the failed load's pin held the older step for 10 s more (in the partition
    suite: ranks whose load failed in a cut named the old step after the heal)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with S3Proxy(s3_server.endpoint) as proxy:
        fresh = fresh_node_after_one_save(mounts, proxy, bucket, s3_env)
        proxy.plan = lambda request: (Fault("down")
                                      if request.path.endswith(".distcp") else None)
        with pytest.raises((OSError, CheckpointException)):  # EIO, or DCP's wrapping of it
            dcp.load({"w": torch.zeros(64)},
                     storage_reader=dcp.FileSystemReader(str(fresh / "run/latest")))
        assert proxy.counts["fault:down"] >= 1
        dcp.save({"w": torch.full((64,), 2.0)},
                 storage_writer=dcp.FileSystemWriter(str(fresh / "run/step_2")))
        assert os.readlink(fresh / "run/latest") == "step_2"


# -- a commit that fails for want of space ---------------------------------------------------------


def test_a_commit_that_fails_for_space_fails_the_save_and_is_retried(
        small_shm: Path, mounts: MountFactory) -> None:
    mnt = mounts.mount("--ram-limit", "1G", ram_dir=small_shm / "ram")
    step = mnt / "run/step_3"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(os.urandom(1 << 20))
    (step / ".metadata.tmp").write_bytes(b"metadata")
    fill(small_shm / "other-user")
    with pytest.raises(OSError) as failed:  # DCP's last step: the save reports the failure
        os.rename(step / ".metadata.tmp", step / ".metadata")
    assert failed.value.errno == errno.ENOSPC
    assert getxattr(step, "user.tierfs.state") == "writing"
    assert "space" in mnt.step("run/step_3")["waiting_for"]
    assert "its commit waits for space" in tierfs("status", str(mnt.mountpoint)).stdout
    assert not (mnt / "run/latest").exists()
    (small_shm / "other-user").unlink()
    wait_until(lambda: getxattr(step, "user.tierfs.state") == "committed")
    assert os.readlink(mnt / "run/latest") == "step_3"
    assert mnt.step("run/step_3")["waiting_for"] is None


def test_a_commit_whose_manifest_had_no_room_is_finished_once_there_is(
        small_shm: Path, mounts: MountFactory, tmp_path: Path) -> None:
    """A save committed before its hashes were in (the saver's call returned), whose manifest
    then found the RAM dir's file system full: once there is room its manifest is written and
    it reaches the store (before, it stayed unhashed and on this node only until the same step
    was committed again, or the daemon restarted)."""
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--ram-limit", "1G", "--persist", f"file://{store}",
                       ram_dir=small_shm / "ram")
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(os.urandom(1 << 20))
    (step / ".metadata.tmp").write_bytes(b"metadata")
    hold_hashes(mnt, True)
    os.rename(step / ".metadata.tmp", step / ".metadata")  # committed, its hashes to come
    assert getxattr(step, "user.tierfs.state") == "committed"
    fill(small_shm / "other-user")
    hold_hashes(mnt, False)
    wait_until(lambda: "its hashes or manifest failed" in mnt.log())
    (small_shm / "other-user").unlink()
    line = wait_until(lambda: (s := mnt.step("run/step_1")) and s["persisted"] and s, 30)
    assert (line["state"], line["hashing"], line["version"]) == ("committed", False, 1)
    assert (store / "run/step_1/__0_0.distcp").read_bytes() == (step / "__0_0.distcp").read_bytes()
