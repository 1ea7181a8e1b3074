"""Uploads to S3 leave the CPU to the training job: every file being uploaded shares one
bounded set of part threads, which run at a lower priority (issue 14)."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest

from tierfs.devtools.seaweed import SeaweedS3
from tierfs.s3tier.backend import open_backend
from tierfs.s3tier.s3_backend import PARALLEL_PARTS, UPLOAD_NICE


def thread_nices() -> dict[int, int]:
    """Nice value of each thread of this process (field 19 of /proc/self/task/<tid>/stat)."""
    nices = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                nices[int(tid)] = int(f.read().rsplit(") ", 1)[1].split()[16])
        except FileNotFoundError:
            continue  # ended meanwhile
    return nices


def test_parallel_uploads_share_a_few_low_priority_threads(
        s3_server: SeaweedS3, bucket: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    backend = open_backend(f"s3://{bucket}/up", s3_server.endpoint)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(thread_nices())
    files = {}
    for i in range(4):  # as the uploader sends them: 4 files at once, multipart each
        files[f"f{i}"] = os.urandom((33 << 20) + i)
        (tmp_path / f"f{i}").write_bytes(files[f"f{i}"])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(backend.put_file, f"step_1/{name}", tmp_path / name)
                       for name in files]:
            future.result()
    for name, data in files.items():
        assert backend.get_bytes(f"step_1/{name}") == data
    new = {tid: nice for tid, nice in thread_nices().items() if tid not in before}
    lowered = [tid for tid, nice in new.items() if nice == min(19, base + UPLOAD_NICE)]
    assert lowered, f"no upload thread runs at nice {base + UPLOAD_NICE}: {new}"
    # the parts of all four files went through one pool (+ its submission threads), not 4 x 4
    assert len(lowered) <= 2 * PARALLEL_PARTS + 2
