"""Scale on loopback: 24 real daemons (FUSE mounts, one cluster on the session etcd).

Two properties of a cluster whose work per node must not grow with N:

- idle CPU per daemon is flat in N: measured from /proc/<pid>/stat (utime + stime) over a
  window with 4 daemons and again with 24, the mean per daemon at 24 is within 1.5x of the
  mean at 4, plus an absolute floor of IDLE_FLOOR (percent of one core), so that two figures
  both near 0 % cannot fail on clock-tick noise;
- a commit is visible everywhere within a second: a step saved on one node reads `committed`
  (`user.tierfs.state`) on all 24 mounts within 1 s of the save's return.

Daemons are started in parallel (the machine has 2 cores) and stopped in parallel.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, free_port, getxattr, pid_alive, wait_until
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

SMALL, LARGE = 4, 24
WINDOW = 8.0  # seconds of idle measured at each size
IDLE_RATIO = 1.5
IDLE_FLOOR = 0.3  # percent of one core: below this, a difference is noise, not growth
VISIBLE_WITHIN = 1.0  # seconds from the save's return to `committed` on every mount
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Daemons starting at once: more only queue for the 2 cores (and once starved a daemon past its
# lease's ttl before it registered: tests/test_membership_stall.py).
START_AT_ONCE = 6


class ScaleCluster:
    """LARGE node ids with their peer ports, of which any may be started (in parallel)."""

    def __init__(self, mounts: MountFactory, etcd: Etcd) -> None:
        self.mounts = mounts
        self.url = etcd.cluster_url(f"test/{mounts.tmp_path.name}")
        self.token_file = mounts.tmp_path / "cluster.token"
        self.token_file.write_bytes(os.urandom(32).hex().encode())
        self.token_file.chmod(0o600)
        self.nodes: dict[str, Mount] = {}

    def start(self, node_ids: list[str]) -> None:
        with ThreadPoolExecutor(START_AT_ONCE) as pool:
            started = pool.map(self._start_one, node_ids)
            self.nodes.update(zip(node_ids, started, strict=True))

    def _start_one(self, node_id: str) -> Mount:
        return self.mounts.mount("--node-id", node_id, "--cluster", self.url,
                                 "--listen", f"127.0.0.1:{free_port()}",
                                 "--token-file", str(self.token_file))

    def all_see_each_other(self) -> bool:
        want = len(self.nodes) - 1
        for mount in self.nodes.values():
            peers = mount.status()["peers"]
            if sum(1 for p in peers if p["up"]) != want:
                return False
        return True

    def stop_all(self) -> None:
        """Unmount and SIGTERM every daemon at once, then wait (the fixture's cleanup, which
        stops them one after another, then finds nothing left to do)."""
        for mount in self.nodes.values():
            subprocess.run(["fusermount3", "-u", "-z", str(mount.mountpoint)],
                           capture_output=True)
            if pid_alive(mount.pid):
                os.kill(mount.pid, signal.SIGTERM)
        for mount in self.nodes.values():
            wait_until(lambda m=mount: not pid_alive(m.pid), timeout=20, interval=0.1)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def idle_cpu_percent(mounts: list[Mount]) -> float:
    """Mean CPU per daemon over WINDOW, in percent of one core. The window is a measurement,
    not a wait for a condition: nothing happens in it by design."""
    before = [cpu_seconds(m.pid) for m in mounts]
    start = time.monotonic()
    time.sleep(WINDOW)
    elapsed = time.monotonic() - start
    after = [cpu_seconds(m.pid) for m in mounts]
    used = sum(a - b for a, b in zip(after, before, strict=True))
    return 100 * used / elapsed / len(mounts)


def write_step(step_dir: Path) -> None:
    """A one-rank DCP save: a shard, then .metadata.tmp renamed to .metadata."""
    step_dir.mkdir(parents=True)
    (step_dir / "__0_0.distcp").write_bytes(os.urandom(1 << 20))
    (step_dir / ".metadata.tmp").write_bytes(b"meta")
    os.rename(step_dir / ".metadata.tmp", step_dir / ".metadata")


def committed_on(mount: Mount, relative: str) -> bool:
    try:
        return getxattr(mount / relative, "user.tierfs.state") == "committed"
    except OSError:  # not listed there yet
        return False


def test_idle_cpu_flat_in_n_and_commit_visible_everywhere(mounts: MountFactory,
                                                          etcd_server: Etcd) -> None:
    cluster = ScaleCluster(mounts, etcd_server)
    ids = [f"node{i:02d}" for i in range(LARGE)]
    try:
        cluster.start(ids[:SMALL])
        wait_until(cluster.all_see_each_other, timeout=30, interval=0.5)
        idle_small = idle_cpu_percent(list(cluster.nodes.values()))

        cluster.start(ids[SMALL:])
        wait_until(cluster.all_see_each_other, timeout=60, interval=0.5)
        idle_large = idle_cpu_percent(list(cluster.nodes.values()))

        write_step(cluster.nodes[ids[0]] / "run/step_1")
        saved = time.monotonic()
        pending = list(cluster.nodes.values())
        while pending and time.monotonic() - saved <= VISIBLE_WITHIN:
            pending = [m for m in pending if not committed_on(m, "run/step_1")]
            time.sleep(0.005)  # a poll interval: leave the 2 cores to the daemons
        visible = time.monotonic() - saved
        print(f"idle CPU per daemon: {idle_small:.2f} % at {SMALL} nodes, "
              f"{idle_large:.2f} % at {LARGE}; committed on all {LARGE} mounts "
              f"{visible:.3f} s after the save returned")
        assert not pending, (f"run/step_1 not committed within {VISIBLE_WITHIN} s on "
                             f"{len(pending)} of {LARGE} mounts")
        assert idle_large <= IDLE_RATIO * idle_small + IDLE_FLOOR, (
            f"idle CPU per daemon grew with N: {idle_small:.2f} % at {SMALL} nodes, "
            f"{idle_large:.2f} % at {LARGE}")
    finally:
        cluster.stop_all()
