"""The commit of a step of many small files (a file per tensor): no await between its check and
its change, while every FUSE request waits, so its cost per file is counted here in system
calls (a timing would say nothing on a shared machine): one link per new object, and no look
at objects/ before it (a link that finds the object there says so itself)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from tests.test_namespace import Harness

pytestmark = pytest.mark.core

FILES = 500


async def test_a_commit_makes_one_link_per_file_and_no_stat_of_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each file's object was looked for first (pathlib's exists: a stat of
    objects/<xxh3>), then linked."""
    harness = Harness(tmp_path / "ram")
    try:
        await commit_many(harness, monkeypatch)
    finally:
        harness.close()


async def commit_many(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {f"t{i:05}.distcp": i.to_bytes(8, "little") * 512 for i in range(FILES)}
    for name, data in files.items():
        await harness.write_file(f"run/step_2/{name}", data)
    objects = os.fsencode(harness.root / "objects")
    calls: Counter[str] = Counter()

    def counted(name: str, real):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            if any(isinstance(arg, str | bytes | Path) and os.fsencode(arg).startswith(objects)
                   for arg in args):
                calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in ("stat", "lstat", "link"):
        monkeypatch.setattr(os, name, counted(name, getattr(os, name)))
    await harness.write_file("run/step_2/.metadata.tmp", b"meta")  # DCP's last file
    await harness.rename("run/step_2/.metadata.tmp", "run/step_2/.metadata")  # its commit
    monkeypatch.undo()
    assert await harness.state("run/step_2") == "committed"
    manifest = harness.commits.receive_nowait()
    assert len(manifest.files) == FILES + 1
    assert calls["link"] == FILES + 1, calls
    assert calls["stat"] + calls["lstat"] == 0, calls
