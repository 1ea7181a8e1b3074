"""Where the daemon's time goes when file data passes through it, and what passthrough removes.

Writes then reads 1 GiB (64 MiB calls) on two mounts, one with --no-passthrough and one
without, and reports per GiB: the daemon's CPU seconds, its system calls (strace -c), and the
Python functions it spent its samples in (py-spy, if installed). Output: profile.md in --out.

    python bench/data_path_profile.py --out bench/results
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZE = 1 << 30
CALL = 64 << 20
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def tierfs(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "tierfs", *args], check=True,
                          capture_output=True, text=True).stdout


def write_and_read(path: Path) -> float:
    block = os.urandom(CALL)
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(SIZE // CALL):
            f.write(block)
    with open(path, "rb") as f:
        while f.read(CALL):
            pass
    return time.perf_counter() - started


def profile(mountpoint: Path, pid: int, work: Path, name: str) -> dict[str, object]:
    """One pass under strace -c and py-spy together, after a timed pass without them."""
    cpu_before = cpu_seconds(pid)
    seconds = write_and_read(mountpoint / "timed")
    cpu = cpu_seconds(pid) - cpu_before
    os.unlink(mountpoint / "timed")
    strace_out = work / f"{name}.strace"
    spy_out = work / f"{name}.spy"
    tracers = [subprocess.Popen(["strace", "-c", "-f", "-o", str(strace_out), "-p", str(pid)],
                                stderr=subprocess.DEVNULL)]
    if shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy"):
        spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
        tracers.append(subprocess.Popen([spy, "record", "--nonblocking", "-p", str(pid),
                                         "-f", "raw", "-r", "250",
                                         "-o", str(spy_out)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))
    time.sleep(1)
    write_and_read(mountpoint / "traced")
    for tracer in tracers:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=60)
    os.unlink(mountpoint / "traced")
    return {"seconds": seconds, "cpu_seconds": cpu, "syscalls": _syscalls(strace_out),
            "functions": _functions(spy_out)}


def _syscalls(path: Path) -> dict[str, int]:
    calls = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return dict(sorted(calls.items(), key=lambda item: -item[1])[:6])


def _functions(path: Path) -> dict[str, float]:
    """Share of samples per innermost Python function (raw py-spy: 'frames;... count')."""
    if not path.exists():
        return {}
    leaves: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaves[stack.split(";")[-1].split(" (")[0]] += int(count)
    total = sum(leaves.values()) or 1
    return {name: round(100 * n / total, 1) for name, n in leaves.most_common(8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierfs-profile-"))
    results, mounts = {}, []
    try:
        for name, options in (("through the daemon", ["--no-passthrough"]), ("passthrough", [])):
            mountpoint = work / name.replace(" ", "-")
            mountpoint.mkdir()
            ram_dir = f"/dev/shm/tierfs-profile-{os.getpid()}-{len(mounts)}"
            tierfs("mount", str(mountpoint), "--ram-dir", ram_dir, *options)
            pid = json.loads(tierfs("status", str(mountpoint), "--json"))["pid"]
            mounts.append((mountpoint, pid, ram_dir))
            results[name] = profile(mountpoint, pid, work, name.replace(" ", "-"))
    finally:
        for mountpoint, pid, ram_dir in mounts:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(ram_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    gib = SIZE / 2**30
    lines = [f"Write then read {gib:.0f} GiB in {CALL >> 20} MiB calls, per GiB moved each way:",
             ""]
    for name, r in results.items():
        lines.append(f"- **{name}**: {2 * gib / r['seconds']:.2f} GiB/s; daemon CPU "
                     f"{r['cpu_seconds'] / gib:.2f} s per GiB written and read; system calls "
                     f"(whole traced pass): "
                     + ", ".join(f"{k} {v:,}" for k, v in r["syscalls"].items())
                     + "; Python samples: "
                     + (", ".join(f"{k} {v}%" for k, v in r["functions"].items()) or "n/a"))
    text = "\n".join(lines)
    (out / "profile.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
