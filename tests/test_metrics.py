"""`--metrics HOST:PORT`: a real mount with a persistent tier serves Prometheus text that a
scrape parses, and its counters follow what the mount did."""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MountFactory, free_port, tierfs, wait_until
from tests.test_cluster import Cluster
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd
from tierfs.mount_helper.config import ConfigError, resolve
from tierfs.mount_helper.fuse_helper import to_mount_argv

pytestmark = pytest.mark.cluster

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample of the endpoint, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_follow_commits_uploads_and_ram(mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    port = free_port()
    mnt = mounts.mount("--persist", f"file://{store}", "--ram-limit", "256M",
                       "--metrics", f"127.0.0.1:{port}")
    before = scrape(port)
    assert before[("tierfs_commits_total", ())] == 0
    assert before[("tierfs_ram_limit_bytes", ())] == 256 << 20
    assert before[("tierfs_step_bytes_count", (("tier", "persist"),))] == 0

    files = {"__0_0.distcp": os.urandom(5 << 20), "__1_0.distcp": os.urandom(1 << 20),
             ".metadata": b"meta"}
    written = sum(len(data) for data in files.values())
    save(mnt / "run/step_10", files)
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")

    after = scrape(port)
    assert after[("tierfs_commits_total", ())] >= 1
    assert after[("tierfs_commit_seconds_count", ())] == after[("tierfs_commits_total", ())]
    assert after[("tierfs_step_bytes_sum", (("tier", "ram"),))] >= written
    assert after[("tierfs_step_bytes_sum", (("tier", "persist"),))] == written
    assert after[("tierfs_step_bytes_count", (("tier", "persist"),))] == 1
    assert after[("tierfs_step_seconds_count", (("tier", "persist"),))] == 1
    assert after[("tierfs_step_seconds_sum", (("tier", "persist"),))] > 0
    assert after[("tierfs_ram_used_bytes", ())] >= written
    assert after[("tierfs_pending_steps", (("tier", "persist"),))] == 0
    assert after[("tierfs_pending_bytes", (("tier", "persist"),))] == 0
    assert after[("tierfs_peers_up", ())] == 0
    assert after[("tierfs_refused_writes_total", ())] == 0
    assert after[("tierfs_verify_failures_total", (("tier", "persist"),))] == 0

    # a bad copy in the persistent tier is counted when `tierfs verify` finds it
    (store / "run/step_10/__1_0.distcp").write_bytes(os.urandom(1 << 20))
    tierfs("verify", str(mnt / "run/step_10"))  # repaired: exit 0
    assert scrape(port)[("tierfs_verify_failures_total", (("tier", "persist"),))] == 1


def test_metrics_of_a_cluster_node(mounts: MountFactory, tmp_path: Path,
                                   etcd_server: Etcd) -> None:
    token_file = tmp_path / "cluster.token"
    token_file.write_bytes(os.urandom(32).hex().encode())
    token_file.chmod(0o600)
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    port = free_port()
    node0 = mounts.mount(*cluster.args("node0"), "--metrics", f"127.0.0.1:{port}")
    assert scrape(port)[("tierfs_peers", ())] == 0  # the peers seen since start: none yet
    node1 = mounts.mount(*cluster.args("node1"), "--replicas", "0")  # its steps: one copy
    wait_until(lambda: scrape(port)[("tierfs_peers_up", ())] == 1, timeout=15)
    assert scrape(port)[("tierfs_peers", ())] == 1
    files = {"__0_0.distcp": os.urandom(2 << 20), ".metadata": b"meta"}
    save(node0 / "run/step_1", files)
    wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
    samples = scrape(port)
    assert samples[("tierfs_step_bytes_sum", (("tier", "replica"),))] == \
        sum(len(data) for data in files.values())
    assert samples[("tierfs_pending_steps", (("tier", "replica"),))] == 0
    save(node1 / "other/step_1", files)  # held by node1 alone
    wait_until(lambda: (node0.step("other/step_1") or {}).get("state") == "committed")
    assert samples[("tierfs_incomplete_steps", ())] == 0
    node1.kill9()
    wait_until(lambda: scrape(port)[("tierfs_peers_up", ())] == 0, timeout=15)
    # once node1's lease is known dead, the step it alone held is incomplete
    wait_until(lambda: scrape(port)[("tierfs_incomplete_steps", ())] == 1, timeout=15)
    assert scrape(port)[("tierfs_peers", ())] == 1  # down, still listed
    save(node0 / "run/step_2", files)  # no peer to copy it to: it waits
    # and so does run/step_1 again: its one copy is on node1, which is down
    wait_until(lambda: scrape(port)[("tierfs_pending_steps", (("tier", "replica"),))] == 2)


def test_refused_writes_are_counted(mounts: MountFactory) -> None:
    port = free_port()
    mnt = mounts.mount("--ram-limit", "16M", "--no-passthrough",
                       "--metrics", f"127.0.0.1:{port}")
    with pytest.raises(OSError), open(mnt / "big", "wb") as f:
        for _ in range(32):
            f.write(os.urandom(1 << 20))
            f.flush()
    assert scrape(port)[("tierfs_refused_writes_total", ())] >= 1


def test_metrics_port_in_use_is_one_clear_line(mounts: MountFactory) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AssertionError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            mounts.mount("--metrics", f"127.0.0.1:{port}")


def test_metrics_option_forms() -> None:
    assert resolve("/tmp", {"metrics": "127.0.0.1:9100"}, {}, None).metrics == \
        ("127.0.0.1", 9100)
    assert resolve("/tmp", {"metrics": ":9100"}, {}, None).metrics == ("0.0.0.0", 9100)
    assert resolve("/tmp", {}, {"TIERFS_METRICS": "[::1]:9200"}, None).metrics == ("::1", 9200)
    assert resolve("/tmp", {}, {}, None).metrics is None
    with pytest.raises(ConfigError, match="--metrics 'node0' is not HOST:PORT"):
        resolve("/tmp", {"metrics": "node0"}, {}, None)
    assert to_mount_argv(["none", "/ckpt", "-o", "ram_dir=/dev/shm/c,metrics=127.0.0.1:9100"]) \
        == ["mount", "/ckpt", "--ram-dir", "/dev/shm/c", "--metrics", "127.0.0.1:9100"]
