"""A member that etcd lists as up but whose peer handshake fails: given another token than the
others (the cluster's token check was reset under a live node), or advertised at an address
that only it can reach. Real daemons on a real etcd: every node's status says so
(`up, refused (token)`, `up, unreachable`), and no step only such a node holds becomes
`latest` on the others, whose reads of it could only fail."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.conftest import Mount, MountFactory, free_port, tierfs, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd
from tierfs.replication.coordination.etcd import Etcd as EtcdClient
from tierfs.replication.coordination.etcd import parse_cluster_url

pytestmark = pytest.mark.cluster


def peer(node: Mount, node_id: str) -> dict[str, object]:
    return next((p for p in node.status()["peers"] if p["node_id"] == node_id), {})


def latest(node: Mount) -> str:
    return os.readlink(node / "run/latest")


def first_step(cluster: Cluster) -> Mount:
    """node0, alone, with a committed run/step_1 (its `latest`)."""
    node0 = cluster.start("node0")
    save(node0 / "run/step_1", {"shard": os.urandom(1 << 20), ".metadata": b"m1"})
    wait_until(lambda: (node0.step("run/step_1") or {}).get("state") == "committed")
    return node0


def second_step_seen_by(node0: Mount, writer: Mount) -> None:
    """`writer` commits run/step_2 (only it holds it); node0 lists it from etcd."""
    files = {"shard": os.urandom(1 << 20), ".metadata": b"m2"}
    save(writer / "run/step_2", files)
    wait_until(lambda: (writer.step("run/step_2") or {}).get("state") == "committed")
    wait_until(lambda: node0.step("run/step_2") is not None, timeout=15)


def test_a_member_with_another_token_is_up_refused_and_its_steps_are_not_latest(
        mounts: MountFactory, tmp_path: Path, token_file: Path,  # noqa: F811
        etcd_server: Etcd) -> None:
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0 = first_step(cluster)
    # the token check reset under a live node (as if the cluster's token were being
    # changed): a node given another token then mounts, and registers as a member
    url = parse_cluster_url(cluster.url)
    assert trio.run(EtcdClient(url.endpoints).delete, url.key("token-check"))
    other = tmp_path / "other.token"
    other.write_bytes(os.urandom(32).hex().encode())
    other.chmod(0o600)
    args = cluster.args("node1")
    args[args.index("--token-file") + 1] = str(other)
    node1 = mounts.mount(*args)
    for node, other_id in ((node0, "node1"), (node1, "node0")):  # both see it, both ways
        wait_until(lambda n=node, o=other_id: peer(n, o).get("state") == "up, refused (token)",
                   timeout=15)
        assert peer(node, other_id)["up"] is True
        assert "does not know the cluster token" in str(peer(node, other_id)["link_error"])
    shown = tierfs("status", str(node0.mountpoint)).stdout  # the human form says it too
    assert f"node1 (127.0.0.1:{cluster.ports['node1']}) up, refused (token)" in shown
    assert f"warning: node node1 at 127.0.0.1:{cluster.ports['node1']} is up, refused " \
           "(token)" in shown
    second_step_seen_by(node0, node1)
    assert latest(node0) == "step_1"  # step_2 cannot be read here
    assert node0.step("run/step_2")["state"] == "incomplete"
    assert latest(node1) == "step_2"  # where it is whole


@contextlib.contextmanager
def forward_once(target_port: int) -> Iterator[int]:
    """A port on 127.0.0.1 that forwards its first connection to `target_port`, then stops
    listening: the address a node reaches itself at (its check at mount) and no other can."""
    listener = socket.create_server(("127.0.0.1", 0))
    sockets = [listener]

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def serve() -> None:
        with contextlib.suppress(OSError):
            client, _ = listener.accept()
            listener.close()
            upstream = socket.create_connection(("127.0.0.1", target_port))
            sockets.extend([client, upstream])
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
            pipe(client, upstream)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        for sock in sockets:
            sock.close()
        thread.join(timeout=5)


def test_a_member_nobody_else_reaches_is_up_unreachable_and_its_steps_are_not_latest(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0 = first_step(cluster)
    listen = free_port()
    with forward_once(listen) as advertised:
        args = cluster.args("node1")
        args[args.index("--listen") + 1] = f"127.0.0.1:{listen}"
        # no copy of its steps goes to node0 (which would make them readable there)
        node1 = mounts.mount(*args, "--advertise", f"127.0.0.1:{advertised}", "--replicas", "0")
        wait_until(lambda: peer(node0, "node1").get("state") == "up, unreachable", timeout=15)
        assert "refused" in str(peer(node0, "node1")["link_error"])  # connection refused
        assert peer(node1, "node0")["state"] == "up"  # node1 reaches node0
        second_step_seen_by(node0, node1)
        assert latest(node0) == "step_1"
        assert node0.step("run/step_2")["state"] == "incomplete"
