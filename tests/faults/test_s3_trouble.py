"""S3 trouble between tierfs and a real SeaweedFS, injected by a proxy on loopback: SlowDown
storms, slow responses, dropped connections and lost replies, multipart uploads cut in the
middle of a part, the store down, and a daemon killed while its upload was cut off.

Throughout, checked every few hundred milliseconds: nothing listed that is not a complete
committed step, a step leaves RAM only once it is really in S3 (its objects are fetched directly
from SeaweedFS and compared), and reads return the right bytes or EIO. Once the trouble ends,
`tierfs flush` completes and every step reads back byte-identical, from S3."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tests.faults.results_io import pick, write_results
from tests.test_torch import assert_state_equal
from tierfs.devtools.s3_proxy import Fault, Request, S3Proxy
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = [pytest.mark.faults, pytest.mark.filterwarnings("ignore::UserWarning")]

MANIFEST = ".tierfs-manifest"


def training_state(seed: int, megabytes: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"embedding": torch.randn(megabytes << 18, generator=generator),  # megabytes MiB
            "head.weight": torch.randn(256, 256, generator=generator),
            "step": torch.tensor([seed])}


@dataclass
class Ledger:
    """What was saved (file hashes as read back right after the save) and what was seen."""

    bucket: str
    client: Any
    saved: dict[str, dict[str, str]] = field(default_factory=dict)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    checked_in_s3: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=lambda: {
        "status_polls": 0, "steps_seen_evicted": 0, "reads_ok": 0, "reads_eio": 0,
        "wrong_bytes": 0, "unsafe_evictions": 0, "incomplete_steps_listed": 0, "lost_steps": 0})

    def s3_keys(self, step: str) -> dict[str, int]:
        reply = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"ckpt/{step}/")
        return {o["Key"].rsplit("/", 1)[1]: o["Size"] for o in reply.get("Contents", [])}

    def s3_bytes_match(self, step: str) -> bool:
        """Every file of `step` is in S3 (read directly, not through the proxy), hashing to
        what was saved, and its manifest is there."""
        keys = self.s3_keys(step)
        if MANIFEST not in keys or not set(self.saved[step]) <= set(keys):
            return False
        for name, digest in self.saved[step].items():
            body = self.client.get_object(Bucket=self.bucket,
                                          Key=f"ckpt/{step}/{name}")["Body"].read()
            if xxhash.xxh3_128_hexdigest(body) != digest:
                return False
        return True

    def check(self, mnt: Mount) -> None:
        """The invariants that must hold at every moment of the trouble."""
        self.counts["status_polls"] += 1
        for step in mnt.status()["steps"]:
            path = step["path"]
            if step["state"] != "committed" or path not in self.saved:
                self.counts["incomplete_steps_listed"] += 1
                raise AssertionError(f"listed but not a complete committed step: {step}")
            if not step["ram"]:
                self.counts["steps_seen_evicted"] += 1
                if not step["persisted"]:
                    self.counts["unsafe_evictions"] += 1
                    raise AssertionError(f"{path} left RAM without being persisted")
            if step["persisted"] and path not in self.checked_in_s3:
                if not self.s3_bytes_match(path):
                    self.counts["unsafe_evictions"] += 1
                    raise AssertionError(f"{path} is called persisted but S3 lacks it")
                self.checked_in_s3.add(path)

    def read_back(self, mnt: Mount, step: str) -> None:
        """Read every file of `step` through the mount: the right bytes, or EIO."""
        for name, digest in self.saved[step].items():
            try:
                data = (mnt / step / name).read_bytes()
            except OSError as exc:
                assert exc.errno == errno.EIO, exc
                self.counts["reads_eio"] += 1
                continue
            if xxhash.xxh3_128_hexdigest(data) != digest:
                self.counts["wrong_bytes"] += 1
                raise AssertionError(f"wrong bytes served for {step}/{name}")
            self.counts["reads_ok"] += 1


def save_step(mnt: Mount, ledger: Ledger, step: str, seed: int, megabytes: int) -> None:
    state = training_state(seed, megabytes)
    dcp.save(state, storage_writer=FileSystemWriter(mnt / step, thread_count=2))
    ledger.states[step] = state
    ledger.saved[step] = {name: xxhash.xxh3_128_hexdigest((mnt / step / name).read_bytes())
                          for name in os.listdir(mnt / step)}
    assert mnt.step(step)["state"] == "committed"


def watch(mnt: Mount, ledger: Ledger, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ledger.check(mnt)
        time.sleep(0.3)


def oldest_evicted(mnt: Mount) -> str | None:
    for step in mnt.status()["steps"]:
        if not step["ram"]:
            return step["path"]
    return None


PlanMaker = Callable[[float], Callable[[Request], Fault | None]]


def phases(rng: random.Random) -> list[tuple[str, PlanMaker]]:
    """(name, make_plan(start time)) for each kind of trouble. Each leaves a chance to get
    through (or ends), so the step saved in the phase is persisted while it lasts."""
    lock = threading.Lock()

    def chance(p: float) -> bool:
        with lock:
            return rng.random() < p

    def storm(start: float) -> Callable[[Request], Fault | None]:
        # Every request refused for 2.5 s, then one in five.
        return lambda r: Fault("slowdown") if time.monotonic() - start < 2.5 or chance(0.2) \
            else None

    def slow(start: float) -> Callable[[Request], Fault | None]:
        return lambda r: Fault("slow", delay=pick(0.1, 0.2) + pick(0.6, 1.3) * rng.random()) \
            if chance(0.7) else None

    def flaky(start: float) -> Callable[[Request], Fault | None]:
        def plan(r: Request) -> Fault | None:
            if chance(0.12):
                return Fault("drop", fraction=rng.random())
            if chance(0.05):
                return Fault("lost_reply")
            return None
        return plan

    def cut_parts(start: float) -> Callable[[Request], Fault | None]:
        # The first parts after the first are cut in the middle (half a part sent).
        cut, cuts = [0], pick(3, 6)

        def plan(r: Request) -> Fault | None:
            with lock:
                if r.is_upload_part and r.part_number >= 2 and cut[0] < cuts:
                    cut[0] += 1
                    return Fault("drop", fraction=0.5)
            return None
        return plan

    def down(start: float) -> Callable[[Request], Fault | None]:
        return lambda r: Fault("down") if time.monotonic() - start < 3 else None

    return [("slowdown_storm", storm), ("slow_responses", slow), ("dropped_connections", flaky),
            ("multipart_cut", cut_parts), ("s3_down", down)]


def watch_until_persisted(mnt: Mount, ledger: Ledger, step: str, timeout: float) -> None:
    def persisted() -> bool:
        ledger.check(mnt)
        return mnt.step(step)["persisted"]

    wait_until(persisted, timeout=timeout, interval=0.3)
    ledger.check(mnt)


def test_s3_trouble_loses_nothing_and_evicts_nothing_unsafely(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str, s3_env: dict[str, str]) -> None:
    started = time.monotonic()
    rng = random.Random(6)
    rounds = pick(1, 4)
    megabytes = pick(20, 48)  # > 16 MiB: multipart uploads of 16 MiB parts
    watch_seconds = pick(1.0, 3.0)
    ledger = Ledger(bucket, s3_server.client())
    with S3Proxy(s3_server.endpoint) as proxy:
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
        args = ("--persist", f"s3://{bucket}/ckpt", "--s3-endpoint", proxy.endpoint,
                "--keep-ram", "1")
        mnt = first_mount = mounts.mount(*args, env=env)
        number = 0
        seconds: dict[str, float] = {}
        for _round in range(rounds):
            for name, make_plan in phases(rng):
                phase_started = time.monotonic()
                before = proxy.faults
                proxy.plan = make_plan(time.monotonic())
                number += 10
                step = f"run/step_{number}"
                save_step(mnt, ledger, step, number, megabytes)
                watch(mnt, ledger, watch_seconds)
                watch_until_persisted(mnt, ledger, step, timeout=180)
                evicted = oldest_evicted(mnt)
                if evicted is not None:
                    ledger.read_back(mnt, evicted)  # from S3, through the trouble
                ledger.check(mnt)
                proxy.plan = None
                assert proxy.faults > before, f"phase {name} injected nothing"
                seconds[name] = round(seconds.get(name, 0) + time.monotonic() - phase_started, 1)
                watch(mnt, ledger, 0.5)

        # An upload cut off for good (every part dropped), then the daemon is killed: S3 holds
        # objects of the step but no manifest. A fresh node must not list it (and removes the
        # leftovers); the original node, back on its RAM dir, uploads it once S3 behaves.
        tierfs("flush", str(mnt.mountpoint), "--timeout", "180", env=env)
        proxy.plan = lambda r: Fault("drop", fraction=0.5) if r.is_upload_part else None
        number += 10
        cut = f"run/step_{number}"
        save_step(mnt, ledger, cut, number, megabytes)
        wait_until(lambda: ledger.s3_keys(cut), timeout=60)  # the small files are up
        assert MANIFEST not in ledger.s3_keys(cut)
        mnt.kill9()
        proxy.plan = None
        complete = [s for s in ledger.saved if s != cut]
        fresh = mounts.mount(*args, env=env)
        listed = [s["path"] for s in fresh.status()["steps"]]
        assert listed == complete, listed
        if cut in listed:
            ledger.counts["incomplete_steps_listed"] += 1
        assert not ledger.s3_keys(cut)  # the incomplete upload was cleaned up
        ledger.read_back(fresh, complete[0])
        tierfs("umount", str(fresh.mountpoint))
        mnt = mounts.remount(mnt, env=env)
        assert mnt.step(cut)["state"] == "committed" and mnt.step(cut)["ram"]

        # The trouble is over: everything reaches S3, and reads back identical.
        tierfs("flush", str(mnt.mountpoint), "--timeout", "180", env=env)
        ledger.check(mnt)
        status = {s["path"]: s for s in mnt.status()["steps"]}
        assert sorted(status) == sorted(ledger.saved)
        for path in ledger.saved:
            assert status[path]["persisted"], path
            if not ledger.s3_bytes_match(path):
                ledger.counts["lost_steps"] += 1
                raise AssertionError(f"{path} is not intact in S3")
        newest = max(ledger.saved, key=lambda p: int(p.rsplit("_", 1)[1]))
        wait_until(lambda: [p for p, s in {x["path"]: x for x in mnt.status()["steps"]}.items()
                            if s["ram"]] == [newest], timeout=30)
        for path in ledger.saved:
            before_eio = ledger.counts["reads_eio"]
            ledger.read_back(mnt, path)
            assert ledger.counts["reads_eio"] == before_eio, f"{path} unreadable after trouble"
        first = min(ledger.saved, key=lambda p: int(p.rsplit("_", 1)[1]))
        for path in (first, newest):
            restored = {k: torch.zeros_like(v) for k, v in ledger.states[path].items()}
            dcp.load(restored, storage_reader=FileSystemReader(mnt / path))
            assert_state_equal(ledger.states[path], restored)
        log = first_mount.log()
        assert "retrying" in log and "Step run/step_10: persisted to" in log

    counts = dict(ledger.counts)
    assert counts["wrong_bytes"] == counts["unsafe_evictions"] == 0
    assert counts["lost_steps"] == counts["incomplete_steps_listed"] == 0
    faults = {k.removeprefix("fault:"): v for k, v in proxy.counts.items()
              if k.startswith("fault:")}
    write_results("s3_trouble", {
        "steps_saved": len(ledger.saved), "bytes_saved_per_step": megabytes << 20,
        "requests_proxied": proxy.counts["requests"], "faults_injected": proxy.faults,
        "faults_by_kind": faults, "daemon_kills_mid_upload": 1, **counts, "phase_seconds": seconds,
        "seconds": round(time.monotonic() - started, 1)})


def test_proxy_passes_requests_through_unchanged(s3_server: SeaweedS3, bucket: str,
                                                 tmp_path: Path) -> None:
    """The proxy itself: a clean pass-through (multipart included), and each fault observed
    by a plain boto3 client as the error a real store would give."""
    import boto3
    import botocore.config
    import botocore.exceptions as bce

    with S3Proxy(s3_server.endpoint) as proxy:
        client = boto3.client(
            "s3", endpoint_url=proxy.endpoint, aws_access_key_id=s3_server.access_key,
            aws_secret_access_key=s3_server.secret_key, region_name="us-east-1",
            config=botocore.config.Config(retries={"total_max_attempts": 1},
                                          s3={"addressing_style": "path"}))
        data = os.urandom(20 << 20)
        source = tmp_path / "obj"
        source.write_bytes(data)
        from boto3.s3.transfer import TransferConfig

        client.upload_file(str(source), bucket, "k/big", Config=TransferConfig(
            multipart_threshold=8 << 20, multipart_chunksize=8 << 20))
        assert client.get_object(Bucket=bucket, Key="k/big")["Body"].read() == data
        proxy.plan = lambda r: Fault("slowdown")
        with pytest.raises(bce.ClientError, match="SlowDown"):
            client.put_object(Bucket=bucket, Key="k/x", Body=b"x")
        proxy.plan = lambda r: Fault("down")
        with pytest.raises((bce.ConnectionClosedError, bce.EndpointConnectionError)):
            client.get_object(Bucket=bucket, Key="k/big")
        proxy.plan = None
        assert client.head_object(Bucket=bucket, Key="k/big")["ContentLength"] == len(data)
        assert proxy.counts["fault:slowdown"] == 1 and proxy.counts["fault:down"] == 1
