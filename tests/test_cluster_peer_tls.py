"""Peer data in mutual TLS (`--peer-tls`), real daemons on a real etcd, certificates made here
(`tierfs.devtools.certificates`, as for etcd's TLS): two nodes with certificates of the
cluster's CA replicate a step; a node with a certificate of another CA, or of a CA the others
do not use, or without TLS at all, is refused at mount with one line."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import MountFactory, tierfs, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_crash import save, verify_committed
from tierfs.devtools import certificates
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster


def refused_at_mount(mounts: MountFactory, mountpoint: Path, options: list[str],
                     message: str) -> None:
    """A mount with these options fails with one line (warnings aside) saying `message`."""
    done = tierfs("mount", str(mountpoint), "--ram-dir", str(mounts.new_ram_dir()), *options,
                  check=False)
    if done.returncode == 0:  # mounted after all: unmounted, its daemon ends with it
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "warning:" not in line]
    assert len(errors) == 1, done.stderr


def test_two_nodes_replicate_over_peer_tls_and_a_node_without_the_right_cert_is_refused(
        mounts: MountFactory, tmp_path: Path, token_file: Path,  # noqa: F811
        etcd_server: Etcd) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    for ca in ("ca", "rogue"):
        certificates.make_ca(certs, ca)
    for name, ca in (("node0", "ca"), ("node1", "ca"), ("stranger", "rogue")):
        certificates.make_cert(certs, ca, name, ip="127.0.0.1")

    def tls(cert: str, ca: str = "ca") -> list[str]:
        return ["--peer-tls", "--peer-cacert", str(certs / f"{ca}.crt"),
                "--peer-cert", str(certs / f"{cert}.crt"), "--peer-key", str(certs / f"{cert}.key")]

    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0 = mounts.mount(*cluster.args("node0"), *tls("node0"))
    node1 = mounts.mount(*cluster.args("node1"), *tls("node1"))
    wait_until(lambda: [p["state"] for p in node0.status()["peers"]] == ["up"], timeout=15)
    files = {"__0_0.distcp": os.urandom(8 << 20), ".metadata": b"meta"}
    save(node0 / "run/step_1", files)
    wait_until(lambda: (node0.step("run/step_1") or {}).get("replicas") == ["node1"],
               timeout=30)
    verify_committed(node1, {"run/step_1": files})

    mountpoint = tmp_path / "refused"
    mountpoint.mkdir()
    for options, message in [
        # a certificate the cluster's CA did not sign: its own port refuses it first
        (tls("stranger"), "this node's own peer port refuses it over TLS"),
        # another CA altogether: the members' certificates are refused, and they refuse its
        (tls("stranger", ca="rogue"), "the peer TLS handshake with node node"),
        ([], "the cluster's peers use TLS (--peer-tls)"),
    ]:
        refused_at_mount(mounts, mountpoint, [*cluster.args("node2"), *options], message)
    assert [p["node_id"] for p in node0.status()["peers"]] == ["node1"]
    assert "TLS handshake failed" in node0.log()  # the stranger's attempt, in one line


def test_peer_tls_options_go_together_and_an_expired_certificate_is_refused(
        mounts: MountFactory, tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    key.write_text("k")
    key.chmod(0o644)
    cluster = ["--cluster", "etcd://127.0.0.1:1/x", "--listen", "127.0.0.1:1", "--insecure"]
    now = datetime.datetime.now(datetime.UTC)
    certificates.make_ca(tmp_path, "ca")
    certificates.make_cert(tmp_path, "ca", "old", ip="127.0.0.1",
                           valid_from=now - 3 * certificates.DAY,
                           valid_until=now - certificates.DAY)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    expired = ["--peer-tls", "--peer-cacert", str(tmp_path / "ca.crt"),
               "--peer-cert", str(tmp_path / "old.crt"), "--peer-key", str(tmp_path / "old.key")]
    for options, message in [
        (["--peer-tls"], "--peer-tls needs --cluster"),
        (["--peer-tls", *cluster], "--peer-tls needs --peer-cacert FILE"),
        (["--peer-cert", str(key), *cluster], "--peer-cert needs --peer-tls"),
        (["--peer-tls", "--peer-cacert", str(key), "--peer-cert", str(key), "--peer-key",
          str(key), *cluster], "--peer-key " + str(key) + " is readable by others"),
        ([*expired, *cluster], f"--peer-cert {tmp_path / 'old.crt'} expired on "),
    ]:
        refused_at_mount(mounts, mountpoint, options, message)
