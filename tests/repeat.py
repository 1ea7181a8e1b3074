"""Chase a flaky test: run it N times in a row, each run a fresh pytest process, optionally
beside busy loops that keep every core loaded (most races of a two-core machine show only when
a process is preempted at the wrong moment), and stop at the first failure with its output.

    make test-repeat TEST=tests/test_mount_errors.py::test_x N=30 LOAD=1
    python tests/repeat.py tests/test_mount_errors.py::test_x --runs 30 --load-per-core 1

The busy loops are child processes of this one: they are ended by their pids when the runs end,
however that happens (a failure, Ctrl-C, SIGTERM), and the kernel kills them if this process
dies first (PR_SET_PDEATHSIG). An interrupted run is given the time its fixtures take to tear
down. It imports nothing of tierfs: the runs test the checkout that pytest finds (PYTHONPATH,
or the installed package).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

PR_SET_PDEATHSIG = 1
BUSY_LOOP = "while True: pass"


def _die_with_parent() -> None:
    """In a busy loop's process, before it runs: SIGKILL when its parent (this runner) dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextmanager
def cpu_load(processes: int) -> Iterator[list[int]]:
    """`processes` busy loops at normal priority for the duration; their pids."""
    loops: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            loops.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP],
                                          preexec_fn=_die_with_parent))
        yield [loop.pid for loop in loops]
    finally:
        for loop in loops:
            loop.kill()  # by the pid Popen holds; the process is ours and not yet reaped
        for loop in loops:
            loop.wait()


class Terminated(Exception):
    """SIGTERM reached this process (Ctrl-C reaches pytest too: a KeyboardInterrupt here)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def run_once(tests: list[str], pytest_args: list[str]) -> tuple[bool, float, str]:
    """One fresh pytest run of `tests`: (passed, seconds, its output). Interrupted, pytest is
    left to tear its mounts and servers down before this returns (its fixtures do that on
    SIGINT, not on SIGKILL)."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        with subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *pytest_args, *tests], stdout=output,
                              stderr=subprocess.STDOUT) as run:
            try:
                run.wait()
            except (Terminated, KeyboardInterrupt) as exc:
                if isinstance(exc, Terminated):
                    run.send_signal(signal.SIGINT)  # a Ctrl-C has reached it already
                run.wait()
                raise
        output.seek(0)
        # (exit 5, nothing collected: a misspelt test id, is a failure too)
        return run.returncode == 0, time.monotonic() - started, output.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="+", metavar="TEST", help="pytest node ids or files")
    parser.add_argument("--runs", type=int, default=30, help="runs in a row (default 30)")
    parser.add_argument("--load-per-core", type=int, default=0, metavar="K",
                        help="busy loops per core beside the runs (default 0: no load)")
    parser.add_argument("--pytest-args", default="", metavar="ARGS",
                        help="more pytest arguments, one string (e.g. '-x -k name')")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_terminated)
    busy = args.load_per_core * (os.cpu_count() or 1)
    seconds: list[float] = []
    started = time.monotonic()
    try:
        with cpu_load(busy) as pids:
            load = f"{busy} busy loops (pids {' '.join(map(str, pids))})" if busy else "no load"
            print(f"repeat: {args.runs} runs of {' '.join(args.tests)} beside {load}",
                  flush=True)
            for number in range(1, args.runs + 1):
                passed, took, output = run_once(args.tests, args.pytest_args.split())
                seconds.append(took)
                print(f"run {number}/{args.runs}: {'passed' if passed else 'FAILED'} "
                      f"in {took:.1f} s", flush=True)
                if not passed:
                    print(output[-20000:])
                    print(f"repeat: failed at run {number} of {args.runs} ({number - 1} "
                          f"passed before it)")
                    return 1
    except (Terminated, KeyboardInterrupt):
        print(f"repeat: interrupted after {len(seconds)} runs", file=sys.stderr)
        return 130
    print(f"repeat: {args.runs} of {args.runs} runs passed beside {load} in "
          f"{time.monotonic() - started:.0f} s (a run: min {min(seconds):.1f} s, median "
          f"{statistics.median(seconds):.1f} s, max {max(seconds):.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
