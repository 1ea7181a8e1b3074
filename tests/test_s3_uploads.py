"""Uploads to S3 against a real SeaweedFS: they leave the CPU to the training job (every file
being uploaded shares bounded sets of low-priority threads, issue 14), small files overlap
their round trips, and a file in parts gets through throttling and lost replies by retrying
each request alone (through the fault proxy, `tierfs.devtools.s3_proxy`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import trio

from tests.fakes import StepsForUploads
from tests.harness import committed_step
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.devtools.s3_proxy import Fault, Request, S3Proxy
from tierfs.devtools.seaweed import SeaweedS3
from tierfs.observe import Events
from tierfs.s3tier.backend import MANIFEST_KEY, open_backend
from tierfs.s3tier.interface import SMALL_FILE, SMALL_IN_FLIGHT
from tierfs.s3tier.s3_backend import PARALLEL_PARTS, UPLOAD_NICE
from tierfs.s3tier.uploader import PARALLEL_REQUESTS, Uploader

pytestmark = pytest.mark.store


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
    # the parts of all four files went through one pool, not 4 x 4
    assert len(lowered) <= PARALLEL_PARTS


class ThrottledStore:
    """An Uploader sending a committed step to SeaweedFS through the fault proxy, with
    5 MiB parts (S3's smallest) so that a small file has many."""

    def __init__(self, tmp: Path, server: SeaweedS3, bucket: str, proxy: S3Proxy) -> None:
        self.backend = open_backend(f"s3://{bucket}/up", proxy.endpoint)
        self.backend.part_size = 5 << 20
        self.objects = tmp / "objects"
        self.current: set[str] = set()
        self.persisted: list[str] = []
        steps = StepsForUploads(lambda xxh3: str(self.objects / xxh3),
                                lambda name: int(name.rpartition("_")[2]),
                                lambda m: m.path in self.current,
                                lambda m: self.persisted.append(m.path))
        self.uploader = Uploader(self.backend, steps, persist_every=1, keep_persist=0,
                                 events=Events())
        self.direct = server.client()  # not through the proxy
        self.bucket = bucket

    def step(self, path: str, files: dict[str, bytes]) -> mf.StepManifest:
        """A committed step, handed to the uploader."""
        self.current.add(path)
        manifest = committed_step(self.objects, path, files)
        self.uploader.submit(manifest)
        return manifest

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.uploader.run)
            yield
            nursery.cancel_scope.cancel()

    async def run_until(self, done: Callable[[], bool], timeout: float) -> None:
        async with self.running():
            await wait_for(done, timeout)

    def stored(self, key: str) -> bytes:
        return self.direct.get_object(Bucket=self.bucket, Key=f"up/{key}")["Body"].read()

    def unfinished_uploads(self) -> list[str]:
        reply = self.direct.list_multipart_uploads(Bucket=self.bucket)
        return [u["Key"] for u in reply.get("Uploads", [])]


async def wait_for(done: Callable[[], bool], timeout: float) -> None:
    await wait_until_async(done, timeout=timeout)


@pytest.fixture
def throttled(s3_server: SeaweedS3, bucket: str, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ThrottledStore, S3Proxy]]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with S3Proxy(s3_server.endpoint) as proxy:
        yield ThrottledStore(tmp_path, s3_server, bucket, proxy), proxy


async def test_a_file_of_many_parts_goes_up_while_every_third_request_is_refused(
        throttled: tuple[ThrottledStore, S3Proxy], caplog: pytest.LogCaptureFixture) -> None:
    """Steady throttling: each refused part is sent again alone. Retrying the whole file
    instead needed its 10 requests (start, 8 parts, completion) to pass in a row, which with
    every third refused never happens."""
    caplog.set_level(logging.INFO)
    store, proxy = throttled
    requests = itertools.count(1)
    proxy.plan = lambda r: Fault("slowdown") if next(requests) % 3 == 0 else None
    data = os.urandom((8 * 5 << 20) - 12345)
    manifest = store.step("run/step_1", {"shard": data, "small": b"x"})
    await store.run_until(lambda: store.persisted == ["run/step_1"], timeout=60)
    assert store.stored("run/step_1/shard") == data
    assert mf.decode(store.stored(f"run/step_1/{MANIFEST_KEY}")) == manifest
    assert proxy.counts["fault:slowdown"] >= 3
    assert re.search(r"upload of \S+shard part \d/8 failed \(attempt 1\)", caplog.text)


