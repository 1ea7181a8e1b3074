"""The FUSE floor of the bench's many-file rows: `fuse_floor.c` (a FUSE file system in C that
keeps files in memory and does nothing else) built with the machine's compiler and libfuse 3
(which `make install` puts there for pyfuse3) and mounted for one measurement. A row's ratio
to tmpfs on it is the least any FUSE daemon could reach on this machine. `pyfuse3_floor.py`
beside it is the same file system on pyfuse3 and trio: the least a daemon built as tierfs's
is (pyfuse3's dispatch and trio's loop per round trip) could reach."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).with_name("fuse_floor.c")


def build(work: Path) -> Path | None:
    """The floor's program, compiled into `work`; None (and why, printed) if it cannot be."""
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                           text=True)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if flags.returncode or compiler is None:
        print("FUSE floor left out: no C compiler or no libfuse3 headers (pkg-config fuse3)",
              flush=True)
        return None
    program = work / "fuse_floor"
    built = subprocess.run([compiler, "-O2", "-o", str(program), str(SOURCE),
                            *flags.stdout.split()], capture_output=True, text=True)
    if built.returncode:
        print(f"FUSE floor left out: it did not compile: {built.stderr.strip()[:300]}",
              flush=True)
        return None
    return program


PYTHON_FLOOR = Path(__file__).with_name("pyfuse3_floor.py")


@contextlib.contextmanager
def mounted(program: Path | list[str], mountpoint: Path) -> Iterator[Path]:
    """A floor (`program`, or a command line to which the mount point is added) mounted at
    `mountpoint` until the block ends (then lazily unmounted, and its process killed by pid if
    it has not ended by itself)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    command = [str(program)] if isinstance(program, Path) else list(program)
    process = subprocess.Popen([*command, str(mountpoint)])
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mountpoint):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the FUSE floor did not mount (exit {process.poll()})")
            time.sleep(0.05)
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
