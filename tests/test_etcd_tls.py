"""A cluster on an etcd that requires TLS, client certificates and a user's password, as
production etcds do: a real etcd started so with a CA made here
(`tierfs.devtools.certificates`), a mount that works, and the mistakes a person makes refused
at mount with one line each (a wrong CA, a wrong password)."""

from __future__ import annotations

import datetime
import os
import ssl
import subprocess
from base64 import b64encode
from pathlib import Path

import httpx
import pytest

from tests.conftest import MountFactory, free_port, tierfs
from tierfs.devtools import certificates
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.local_server import LOOPBACK

pytestmark = pytest.mark.cluster

PASSWORD = "s3cret-password"


class SecureEtcd(Etcd):
    """etcd serving its clients only over TLS, to clients with a certificate of its CA."""

    def __init__(self, data_dir: Path, certs: Path) -> None:
        super().__init__(data_dir)
        self.certs = certs

    def command(self) -> list[str]:
        plain = f"http://{LOOPBACK}:{self.ports['client']}"
        return [f"https://{LOOPBACK}:{self.ports['client']}" if arg == plain else arg
                for arg in super().command()] + [
            "--cert-file", str(self.certs / "server.crt"),
            "--key-file", str(self.certs / "server.key"),
            "--trusted-ca-file", str(self.certs / "ca.crt"), "--client-cert-auth"]

    def client(self) -> httpx.Client:
        context = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        context.load_cert_chain(str(self.certs / "node.crt"), str(self.certs / "node.key"))
        return httpx.Client(base_url=f"https://{self.endpoint}/v3/", verify=context,
                            trust_env=False, timeout=5)

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        def answers() -> object:
            try:
                with self.client() as client:
                    client.post("maintenance/status", json={}).raise_for_status()
            except httpx.HTTPError as exc:
                return str(exc)
            return None

        self.poll_until(proc, timeout, f"etcd at {self.endpoint}", answers)

    def enable_auth(self) -> None:
        """A root user with PASSWORD, and auth on: every request needs a user's token."""
        with self.client() as client:
            for path, body in [("auth/user/add", {"name": "root", "password": PASSWORD}),
                               ("auth/user/grant", {"user": "root", "role": "root"}),
                               ("auth/enable", {})]:
                client.post(path, json=body).raise_for_status()


@pytest.fixture
def secure_etcd(tmp_path: Path) -> SecureEtcd:
    certs = tmp_path / "certs"
    certs.mkdir()
    certificates.make_ca(certs, "ca")
    certificates.make_ca(certs, "other-ca")
    certificates.make_cert(certs, "ca", "server", ip=LOOPBACK)
    certificates.make_cert(certs, "ca", "node", client_only=True)
    (tmp_path / "etcd").mkdir()
    server = SecureEtcd(tmp_path / "etcd", certs)
    server.start()
    server.enable_auth()
    yield server
    server.stop()


def test_a_cluster_on_an_etcd_with_tls_client_certificates_and_a_password(
        mounts: MountFactory, tmp_path: Path, secure_etcd: SecureEtcd) -> None:
    certs = secure_etcd.certs
    token = tmp_path / "cluster.token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(0o600)
    password = tmp_path / "etcd.password"
    password.write_text(PASSWORD + "\n")
    password.chmod(0o600)
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not the password\n")
    wrong.chmod(0o600)

    def args(ca: str = "ca", password_file: Path = password) -> list[str]:
        return ["--cluster", f"etcds://{secure_etcd.endpoint}/tls", "--node-id", "node0",
                "--listen", f"127.0.0.1:{free_port()}", "--token-file", str(token),
                "--etcd-cacert", str(certs / f"{ca}.crt"), "--etcd-cert",
                str(certs / "node.crt"), "--etcd-key", str(certs / "node.key"),
                "--etcd-user", "root", "--etcd-password-file", str(password_file)]

    mountpoint = tmp_path / "refused"
    mountpoint.mkdir()
    for options, message in [(args(ca="other-ca"), "TLS: certificate verify failed"),
                             (args(password_file=wrong), "authentication failed")]:
        done = tierfs("mount", str(mountpoint), "--ram-dir", str(mounts.new_ram_dir()),
                      *options, check=False)
        if done.returncode == 0:  # mounted after all: unmounted, its daemon ends with it
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        assert done.returncode == 1 and message in done.stderr, done.stderr
        errors = [line for line in done.stderr.splitlines() if "warning:" not in line]
        assert len(errors) == 1, done.stderr

    mnt = mounts.mount(*args())
    assert mnt.status()["node_id"] == "node0"
    (mnt / "run/step_1").mkdir(parents=True)
    (mnt / "run/step_1/.metadata").write_bytes(b"meta")
    tierfs("flush", str(mnt.mountpoint), "--timeout", "30")
    assert mnt.step("run/step_1")["state"] == "committed"
    with secure_etcd.client() as client:  # the commit record is in etcd, under the user
        auth = client.post("auth/authenticate", json={"name": "root", "password": PASSWORD})
        listed = client.post("kv/range", headers={"Authorization": auth.json()["token"]},
                             json={"key": b64encode(b"/tls/").decode(),
                                   "range_end": b64encode(b"/tls0").decode()})
        assert int(listed.json().get("count", 0)) > 0


def test_an_expired_client_certificate_for_etcd_is_refused_at_mount_with_one_line(
        mounts: MountFactory, tmp_path: Path, secure_etcd: SecureEtcd) -> None:
    """A client certificate of etcd's CA that expired yesterday (made with `cryptography`)."""
    certs = secure_etcd.certs
    now = datetime.datetime.now(datetime.UTC)
    certificates.make_cert(certs, "ca", "expired", client_only=True,
                           valid_from=now - 3 * certificates.DAY,
                           valid_until=now - certificates.DAY)
    token = tmp_path / "cluster.token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(0o600)
    mountpoint = tmp_path / "refused"
    mountpoint.mkdir()
    done = tierfs("mount", str(mountpoint), "--ram-dir", str(mounts.new_ram_dir()),
                  "--cluster", f"etcds://{secure_etcd.endpoint}/tls", "--node-id", "node0",
                  "--listen", f"127.0.0.1:{free_port()}", "--token-file", str(token),
                  "--etcd-cacert", str(certs / "ca.crt"), "--etcd-cert",
                  str(certs / "expired.crt"), "--etcd-key", str(certs / "expired.key"),
                  check=False, timeout=60)
    if done.returncode == 0:  # mounted after all: unmounted, its daemon ends with it
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    assert done.returncode == 1 and "expired" in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "warning:" not in line]
    assert len(errors) == 1, done.stderr
