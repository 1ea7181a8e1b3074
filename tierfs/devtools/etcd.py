"""A real single-member etcd on loopback, for tests and the demo.

`Etcd` runs the `etcd` binary (Debian package `etcd-server`) with its client and peer URLs on
free 127.0.0.1 ports and its own data dir, so it never meets a system etcd (which listens on
2379/2380). Its log goes to ``data_dir/etcd.log``, never to the test output. The process is
stopped by its own pid only; `restart()` keeps the ports and the data (an etcd outage in a
test).

    with Etcd(tmp_path) as etcd:
        url = etcd.cluster_url("tierfs/test")  # etcd://127.0.0.1:PORT/tierfs/test
        etcd.restart()
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from tierfs.devtools.seaweed import free_ports

LOOPBACK = "127.0.0.1"
NAME = "tierfs"
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL; etcd stops in well under one


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError("etcd not found; install the Debian package etcd-server "
                           "(`make install` does)")
    return found


class Etcd:
    """A real single-member etcd server on loopback for tests and the demo."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir / "etcd.log"
        self.ports: dict[str, int] = {}  # "client" and "peer"; fixed once chosen
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    @property
    def pid(self) -> int | None:
        """The etcd server's pid while it runs, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def endpoint(self) -> str:
        """HOST:PORT of the client URL."""
        if not self.ports:
            raise RuntimeError("Etcd has not been started yet")
        return f"{LOOPBACK}:{self.ports['client']}"

    def cluster_url(self, prefix: str) -> str:
        """The `--cluster` value for a cluster named by prefix on this server."""
        return f"etcd://{self.endpoint}/{prefix.strip('/')}"

    def command(self) -> list[str]:
        client = f"http://{LOOPBACK}:{self.ports['client']}"
        peer = f"http://{LOOPBACK}:{self.ports['peer']}"
        return [
            etcd_binary(), "--name", NAME, "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{NAME}={peer}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-outputs", "stderr",
        ]

    def start(self, timeout: float = 30) -> None:
        """Start etcd and return once it reports healthy (it has a leader).

        The first start picks free ports (retrying if one is taken meanwhile); later starts
        reuse them, so the endpoint never changes.
        """
        if self._proc is not None:
            raise RuntimeError(f"Etcd already running (pid {self._proc.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fresh_ports = not self.ports
        for attempt in range(3 if fresh_ports else 1):
            if fresh_ports:
                self.ports["client"], self.ports["peer"] = free_ports(2)
            try:
                self._launch(timeout)
                return
            except RuntimeError as error:
                if not (fresh_ports and "address already in use" in str(error)) or attempt == 2:
                    raise

    def stop(self) -> None:
        """SIGTERM etcd by pid, SIGKILL it after STOP_GRACE s, wait for exit. Idempotent."""
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

    def restart(self) -> None:
        """Stop, then start again on the same ports and data dir (data and leases survive)."""
        self.stop()
        self.start()

    def __enter__(self) -> Etcd:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _launch(self, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(self.command(), cwd=self.data_dir,
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(self._proc, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        url = f"http://{self.endpoint}/health"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no env proxy
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {proc.returncode}{self._log_tail()}")
            try:
                with opener.open(url, timeout=1) as reply:
                    if json.loads(reply.read()).get("health") == "true":
                        return
                last_error = RuntimeError("etcd reports unhealthy (no leader yet)")
            except (OSError, ValueError) as error:  # not listening yet
                last_error = error
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd at {self.endpoint} not healthy within {timeout} s "
                                   f"({last_error}){self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        tail = text.splitlines()[-lines:]
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)