async def test_small_files_go_up_many_at_a_time_without_a_round_trip_more(
        throttled: tuple[ThrottledStore, S3Proxy]) -> None:
    """A step of many small files to a store a round trip away: their requests overlap, many
    more than PARALLEL_REQUESTS at once (4 at a time, a step of 2,000 small files took 24 s to
    a store 20 ms away, 2.6x boto3 putting them directly 10 at a time), and none waits for the
    store's `100 Continue` before its bytes (botocore asks every body to: a round trip more),
    while a larger file still does."""
    store, proxy = throttled
    arrivals: list[float] = []

    def plan(r: Request) -> Fault | None:
        if r.method == "PUT" and "/run/step_1/small_" in r.path:
            arrivals.append(time.monotonic())
        return Fault("distant", delay=0.5)

    proxy.plan = plan
    files = {f"small_{i}": os.urandom(4096 + i) for i in range(2 * SMALL_IN_FLIGHT)}
    large = os.urandom(SMALL_FILE + 1)  # one request still (the part size is 5 MiB)
    store.step("run/step_1", {**files, "large": large})
    await store.run_until(lambda: store.persisted == ["run/step_1"], timeout=60)
    assert all(store.stored(f"run/step_1/{name}") == data for name, data in files.items())
    assert store.stored("run/step_1/large") == large
    # No request ends within 0.5 s: those that came within 0.4 s of the first were in flight
    # together.
    together = sum(1 for t in arrivals if t - arrivals[0] < 0.4)
    assert SMALL_IN_FLIGHT // 2 <= together <= SMALL_IN_FLIGHT, together
    assert proxy.counts["expect-100-continue"] == 1  # the large file's


async def test_an_upload_the_store_lost_is_sent_again(
        throttled: tuple[ThrottledStore, S3Proxy], caplog: pytest.LogCaptureFixture) -> None:
    """The store no longer knows the upload (aborted meanwhile, as a lifecycle rule does, or
    completed by a request whose reply was lost): its parts are refused with NoSuchUpload,
    and the whole file is sent again rather than given up."""
    caplog.set_level(logging.INFO)
    store, proxy = throttled
    aborted = []

    def plan(r: Request) -> Fault | None:
        if r.is_upload_part and r.part_number == 2 and not aborted:
            upload_id = next(q.split("=", 1)[1] for q in r.query.split("&")
                             if q.startswith("uploadId="))
            store.direct.abort_multipart_upload(Bucket=store.bucket, Key=r.path.split("/", 2)[2],
                                                UploadId=upload_id)
            aborted.append(upload_id)
        return None

    proxy.plan = plan
    data = os.urandom(3 * 5 << 20)
    store.step("run/step_1", {"shard": data})
    await store.run_until(lambda: store.persisted == ["run/step_1"], timeout=60)
    assert aborted and store.stored("run/step_1/shard") == data
    assert "shard failed (attempt 1), retrying in" in caplog.text
    assert "the store lost the upload in parts" in caplog.text
    assert "upload of run/step_1/shard succeeded after 1 failed attempts" in caplog.text
    assert store.unfinished_uploads() == []


@pytest.mark.parametrize("ended_by", ["delete", "daemon-stop"])
async def test_an_upload_ended_midway_drops_its_parts(
        throttled: tuple[ThrottledStore, S3Proxy], caplog: pytest.LogCaptureFixture,
        ended_by: str) -> None:
    """An upload in parts ended while a part is refused: its step deleted (the next retry
    gives up), or the uploader cancelled as the daemon stops. The store is asked to drop the
    parts it holds: they would take space until a lifecycle rule removed them (a cancellation
    went past the clean-up, which caught Exception only, and left them)."""
    caplog.set_level(logging.INFO)
    store, proxy = throttled
    proxy.plan = lambda r: Fault("slowdown") if r.is_upload_part and r.part_number == 3 \
        else None
    store.step("run/step_1", {"shard": os.urandom(3 * 5 << 20)})
    async with store.running():
        await wait_for(lambda: "part 3/3 failed (attempt 1)" in caplog.text, timeout=30)
        assert store.unfinished_uploads() == ["up/run/step_1/shard"]
        if ended_by == "delete":
            store.current.clear()  # the next retry gives up
            await wait_for(lambda: "dropped" in caplog.text, timeout=30)
    assert store.unfinished_uploads() == []
    assert store.persisted == []


async def test_a_step_deleted_while_it_uploads_stops_after_the_requests_in_flight(
        throttled: tuple[ThrottledStore, S3Proxy], caplog: pytest.LogCaptureFixture) -> None:
    """A step deleted (or saved again) midway sends no more of its bytes: the requests in
    flight end, the others are not made, and the step queued behind it goes up at once. Every
    part of its files was sent before (the check came only after a failed request), in the
    bench a dropped step's whole upload ahead of the next save's."""
    caplog.set_level(logging.INFO)
    store, proxy = throttled
    parts: list[str] = []

    def plan(r: Request) -> Fault | None:
        if r.is_upload_part and "/step_1/" in r.path:
            parts.append(r.path)
            return Fault("slow", delay=0.3)  # an upload long enough to delete it midway
        return None

    proxy.plan = plan
    files = {f"shard{i}": os.urandom(8 * 5 << 20) for i in range(2)}  # 16 parts in all
    store.step("run/step_1", files)
    async with store.running():
        await wait_for(lambda: bool(parts), timeout=30)
        store.current.discard("run/step_1")  # deleted
        store.step("run/step_2", {"small": b"x"})
        await wait_for(lambda: store.persisted == ["run/step_2"], timeout=60)
        await wait_for(lambda: bool(re.search(r"upload of run/step_1 v\d+ dropped",
                                              caplog.text)), timeout=30)
    # at most the requests in flight when it was deleted, and the ones already let through
    assert len(parts) <= 2 * PARALLEL_REQUESTS, f"{len(parts)} of 16 parts sent"
    assert store.unfinished_uploads() == []
    assert store.stored("run/step_2/small") == b"x"
