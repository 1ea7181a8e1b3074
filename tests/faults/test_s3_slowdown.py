"""S3 past its request rate: a proxy on loopback answers 503 SlowDown above a few requests a
second, as S3 does past its per-prefix rates. The daemon backs off by its one retry policy
(`tierfs.retry`) and loses no step: every step saved reaches the store whole, the store never
takes more than the rate, and steps that left RAM read back identical through the limit, many
files at once."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xxhash

from tests.conftest import MountFactory, tierfs, wait_until
from tests.test_crash import save
from tierfs.devtools.s3_proxy import RateLimit, S3Proxy
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = pytest.mark.faults

STEPS = 3
FILES = 4  # per step, plus .metadata


def test_past_the_request_rate_the_daemon_backs_off_and_loses_no_step(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str, s3_env: dict[str, str]) -> None:
    limit = RateLimit(read_rps=8, write_rps=6)
    with S3Proxy(s3_server.endpoint) as proxy:
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
        mnt = mounts.mount("--persist", f"s3://{bucket}/ckpt", "--s3-endpoint", proxy.endpoint,
                           "--keep-ram", "1", env=env)
        proxy.plan = limit
        saved: dict[str, bytes] = {}
        for number in range(1, STEPS + 1):
            files = {f"shard_{i}.pt": os.urandom(200_000 + i) for i in range(FILES)}
            save(mnt / f"run/step_{number}", {**files, ".metadata": b"m%d" % number})
            saved.update({f"run/step_{number}/{name}": data for name, data in files.items()})
        tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=env)
        steps = {s["path"]: s for s in mnt.status()["steps"]}
        assert all(steps[f"run/step_{n}"]["persisted"] for n in range(1, STEPS + 1)), steps
        assert proxy.counts["fault:slowdown"] > 0  # the limit was reached
        assert limit.busiest_second("write") <= 6 * 1.2 + 1  # the store took at most its rate
        client = s3_server.client()
        for path, data in saved.items():  # whole in the store, byte for byte
            body = client.get_object(Bucket=bucket, Key=f"ckpt/{path}")["Body"].read()
            assert xxhash.xxh3_128_hexdigest(body) == xxhash.xxh3_128_hexdigest(data), path
        wait_until(lambda: sum(1 for s in mnt.status()["steps"] if not s["ram"]) == STEPS - 1,
                   timeout=30)
        before = proxy.counts["fault:slowdown"]

        def read(path: str) -> bool:
            return Path(mnt / path).read_bytes() == saved[path]

        with ThreadPoolExecutor(len(saved)) as pool:  # every evicted file at once
            evicted = [p for p in saved if not p.startswith(f"run/step_{STEPS}/")]
            assert all(pool.map(read, evicted))
        assert proxy.counts["fault:slowdown"] > before  # the reads were slowed down too
        assert limit.busiest_second("read") <= 8 * 1.2 + 1
    assert "retrying in" in mnt.log()
