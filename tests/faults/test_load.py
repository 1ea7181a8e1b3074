"""Load: 8 writer processes save into one step at once, then 8 readers load it back; steps
alternate between a 2,000-file step (8 x 250 small files) and a step of 8 large shards; old
steps are removed as a job's retention would. Repeated for minutes in the full run, while the
daemon's open file descriptors (/proc/PID/fd) and RSS must stay flat: no leak per cycle.
Counts and figures go to tests/faults/results/load.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, getxattr, wait_until
from tests.faults.conftest import FULL, report, scale

pytestmark = pytest.mark.faults

WORKER = str(Path(__file__).with_name("load_worker.py"))
RANKS = 8
SHAPES = {"2,000 files": (250, 16 << 10), "8 large shards": (1, 6 << 20)}
DURATION = 180.0 if FULL else 0.0  # seconds of cycles after the warm-up (full run)
FD_SLACK = 4
RSS_SLACK = 48 << 20


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def daemon_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def run_workers(args: list[list[str]]) -> list[dict[str, str]]:
    """Start every worker at once; each must succeed; their JSON answers."""
    procs = [subprocess.Popen([sys.executable, WORKER, *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in args]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            results.append(json.loads(out))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return results


def cycle(mnt: Mount, number: int, shape: str) -> tuple[int, int]:
    """One save by 8 writers and one load by 8 readers; returns (files, bytes) checked."""
    files, size = SHAPES[shape]
    step_dir = mnt / f"load/step_{number}"
    written: dict[str, str] = {}
    for answer in run_workers([["write", str(step_dir), str(rank), str(files), str(size),
                                str(number)] for rank in range(RANKS)]):
        written |= answer
    (step_dir / ".metadata").write_bytes(b"metadata of step %d" % number)  # the commit
    wait_until(lambda: getxattr(step_dir, "user.tierfs.state") == "committed", timeout=60)
    assert len(os.listdir(step_dir)) == RANKS * files + 1
    read: dict[str, str] = {}
    for answer in run_workers([["read", str(step_dir), str(rank)] for rank in range(RANKS)]):
        read |= answer
    assert read == written, f"step_{number}: {len(set(read.items()) ^ set(written.items()))} " \
                            "files read back differ from what was written"
    for name, digest in written.items():
        assert getxattr(step_dir / name, "user.tierfs.xxh3") == digest, name
    return len(written) + 1, size * len(written)


@pytest.mark.timeout(scale(240, 900))
def test_eight_writers_many_files_repeated_cycles_without_leaks(mounts: MountFactory) -> None:
    mnt = mounts.mount("--ram-limit", "2G")
    started = time.monotonic()
    shapes = list(SHAPES)
    number = 0
    files_checked = bytes_checked = 0
    samples: list[dict[str, float]] = []

    def one_cycle() -> None:
        nonlocal number, files_checked, bytes_checked
        number += 1
        files, size = cycle(mnt, number, shapes[number % 2])
        files_checked += files
        bytes_checked += size
        for old in range(1, number - 1):  # keep the last two steps
            if (mnt / f"load/step_{old}").exists():
                shutil.rmtree(mnt / f"load/step_{old}")
        samples.append({"cycle": number, "fds": daemon_fds(mnt.pid),
                        "rss_mib": round(daemon_rss(mnt.pid) / 2**20, 1),
                        "t": round(time.monotonic() - started, 1)})

    for _ in range(scale(2, 4)):  # warm-up: both shapes, so caches and pools have their size
        one_cycle()
    warm = samples[-1]
    timed = time.monotonic()
    while True:
        one_cycle()
        if time.monotonic() - timed >= DURATION and number >= scale(4, 12):
            break
    end = samples[-1]
    figures = {"cycles": number, "writer_processes": RANKS, "files_checked": files_checked,
               "bytes_checked": bytes_checked, "seconds": round(time.monotonic() - started, 1),
               "fds_after_warmup": warm["fds"], "fds_end": end["fds"],
               "fds_max": max(s["fds"] for s in samples),
               "rss_mib_after_warmup": warm["rss_mib"], "rss_mib_end": end["rss_mib"],
               "rss_mib_max": max(s["rss_mib"] for s in samples), "samples": samples}
    report("load", figures)
    assert end["fds"] <= warm["fds"] + FD_SLACK, samples
    assert max(s["fds"] for s in samples[3:]) <= warm["fds"] + FD_SLACK, samples
    assert end["rss_mib"] <= warm["rss_mib"] + RSS_SLACK / 2**20, samples
    assert mnt.status()["ram"]["used_bytes"] <= 2 * 8 * (6 << 20) + (8 << 20)
