"""A real single-member etcd on loopback, for tests and the demo.

`Etcd` runs the `etcd` binary (Debian package `etcd-server`) with its client and peer URLs on
free 127.0.0.1 ports and its own data dir, so it never meets a system etcd (which listens on
2379/2380). Its log goes to ``data_dir/etcd.log``, never to the test output. The process is
stopped by its own pid only; `restart()` keeps the ports and the data (an etcd outage in a
test).

    with Etcd(tmp_path) as etcd:
        url = etcd.cluster_url("my-cluster")  # etcd://127.0.0.1:PORT/my-cluster
        etcd.restart()
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

from tierfs.devtools.local_server import LOOPBACK, LocalServer

NAME = "tierfs"


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError("etcd not found; install the Debian package etcd-server "
                           "(`make install` does)")
    return found


class Etcd(LocalServer):
    """A real single-member etcd server on loopback for tests and the demo."""

    PORT_NAMES = ("client", "peer")
    LOG_NAME = "etcd.log"
    START_TIMEOUT = 30.0

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

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        url = f"http://{self.endpoint}/health"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no env proxy

        def answers() -> object:
            with opener.open(url, timeout=1) as reply:
                if json.loads(reply.read()).get("health") == "true":
                    return None
            return "etcd reports unhealthy (no leader yet)"

        self.poll_until(proc, timeout, f"etcd at {self.endpoint}", answers)
