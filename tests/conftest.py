"""Shared fixtures: real tierfs mounts started through the real command line.

Every mount made here is torn down even when its test fails: lazy unmount, then the daemon is
killed by its own pid (never by name), then its RAM dir is removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.waiting import wait_until
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.free_ports import free_port  # noqa: F401 - the tests' port picker
from tierfs.devtools.seaweed import SeaweedS3
from tierfs.mount_helper.mounts import is_mounted

if TYPE_CHECKING:
    from tests.harness import Cluster  # which imports this module

TIERFS = [sys.executable, "-m", "tierfs"]


LAYERS = ("core", "store", "fuse", "cluster", "frameworks", "faults", "image")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one layer (its module's `pytestmark`), so that `-m` picks
    whole layers and a new module cannot slip out of `make test-fast` or into it unnoticed."""
    for item in items:
        layers = {mark.name for mark in item.iter_markers() if mark.name in LAYERS}
        if len(layers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: name one layer of {', '.join(LAYERS)} "
                                    f"in its module's pytestmark (it has {sorted(layers)})")


LOG_TAIL = 40  # lines of each daemon's log shown with a failed test


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[pytest.TestReport]:
    """A test that failed with daemons of its own shows the end of each one's log (pytest's
    tmp dirs holding them are gone a few runs later, a flaky test's cause with them)."""
    report = yield
    factory = getattr(item, "funcargs", {}).get("mounts")
    if report.when == "call" and report.failed and isinstance(factory, MountFactory):
        for mount in factory.mounts:
            lines = mount.log().splitlines()[-LOG_TAIL:]
            report.sections.append((f"end of {mount.log_file.name} ({mount.mountpoint.name})",
                                    "\n".join(lines)))
    return report


