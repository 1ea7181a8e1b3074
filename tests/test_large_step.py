"""Nothing stalls the file system, whatever a step's size: with a committed step of 50,000
files, `tierfs status` and the step's eviction from RAM run while a tiny file operation keeps
answering within a fraction of a second."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tests.test_crash import save
from tierfs import manifest as mf

pytestmark = pytest.mark.fuse

FILES = 50_000
CONTENTS = 500  # distinct contents, each shared by FILES // CONTENTS files (keeps tmpfs small)
MAX_STALL = 0.5  # seconds; the daemon aims at 50 ms, the margin is for a busy 2-core machine


def build_committed_step(ram_dir: Path, store: Path, step_path: str) -> None:
    """A committed, persisted step of FILES small files, laid out as a daemon leaves it in its
    RAM dir (tree files hard-linked to objects, manifest, persisted mark) and in a file://
    store: much faster than FILES creates through FUSE."""
    objects, step_dir, stored = ram_dir / "objects", ram_dir / "tree" / step_path, \
        store / step_path
    for directory in (objects, step_dir, stored):
        directory.mkdir(parents=True, exist_ok=True)
    ram_dir.chmod(0o700)
    blobs = [b"file content %06d\n" % i for i in range(CONTENTS)]
    digests = [mf.hash_bytes(blob) for blob in blobs]
    for blob, digest in zip(blobs, digests, strict=True):
        (objects / digest).write_bytes(blob)
        (stored / f".blob-{digest}").write_bytes(blob)
    entries = []
    for i in range(FILES):
        name, which = f"shard_{i:05d}.bin", i % CONTENTS
        os.link(objects / digests[which], step_dir / name)
        os.link(stored / f".blob-{digests[which]}", stored / name)
        entries.append(mf.FileEntry(name, len(blobs[which]), digests[which], 0, 0o644,
                                    (mf.chunk_digest(blobs[which]),)))
    for digest in digests:
        (stored / f".blob-{digest}").unlink()
    manifest = mf.encode(mf.StepManifest(step_path, 1, 1, "local", time.time_ns(),
                                         tuple(entries)))
    (step_dir / mf.MANIFEST_NAME).write_bytes(manifest)
    (step_dir / ".tierfs-persisted").write_text("1 persisted\n")
    (stored / mf.MANIFEST_NAME).write_bytes(manifest)


class StallProbe:
    """A tiny file operation in a loop (create, write one byte, close, stat, unlink), timing
    the slowest: what any program under the mount would feel while the daemon is busy."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.worst = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StallProbe:
        self.directory.mkdir()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            path = self.directory / f"probe{self.count}"
            started = time.monotonic()
            with open(path, "wb") as f:
                f.write(b"x")
            os.stat(path)
            os.unlink(path)
            self.worst = max(self.worst, time.monotonic() - started)
            self.count += 1


def test_status_and_eviction_of_a_50000_file_step_never_stall_the_mount(
        mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    ram_dir = mounts.new_ram_dir()
    build_committed_step(ram_dir, store, "run/step_1")
    mnt: Mount = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1",
                              ram_dir=ram_dir)
    wait_until(lambda: mnt.status()["ram_check"]["done"], timeout=60, interval=0.2)
    with StallProbe(mnt / "probe") as probe:
        for _ in range(3):
            started = time.monotonic()
            step = mnt.step("run/step_1")
            assert time.monotonic() - started < 5
            assert step["files"] == FILES and step["ram"] and step["persisted"]
        # a newer persisted step sends the big one out of RAM (--keep-ram 1)
        save(mnt / "run/step_2", {"model": b"M" * 1000, ".metadata": b"meta"})
        wait_until(lambda: "evicted run/step_1 v1 from RAM (50000 files" in mnt.log(),
                   timeout=60, interval=0.2)
        assert not mnt.step("run/step_1")["ram"]
        tierfs("flush", str(mnt.mountpoint), "--timeout", "30")
    print(f"{probe.count} probes, the slowest {probe.worst:.3f} s")
    assert probe.count > 10
    assert probe.worst < MAX_STALL, f"a file operation waited {probe.worst:.3f} s"
    assert (mnt / "run/step_1/shard_49999.bin").read_bytes() == b"file content %06d\n" % (
        49999 % CONTENTS)