def tierfs(*args: str, check: bool = True, timeout: float = 120,
           env: dict[str, str] | None = None,
           prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the command line; `prefix` runs it through a wrapper (`nsenter --net=...`)."""
    done = subprocess.run([*(prefix or []), *TIERFS, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"tierfs {' '.join(args)} failed ({done.returncode}): "
                             f"{done.stderr.strip()}")
    return done


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class Mount:
    mountpoint: Path
    ram_dir: Path
    log_file: Path
    extra: list[str] = field(default_factory=list)
    pid: int = 0
    prefix: list[str] = field(default_factory=list)  # the daemon's wrapper (a netns)

    def __truediv__(self, relative: str) -> Path:
        return self.mountpoint / relative

    def __fspath__(self) -> str:
        return str(self.mountpoint)

    def status(self) -> dict[str, Any]:
        return json.loads(tierfs("status", str(self.mountpoint), "--json").stdout)

    def step(self, relative: str) -> dict[str, Any] | None:
        for step in self.status()["steps"]:
            if step["path"] == relative:
                return step
        return None

    def log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else ""

    def kill9(self) -> None:
        """A daemon crash: SIGKILL, then the lazy unmount an operator would do."""
        os.kill(self.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(self.pid))
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        wait_until(lambda: not is_mounted(self.mountpoint))


class MountFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.mounts: list[Mount] = []
        self.ram_dirs: list[Path] = []
        self._lock = threading.Lock()  # mounts may be started from several threads at once

    def new_ram_dir(self) -> Path:
        ram_dir = Path("/dev/shm") / f"tierfs-test-{uuid.uuid4().hex[:12]}"
        self.ram_dirs.append(ram_dir)
        return ram_dir

    def mount(self, *extra: str, ram_dir: Path | None = None, mountpoint: Path | None = None,
              env: dict[str, str] | None = None, prefix: list[str] | None = None) -> Mount:
        """Mount through the command line (run through `prefix`, e.g. `nsenter --net=...`,
        when given: the daemon then lives in that network namespace)."""
        with self._lock:
            ram_dir = ram_dir or self.new_ram_dir()
            if ram_dir not in self.ram_dirs:
                self.ram_dirs.append(ram_dir)
            mountpoint = mountpoint or self.tmp_path / f"mnt{len(self.mounts)}"
            mountpoint.mkdir(exist_ok=True)
            log_file = self.tmp_path / f"tierfs{len(self.mounts)}.log"
            mount = Mount(mountpoint, ram_dir, log_file, list(extra), prefix=list(prefix or []))
            self.mounts.append(mount)
        tierfs("mount", str(mountpoint), "--ram-dir", str(ram_dir), "--log-file", str(log_file),
               *extra, env=env, prefix=prefix)
        assert is_mounted(mountpoint)
        mount.pid = mount.status()["pid"]
        return mount

    def remount(self, old: Mount, *extra: str, env: dict[str, str] | None = None) -> Mount:
        return self.mount(*(extra or old.extra), ram_dir=old.ram_dir, mountpoint=old.mountpoint,
                          env=env, prefix=old.prefix)

    def cleanup(self) -> None:
        for mount in reversed(self.mounts):
            if is_mounted(mount.mountpoint):
                subprocess.run(["fusermount3", "-u", "-z", str(mount.mountpoint)],
                               capture_output=True)
            if mount.pid and pid_alive(mount.pid):
                os.kill(mount.pid, signal.SIGTERM)
                try:
                    wait_until(lambda m=mount: not pid_alive(m.pid), timeout=10)
                except AssertionError:
                    os.kill(mount.pid, signal.SIGKILL)
        for ram_dir in self.ram_dirs:
            shutil.rmtree(ram_dir, ignore_errors=True)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[MountFactory]:
    factory = MountFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture
def mnt(mounts: MountFactory) -> Mount:
    """One fresh tierfs mount with an empty RAM dir."""
    return mounts.mount()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    """One real etcd on loopback for the whole run (free ports, own data dir, stopped by pid);
    each test names its own cluster prefix in it."""
    with Etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp dirs are 0700), removed after the
    mounts in it are gone (request it before `mounts`)."""
    path = Path("/tmp") / f"tierfs-public-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    path.chmod(0o755)
    try:
        yield path
    finally:
        for child in path.iterdir():
            subprocess.run(["fusermount3", "-u", "-z", str(child)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def getxattr(path: Path | str, name: str) -> str:
    return os.getxattr(path, name).decode()


def mount_options(mountpoint: Path) -> str:
    """The line /proc/self/mountinfo shows for `mountpoint` (its options among them)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(mountpoint):
                return line
    raise AssertionError(f"{mountpoint} is not in mountinfo")


def run_dcp_ranks(step_dirs: list[Path], timeout: float, at_once: bool = False) -> None:
    """Run tests/dcp_ranks.py as one gloo job, rank i saving to and loading from step_dirs[i]
    (each rank's path to the step on its own node's mount); every rank must succeed. With
    `at_once` every rank loads right after the barrier that follows the save."""
    finish_dcp_ranks(start_dcp_ranks(step_dirs, *(["--at-once"] if at_once else [])), timeout)


def start_dcp_ranks(step_dirs: list[Path], *options: str, paused: int | None = None,
                    pause: str = "after") -> list[subprocess.Popen[str]]:
    """Start the ranks of tests/dcp_ranks.py (see `run_dcp_ranks`) with these options; rank
    `paused` also gets --pause-after-write, or with `pause` "before" --pause-before-write
    (its stdin is a pipe: `resume_rank`)."""
    script = Path(__file__).with_name("dcp_ranks.py")
    port = str(free_port())
    return [subprocess.Popen([sys.executable, str(script), str(rank), str(len(step_dirs)),
                              port, str(step_dir), *options,
                              *([f"--pause-{pause}-write"] if rank == paused else [])],
                             stdin=subprocess.PIPE if rank == paused else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank, step_dir in enumerate(step_dirs)]


def wait_written(rank: subprocess.Popen[str], timeout: float = 120,
                 said: str = "written") -> None:
    """Until a rank started with --pause-after-write has written its shard (`said`
    "writing": one started with --pause-before-write is about to write it)."""
    assert rank.stdout is not None
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(rank.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert ready and ready[0].strip() == said, f"rank did not say {said!r}: {ready}"


def resume_rank(rank: subprocess.Popen[str]) -> None:
    """Let a rank paused after its write go on with the save."""
    assert rank.stdin is not None
    rank.stdin.write("go\n")
    rank.stdin.flush()


def finish_dcp_ranks(ranks: list[subprocess.Popen[str]], timeout: float) -> None:
    """Wait for every rank; each must succeed."""
    try:
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (out, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-3000:]
        assert "ok" in out


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """One real SeaweedFS S3 server for the whole run, on free loopback ports."""
    # Every test's bucket is a SeaweedFS collection that takes several volumes of its own as it
    # grows (not preallocated): the default 64 run out before the suite ends.
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"), volumes=1000)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(s3_server: SeaweedS3) -> str:
    name = f"t-{uuid.uuid4().hex[:16]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_env(s3_server: SeaweedS3) -> dict[str, str]:
    """The environment a tierfs daemon (or any S3 client) needs to reach the test server."""
    return dict(os.environ, AWS_ACCESS_KEY_ID=s3_server.access_key,
                AWS_SECRET_ACCESS_KEY=s3_server.secret_key, AWS_DEFAULT_REGION="us-east-1",
                AWS_ENDPOINT_URL=s3_server.endpoint)


@contextlib.contextmanager
def own_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's spelling: 4m) of the test's own at `path`, lazily
    unmounted after it."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, as a small or shared /dev/shm would be."""
    with own_tmpfs(tmp_path / "shm", "4m") as shm:
        yield shm


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs of the test's own (a RAM dir's file system that fills)."""
    with own_tmpfs(tmp_path / "small", "24m") as path:
        yield path


class FuseRequestTrace:
    """The kernel's `fuse_request_send` tracepoint, in a tracefs mount and trace instance of
    the test's own: no machine needs tracefs mounted beforehand, and tests on other workers
    tracing at the same time fill buffers of their own."""

    def __init__(self, tmp_path: Path) -> None:
        self._mountpoint = tmp_path / "tracefs"
        self._instance = self._mountpoint / "instances" / f"tierfs-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> FuseRequestTrace:
        self._mountpoint.mkdir()
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(self._mountpoint)], check=True)
        try:
            self._instance.mkdir()
        except BaseException:
            subprocess.run(["umount", "-l", str(self._mountpoint)], check=False)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._event("enable", "0")
        self._instance.rmdir()
        subprocess.run(["umount", "-l", str(self._mountpoint)], check=False)

    def _event(self, name: str, value: str) -> None:
        (self._instance / "events/fuse/fuse_request_send" / name).write_text(value)

    def start(self) -> None:
        (self._instance / "trace").write_text("")
        self._event("enable", "1")

    def stop(self) -> None:
        self._event("enable", "0")

    def requests(self, pid: int) -> list[str]:
        """The opcodes (`FUSE_GETATTR`, ...) of the requests process `pid` sent while tracing."""
        lines = (self._instance / "trace").read_text().splitlines()
        return [line.rsplit("(", 1)[1].split(")", 1)[0]
                for line in lines if f"-{pid} " in line and "fuse_request_send" in line]


@pytest.fixture
def fuse_trace(tmp_path: Path) -> Iterator[FuseRequestTrace]:
    with FuseRequestTrace(tmp_path) as trace:
        yield trace


def fill(path: Path) -> None:
    """Take every free byte of the file system `path` is on (another user of /dev/shm)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.token"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


@pytest.fixture
def cluster3(mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> Cluster:
    from tests.harness import Cluster

    cluster = Cluster(mounts, token_file, 3, etcd_server)
    for node_id in cluster.ports:
        cluster.start(node_id)
    return cluster
