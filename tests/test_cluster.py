"""Several daemons on 127.0.0.1 as one cluster on a real etcd: membership under leases, and a
peer port that lets nothing in without the token and survives hostile input."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import (
    Mount,
    MountFactory,
    fill,
    finish_dcp_ranks,
    free_port,
    pid_alive,
    resume_rank,
    run_dcp_ranks,
    start_dcp_ranks,
    tierfs,
    wait_until,
    wait_written,
)
from tests.harness import Cluster, check_step_bytes, copies_everywhere, file_records
from tierfs.devtools.etcd import Etcd
from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import PeerChannel, authenticate

pytestmark = pytest.mark.cluster


def test_membership_heartbeats_and_a_node_coming_back(cluster3: Cluster) -> None:
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    status = cluster3.nodes["node0"].status()
    assert {p["node_id"] for p in status["peers"]} == {"node1", "node2"}
    assert status["node_id"] == "node0"
    cluster3.nodes["node2"].kill9()
    wait_until(lambda: cluster3.peers_up("node0") == {"node1": True, "node2": False},
               timeout=15)
    assert "member node2 down" in cluster3.nodes["node0"].log()
    cluster3.start("node2")
    wait_until(lambda: cluster3.peers_up("node0")["node2"], timeout=15)


async def hostile_client(port: int, token: bytes, node_id: str) -> str:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    channel = PeerChannel(stream, timeout=5)
    try:
        await authenticate(channel, token, node_id, {"node0", "node1", "node2", node_id})
        await channel.request("PING", node_id=node_id, expect="PONG")
        return "got in"
    except proto.ProtocolError as exc:
        return f"refused: {exc}"
    finally:
        await channel.aclose()


async def raw_bytes(port: int, data: bytes) -> bytes:
    """Send junk; return what came back before the daemon closed the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = b""
    async with stream:
        with trio.move_on_after(5):
            try:
                await stream.send_all(data)
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except trio.BrokenResourceError:
                pass  # reset: closed with our junk unread
            return received
    return b"(still open)"


def test_wrong_token_and_garbage_never_get_in(cluster3: Cluster) -> None:
    port = cluster3.ports["node0"]
    real_token = cluster3.token_file.read_bytes().strip()
    assert trio.run(hostile_client, port, real_token, "node1") == "got in"
    assert trio.run(hostile_client, port, b"not the token at all", "node1").startswith("refused")
    assert trio.run(hostile_client, port, real_token, "stranger").startswith("refused")
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(4096),
                 struct.pack(">II", 1 << 30, 1 << 30), b"\x00" * 8 + b"\xc1" * 100):
        assert not trio.run(raw_bytes, port, junk).endswith(b"(still open)")
    log = cluster3.nodes["node0"].log()
    assert log.count("peer connection from") >= 5 and "dropped" in log
    status = cluster3.nodes["node0"].status()  # still serving
    wait_until(lambda: all(cluster3.peers_up("node0").values()), timeout=15)
    assert status["pid"] == cluster3.nodes["node0"].pid


async def inject_after_handshake(port: int, token: bytes, node_id: str) -> str:
    """A genuine PING, then a frame with no valid MAC written into the same connection (as an
    attacker who took over the TCP connection would); what the daemon answered."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    channel = PeerChannel(stream, timeout=5)
    async with stream:
        await authenticate(channel, token, node_id, {"node0", "node1", node_id})
        await channel.request("PING", node_id=node_id, expect="PONG")
        await stream.send_all(b"".join(proto.encode("PING", node_id=node_id))
                              + b"\0" * proto.TAG_BYTES)
        with trio.move_on_after(5):
            try:
                return "answered" if await stream.receive_some(65536) else "closed"
            except trio.BrokenResourceError:
                return "closed"
    return "still open"


def test_a_frame_injected_into_an_established_connection_is_refused(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    cluster.start_all()
    port, token = cluster.ports["node0"], token_file.read_bytes().strip()
    assert trio.run(inject_after_handshake, port, token, "node1") == "closed"
    wait_until(lambda: "failed its MAC" in cluster.nodes["node0"].log())
    assert trio.run(hostile_client, port, token, "node1") == "got in"  # still serving


def test_cluster_mistakes_are_one_line(mounts: MountFactory, tmp_path: Path,
                                       token_file: Path, etcd_server: Etcd) -> None:
    mountpoint = tmp_path / "mp"
    mountpoint.mkdir()
    ram = str(mounts.new_ram_dir())
    url = etcd_server.cluster_url("test/mistakes")
    listen = ["--listen", f"127.0.0.1:{free_port()}"]
    loose = tmp_path / "loose.token"
    loose.write_bytes(b"x" * 32)
    loose.chmod(0o644)
    taken = Cluster(mounts, token_file, 1, etcd_server)
    taken.start("node0")
    dead_port = free_port()
    for args, message in [
        (["--peers", "a=127.0.0.1:1,b=127.0.0.1:2"], "--peers is gone: name the cluster's etcd"),
        (["--cluster", url, *listen], "needs --token-file"),
        (["--cluster", url, "--insecure"], "needs --listen"),
        (["--cluster", "http://127.0.0.1:1/x", *listen, "--insecure"], "must start with etcd://"),
        (["--cluster", f"etcd://{etcd_server.endpoint}", *listen, "--insecure"], "no key prefix"),
        (["--cluster", url, *listen, "--token-file", str(loose)], "readable by others"),
        (["--cluster", url, "--listen", "nohostport", "--insecure"], "is not HOST:PORT"),
        (["--cluster", url, "--listen", "0.0.0.0:7070", "--insecure"], "--advertise"),
        (["--listen", "127.0.0.1:7070"], "--listen needs --cluster"),
        (["--replicas", "1"], "--replicas 1 needs --cluster"),
        (["--cluster", f"etcd://127.0.0.1:{dead_port}/x", *listen, "--insecure"],
         f"etcd is unreachable at 127.0.0.1:{dead_port}: connection refused"),
        (["--cluster", taken.url, "--node-id", "node0", *listen, "--token-file",
          str(token_file)], "is registered by a live daemon"),
    ]:
        done = tierfs("mount", str(mountpoint), "--ram-dir", ram, *args, check=False)
        assert done.returncode == 1 and message in done.stderr, done.stderr
        errors = [line for line in done.stderr.splitlines() if "warning:" not in line]
        assert len(errors) == 1, done.stderr


def test_a_wrong_token_or_advertised_address_is_refused_at_mount(
        mounts: MountFactory, tmp_path: Path, token_file: Path, etcd_server: Etcd) -> None:
    """A node given another token than the cluster's, or an --advertise where nothing (or
    another node) listens, would join and fail every exchange: refused with one line."""
    cluster = Cluster(mounts, token_file, 1, etcd_server)
    cluster.start("node0")
    other = tmp_path / "other.token"
    other.write_bytes(os.urandom(32).hex().encode())
    other.chmod(0o600)
    mountpoint = tmp_path / "mp"
    mountpoint.mkdir()
    for args, message in [
        (["--token-file", str(other)], "this node's token is not the cluster's"),
        (["--token-file", str(token_file), "--advertise", f"127.0.0.1:{free_port()}"],
         "cannot reach itself at its advertised address 127.0.0.1:"),
        (["--token-file", str(token_file), "--advertise",
          f"127.0.0.1:{cluster.ports['node0']}"],
         "is the peer port of node 'node0', not this node's ('node1')"),
    ]:
        # a port found free just before each mount: one kept across the three (seconds) was
        # taken meanwhile by another test's connection once ("Address already in use")
        listen = ["--listen", f"127.0.0.1:{free_port()}"]
        done = tierfs("mount", str(mountpoint), "--ram-dir", str(mounts.new_ram_dir()),
                      "--cluster", cluster.url, "--node-id", "node1", *args, *listen,
                      check=False)
        if done.returncode == 0:  # mounted after all: unmounted, its daemon ends with it
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        assert done.returncode == 1 and message in done.stderr, done.stderr
        assert "is not a member" not in done.stderr  # node0 is one: what is wrong is said
        errors = [line for line in done.stderr.splitlines() if "warning:" not in line]
        assert len(errors) == 1, done.stderr
    assert [p["node_id"] for p in cluster.nodes["node0"].status()["peers"]] == []


def test_committed_step_is_replicated_to_the_next_node(cluster3: Cluster) -> None:
    from tests.test_crash import save, verify_committed

    node0, node1 = cluster3.nodes["node0"], cluster3.nodes["node1"]
    wait_until(lambda: all(cluster3.peers_up("node0").values()), timeout=15)
    files = {"__0_0.distcp": os.urandom(20 << 20), "empty": b"", ".metadata": b"meta"}
    save(node0 / "run/step_10", files)
    wait_until(lambda: node0.step("run/step_10")["replicas"] == ["node1"], timeout=30)
    from tests.conftest import getxattr

    assert getxattr(node0 / "run/step_10", "user.tierfs.tiers") == "ram,peer:node1"
    replica = node1.step("run/step_10")
    assert replica["state"] == "committed" and replica["ram"] and replica["replicas"] == ["node0"]
    verify_committed(node1, {"run/step_10": files})
    assert "Step run/step_10: replicated to node1 in " in node0.log()
    node0.kill9()  # the writer is gone: its step lives on in node1's RAM
    verify_committed(node1, {"run/step_10": files})
    node2 = cluster3.nodes["node2"]  # and node1 restores the second copy on node2
    wait_until(lambda: (node2.step("run/step_10") or {}).get("ram"), timeout=30)
    verify_committed(node2, {"run/step_10": files})
    again = cluster3.start("node0")  # back with its RAM dir: it knows who holds copies
    assert "node1" in again.step("run/step_10")["replicas"]
    wait_until(lambda: again.step("run/step_10")["replicas"] == ["node1", "node2"], timeout=15)
    assert node1.step("run/step_10")["version"] == 1


def test_nothing_of_a_step_reaches_a_peer_before_its_hashes(cluster3: Cluster) -> None:
    """A saver's commit returns before its files are hashed (fs.model.pending_commits); the copy
    to a peer, and the commit record the peers list steps from, wait for the hashes; and
    `tierfs flush` waits for that copy."""
    from tests.test_commit_hashes_later import hold_hashes
    from tests.test_crash import save, verify_committed

    node0, node1, node2 = (cluster3.nodes[f"node{i}"] for i in range(3))
    wait_until(lambda: all(cluster3.peers_up("node0").values()), timeout=15)
    files = {"__0_0.distcp": os.urandom(8 << 20), ".metadata": b"meta"}
    hold_hashes(node0, True)
    save(node0 / "run/step_11", files)
    assert node0.step("run/step_11")["hashing"]
    # `tierfs flush` waits for the copies too (not "nothing to flush" without a store), and
    # the daemon names the copy it holds back for the hashes
    waited = tierfs("flush", str(node0.mountpoint), "--timeout", "1", check=False)
    assert waited.returncode == 1, waited.stdout
    assert "run/step_11 (hashing to peers)" in waited.stderr, waited.stderr
    assert node0.step("run/step_11")["replicas"] == []
    assert node1.step("run/step_11") is None and node2.step("run/step_11") is None
    hold_hashes(node0, False)
    done = tierfs("flush", str(node0.mountpoint), "--timeout", "30")
    assert "every committed step is on 1 peer" in done.stdout, done.stdout
    assert node0.step("run/step_11")["replicas"] == ["node1"]
    verify_committed(node1, {"run/step_11": files})


def test_flush_does_not_wait_for_copies_on_a_peer_that_is_down(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """The last node of a job that is ending: its peers are gone, no copy can be made, and
    `tierfs flush` (a pod's preStop) returns instead of waiting out its timeout."""
    from tests.test_crash import save

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start("node0"), cluster.start("node1")
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    node1.kill9()
    wait_until(lambda: not any(cluster.peers_up("node0").values()), timeout=15)
    save(node0 / "run/step_1", {"__0_0.distcp": os.urandom(1 << 20), ".metadata": b"meta"})
    done = tierfs("flush", str(node0.mountpoint), "--timeout", "20")
    assert "every committed step is on no peer (none is up)" in done.stdout, done.stdout


def test_every_node_lists_every_step_and_a_replacement_reads_through_peers(
        cluster3: Cluster) -> None:
    import shutil

    from tests.test_crash import save, verify_committed

    node0 = cluster3.nodes["node0"]
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    files = {f"__{r}_0.distcp": os.urandom(12 << 20) for r in range(2)} | {".metadata": b"m"}
    save(node0 / "job/step_5", files)
    wait_until(lambda: node0.step("job/step_5")["replicas"] == ["node1"], timeout=30)
    node2 = cluster3.nodes["node2"]  # holds no copy: lists it from etcd, reads from peers
    # listed from etcd within a second of the commit; its holders as copies are verified
    wait_until(lambda: (node2.step("job/step_5") or {}).get("replicas") == ["node0", "node1"],
               timeout=5)
    listed = node2.step("job/step_5")
    assert listed["state"] == "committed" and not listed["ram"]
    assert listed["replicas"] == ["node0", "node1"] and listed["bytes"] == 2 * (12 << 20) + 1
    assert os.readlink(node2 / "job/latest") == "step_5"
    verify_committed(node2, {"job/step_5": files})

    # node0 dies and is replaced by a fresh node with the same id and an empty RAM dir
    node0.kill9()
    shutil.rmtree(node0.ram_dir)
    fresh = cluster3.start("node0")
    step = fresh.step("job/step_5")  # listed as soon as the mount returns
    assert step is not None and step["state"] == "committed"
    # read from node1 and node2 until node1 has restored the copy node0 lost (the records
    # stopped counting node0 as its holder at its start, tests/test_cluster_holders.py)
    verify_committed(fresh, {"job/step_5": files})
    done = tierfs("prefetch", str(fresh / "job/step_5"))
    assert "job/step_5 is in RAM" in done.stdout
    assert fresh.step("job/step_5")["ram"]


def test_without_a_store_both_copies_stay_in_ram_beyond_keep_ram(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """K = 1 on two nodes, no store, --keep-ram 1: node0's steps are copied to node1 and
    both copies of each stay in RAM (a copy leaves only while K + 1 = 2 other live nodes
    hold it): losing either node loses nothing."""
    from tests.test_crash import save, verify_committed

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--keep-ram", "1")
    saved = {n: {"shard": os.urandom(4 << 20), ".metadata": b"m%d" % n} for n in (1, 2, 3)}
    for number, files in saved.items():
        save(node0 / f"run/step_{number}", files)
    for number in saved:  # each step's copy verified: retention ran for the older ones
        wait_until(lambda n=number: node0.step(f"run/step_{n}")["replicas"] == ["node1"],
                   timeout=30)
    for node in (node0, node1):
        assert [s["ram"] for s in node.status()["steps"]] == [True, True, True]
    assert "evicted run/step_" not in node0.log()
    verify_committed(node0, {f"run/step_{n}": files for n, files in saved.items()})


def test_multi_node_dcp_save_commits_without_moving_shards_and_loads_at_once(
        cluster3: Cluster) -> None:
    """3 nodes x 1-2 ranks: every rank loads the step right after the save's barrier, on its
    own node; the commit moved no shard: node0 (rank 0, `.metadata`) holds only its own."""
    from tests.conftest import getxattr

    node0, node1, node2 = (cluster3.nodes[f"node{i}"] for i in range(3))
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    ranks = [node0, node1, node1, node2]  # rank 0 on node0, ranks 1-2 on node1, rank 3 on node2
    run_dcp_ranks([node / "run/step_100" for node in ranks], timeout=240, at_once=True)
    committed = node0.step("run/step_100")
    assert committed["state"] == "committed" and committed["version"] == 1
    shards = {f"__{r}_0.distcp" for r in range(4)}
    for node in (node0, node1, node2):
        wait_until(lambda n=node: (n.step("run/step_100") or {}).get("state") == "committed",
                   timeout=5)
        step_dir = node / "run/step_100"
        assert getxattr(step_dir, "user.tierfs.state") == "committed"
        assert set(os.listdir(step_dir)) >= shards | {".metadata"}
        assert node.step("run/step_100")["version"] == 1
    manifest = {e[0]: e[2] for e in _manifest_entries(node0, "run/step_100")}
    objects = set(os.listdir(node0.ram_dir / "objects"))
    assert manifest["__0_0.distcp"] in objects  # rank 0's own shard
    # node1's shards never entered node0's RAM (their one copy goes to node2, the next on
    # the ring; node2's shard is copied to node0 as its replica, after the commit)
    for rank in (1, 2):
        assert manifest[f"__{rank}_0.distcp"] not in objects
    assert "stay there" in node0.log()


def test_a_rank_whose_daemon_restarted_before_the_metadata_loads_the_step_on_its_node(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """Rank 1 wrote its shard on node1, whose daemon then died and came back on its RAM dir
    before rank 0 wrote `.metadata` on node0: the step commits on both nodes and both ranks
    load it (node1 kept it `writing` for good, its shard unsealed after the restart, so rank
    1's load waited for ever and node0's copies to node1 failed)."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all()
    ranks = start_dcp_ranks([node0 / "run/step_10", node1 / "run/step_10"], paused=1)
    wait_written(ranks[1])
    wait_until(lambda: {r.node for r in file_records(cluster, "run/step_10").values()}
               == {"node0", "node1"}, timeout=10)
    node1.kill9()
    node1 = cluster.start("node1")
    resume_rank(ranks[1])
    finish_dcp_ranks(ranks, timeout=60)
    for node in (node0, node1):
        assert node.step("run/step_10")["state"] == "committed"


def _manifest_entries(node: Mount, relpath: str) -> list[list[object]]:
    from tierfs import manifest as mf

    data = (node.ram_dir / "tree" / relpath / mf.MANIFEST_NAME).read_bytes()
    return [mf.entry_fields(e) for e in mf.decode(data).files]


def test_reads_of_one_file_by_another_node_are_spread_over_its_holders(
        cluster3: Cluster) -> None:
    from tests.test_crash import save

    node0, node1, node2 = (cluster3.nodes[f"node{i}"] for i in range(3))
    wait_until(lambda: all(cluster3.peers_up("node0").values()), timeout=15)
    data = bytes(range(256)) * (80 << 12)  # 80 MiB, fixed: the spread is deterministic
    save(node0 / "ddp/step_1", {"model.pt": data, ".metadata": b"m"})
    wait_until(lambda: node0.step("ddp/step_1")["replicas"] == ["node1"], timeout=30)
    wait_until(lambda: (node2.step("ddp/step_1") or {}).get("replicas") == ["node0", "node1"],
               timeout=5)
    assert (node2 / "ddp/step_1/model.pt").read_bytes() == data  # ten 8 MiB chunks
    served = [n.status()["served_to_peers"]["bytes"] for n in (node0, node1)]
    assert all(b > 0 for b in served) and sum(served) >= len(data), served


def test_multi_node_dcp_step_survives_the_loss_of_each_writer(cluster3: Cluster) -> None:
    """Two ranks on two nodes save one DCP step (K = 1): each node's shard gets a copy on
    another node; killing either writer loses nothing, and the survivors restore K copies."""
    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    writers = ["node1", "node2"]  # rank 0 (and .metadata) on node1, rank 1 on node2
    step = "run/step_7"
    run_dcp_ranks([cluster3.nodes[n] / step for n in writers], timeout=240)
    every = set(cluster3.ports)
    wait_until(lambda: copies_everywhere(cluster3, step, every, 2), timeout=30)
    records = file_records(cluster3, step)
    assert {r.node for r in records.values()} == set(writers)
    expected = {name: r.xxh3 for name, r in records.items()}
    # each file names its own holders: rank 0's shard is node1's (copy on node2), rank 1's
    # is node2's (copy on node0); node2 holds every file (its own and node1's copies)
    node1 = cluster3.nodes["node1"]
    from tests.conftest import getxattr

    wait_until(lambda: getxattr(node1 / f"{step}/__1_0.distcp", "user.tierfs.tiers")
               == "peer:node0,peer:node2", timeout=10)
    assert getxattr(node1 / f"{step}/__0_0.distcp", "user.tierfs.tiers") == "ram,peer:node2"
    assert node1.step(step)["replicas"] == ["node2"] and node1.step(step)["copies"] == 2
    for victim in writers:
        cluster3.nodes[victim].kill9()
        live = every - {victim}
        survivor = cluster3.nodes[sorted(live)[0]]
        check_step_bytes(survivor, step, expected)  # nothing lost
        wait_until(lambda lv=live: copies_everywhere(cluster3, step, lv, 2), timeout=30)
        assert survivor.step(step)["state"] == "committed"
        wait_until(lambda s=survivor: s.step(step)["copies"] == 2, timeout=10)
        back = cluster3.start(victim)  # with its RAM dir: it still holds its part of the step
        assert back.step(step)["state"] == "committed"
        assert all((back.ram_dir / "objects" / xxh3).exists() for name, xxh3 in expected.items()
                   if records[name].node == victim)
        wait_until(lambda: all(cluster3.peers_up("node0").values()), timeout=15)


def test_a_replacement_node_takes_the_copies_of_a_lost_writer(cluster3: Cluster) -> None:
    """A writer of a multi-node step is lost for good and a node with a new id joins: the
    survivors restore K + 1 copies of every file, the new node among them, and it reads the
    whole step."""
    import shutil

    for node_id in cluster3.ports:
        wait_until(lambda n=node_id: all(cluster3.peers_up(n).values()), timeout=15)
    step = "run/step_8"
    run_dcp_ranks([cluster3.nodes[n] / step for n in ("node1", "node2")], timeout=240)
    wait_until(lambda: copies_everywhere(cluster3, step, set(cluster3.ports), 2), timeout=30)
    expected = {name: r.xxh3 for name, r in file_records(cluster3, step).items()}
    lost = cluster3.nodes["node2"]
    lost.kill9()
    shutil.rmtree(lost.ram_dir)
    cluster3.ports["node3"] = free_port()
    fresh = cluster3.start("node3")
    live = {"node0", "node1", "node3"}
    wait_until(lambda: copies_everywhere(cluster3, step, live, 2), timeout=30)
    assert all("node3" in r.holders for r in file_records(cluster3, step).values())
    check_step_bytes(fresh, step, expected)
    wait_until(lambda: fresh.step(step)["ram"] and fresh.step(step)["copies"] == 2, timeout=10)


def test_the_writers_of_a_multi_node_step_keep_both_copies_beyond_keep_ram(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """A DCP step written on node0 (rank 0, `.metadata`: the committer) and node1 (K = 1,
    no store), then newer steps (--keep-ram 1): no writer drops its own shard (one copy
    would be left), nor the copy it holds for the other. node1 is then lost: every file,
    node0's and node1's, is read from node0."""
    from tests.conftest import getxattr
    from tests.test_crash import save

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--keep-ram", "1")
    step = "run/step_1"
    run_dcp_ranks([node0 / step, node1 / step], timeout=240)
    wait_until(lambda: copies_everywhere(cluster, step, set(cluster.ports), 2), timeout=30)
    expected = {name: r.xxh3 for name, r in file_records(cluster, step).items()}
    # step_1 is beyond --keep-ram on both nodes; each node's copies of its newer step are
    # verified, which is when retention runs
    save(node1 / "run/step_2", {"f": b"2", ".metadata": b"m"})
    save(node0 / "run/step_3", {"f": b"3", ".metadata": b"m"})
    wait_until(lambda: node1.step("run/step_2")["replicas"] == ["node0"], timeout=30)
    wait_until(lambda: node0.step("run/step_3")["replicas"] == ["node1"], timeout=30)

    def tiers(node: Mount, name: str) -> str:
        return getxattr(node / f"{step}/{name}", "user.tierfs.tiers")

    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert tiers(node0, name) == "ram,peer:node1"
        assert tiers(node1, name) == "ram,peer:node0"
    node1.kill9()
    check_step_bytes(node0, step, expected)


def test_a_dead_peers_copy_does_not_let_a_step_leave_ram(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """K = 2 on three nodes: a step held by node1 and node2 stays in node0's RAM once node2
    is down, even beyond --keep-ram (node1's copy is the only one left elsewhere)."""
    from tests.test_crash import save

    cluster = Cluster(mounts, token_file, 3, etcd_server)
    cluster.start_all("--keep-ram", "1", "--replicas", "2")
    node0 = cluster.nodes["node0"]
    save(node0 / "run/step_1", {"f": os.urandom(1 << 20), ".metadata": b"m"})
    wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1", "node2"], timeout=30)
    cluster.nodes["node2"].kill9()
    wait_until(lambda: cluster.peers_up("node0") == {"node1": True, "node2": False},
               timeout=15)
    # its copy on node1 makes node0 look at step_1 again
    save(node0 / "run/step_2", {"f": b"2", ".metadata": b"m"})
    wait_until(lambda: node0.step("run/step_2")["replicas"] == ["node1"], timeout=30)
    assert node0.step("run/step_1")["ram"]


def test_verify_asks_each_peer_only_about_the_files_it_holds(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """A DCP step written on node0 (rank 0, `.metadata`) and node1 (rank 1), no copies
    (K = 0): `tierfs verify` on node2, which holds none of it, and on node0 asks each peer
    about the files their records say it holds, never about all the step's files."""
    import json

    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0, node1, node2 = cluster.start_all("--replicas", "0")
    step = "run/step_5"
    run_dcp_ranks([node0 / step, node1 / step], timeout=240)
    records = file_records(cluster, step)
    # (each rank loads the whole step back: a node may also hold fetched copies of the
    # other's files, which are not in their records' holders and not asked about)
    held = {node: sorted(n for n, r in records.items() if node in r.holders)
            for node in ("node0", "node1")}
    assert held["node0"] and held["node1"]
    wait_until(lambda: (node2.step(step) or {}).get("state") == "committed", timeout=30)

    def peer_tiers(mnt: Mount) -> dict[str, dict[str, Any]]:
        done = tierfs("verify", str(mnt / step), "--json", timeout=120)
        [report] = json.loads(done.stdout)["steps"]
        return {t["tier"]: t for t in report["tiers"] if t["tier"].startswith("peer:")}

    tiers = peer_tiers(node2)
    assert set(tiers) == {"peer:node0", "peer:node1"}
    for node in ("node0", "node1"):
        assert tiers[f"peer:{node}"]["good"] == len(held[node]), tiers
        assert tiers[f"peer:{node}"]["not_held"] == [], tiers
    tiers = peer_tiers(node0)
    assert set(tiers) == {"peer:node1"}
    assert tiers["peer:node1"]["good"] == len(held["node1"])
    assert tiers["peer:node1"]["not_held"] == [], tiers


def test_an_upload_waits_for_the_peer_copies_of_its_step(mounts: MountFactory,
                                                         token_file: Path, etcd_server: Etcd,
                                                         tmp_path: Path) -> None:
    """The single-copy window closes first: a step goes to its peers, then to the store (an
    upload beside the copies took the network and CPU they needed); with no peer able to take
    a copy, not forever."""
    from tests.test_crash import save

    store = tmp_path / "store"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--persist", f"file://{store}")
    os.kill(node1.pid, signal.SIGSTOP)  # a hung peer: the copy cannot be made yet
    try:
        save(node0 / "run/step_10", {"__0_0.distcp": os.urandom(1 << 20), ".metadata": b"m"})
        waiting_until = time.monotonic() + 1.5
        while time.monotonic() < waiting_until:
            assert not node0.step("run/step_10")["persisted"]  # the copy goes first
        # node1's lease ends: no live peer is owed a copy, and the upload goes
        wait_until(lambda: node0.step("run/step_10")["persisted"], timeout=30)
    finally:
        os.kill(node1.pid, signal.SIGCONT)
    wait_until(lambda: node0.step("run/step_10")["replicas"] == ["node1"], timeout=30)


def test_a_store_away_in_a_cluster(mounts: MountFactory, token_file: Path, etcd_server: Etcd,
                                   tmp_path: Path) -> None:
    """A file:// store shared by the nodes (an NFS volume) goes away: a step a peer holds too
    is not "only in RAM", so its writer unmounts, naming it as not in the store yet; a fresh
    node given an empty directory where the store should be is refused, since the cluster
    persisted steps to it (its own RAM dir knows nothing)."""
    from tests.test_crash import save

    store, away = tmp_path / "store", tmp_path / "store.away"
    store.mkdir()
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, _node1 = cluster.start_all("--persist", f"file://{store}")
    save(node0 / "run/step_1", {"__0_0.distcp": b"one", ".metadata": b"m"})
    tierfs("flush", str(node0.mountpoint), "--timeout", "60")
    store.rename(away)
    save(node0 / "run/step_2", {"__0_0.distcp": b"two", ".metadata": b"m"})
    wait_until(lambda: node0.step("run/step_2")["replicas"] == ["node1"], timeout=30)
    done = tierfs("umount", str(node0.mountpoint))
    assert (f"tierfs: 1 committed step is not in file://{store} yet (peers hold copies): "
            "run/step_2 (") in done.stderr, done.stderr

    store.mkdir()  # the volume is not mounted on the fresh node
    cluster.ports["node2"] = free_port()
    mountpoint = tmp_path / "node2"
    mountpoint.mkdir()
    refused = tierfs("mount", str(mountpoint), "--ram-dir", str(mounts.new_ram_dir()),
                     *cluster.args("node2"), "--persist", f"file://{store}", check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert (f"tierfs: persistent tier file://{store} is empty, but the cluster {cluster.url} "
            f"persisted steps to file://{store} (node node0 first): is the store's volume "
            "mounted on this node?") in refused.stderr
    assert list(store.iterdir()) == []


def test_sync_replicas_returns_once_the_copies_are_made(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:
    """--sync-replicas, K = 1 on two nodes: node1 hangs for a second while node0 saves; the
    save returns only once node1 holds a verified copy of every file (the records say so the
    moment it returns: by default it returns at the commit, before). node1 hangs past
    --commit-timeout: the save fails with ETIMEDOUT, the step stays committed, and its copy
    is made once node1 is back."""
    import errno
    import threading

    from tests.test_crash import save

    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0, node1 = cluster.start_all("--sync-replicas", "--commit-timeout", "4")
    files = {"__0_0.distcp": os.urandom(4 << 20), ".metadata": b"m"}
    os.kill(node1.pid, signal.SIGSTOP)
    wake = threading.Timer(1.0, os.kill, (node1.pid, signal.SIGCONT))
    wake.start()
    try:
        started = time.monotonic()
        save(node0 / "run/step_1", files)
        took = time.monotonic() - started
    finally:
        wake.join()
        os.kill(node1.pid, signal.SIGCONT)
    records = file_records(cluster, "run/step_1")
    assert set(records) == set(files)
    assert all(r.holders == ("node0", "node1") for r in records.values()), records
    assert took >= 1.0 and "every file has its copies" in node0.log()

    os.kill(node1.pid, signal.SIGSTOP)  # past --commit-timeout (and its lease)
    try:
        with pytest.raises(OSError) as failed:
            save(node0 / "run/step_2", files)
        assert failed.value.errno == errno.ETIMEDOUT
        assert node0.step("run/step_2")["state"] == "committed"
    finally:
        os.kill(node1.pid, signal.SIGCONT)
    assert "(--sync-replicas)" in node0.log()
    wait_until(lambda: copies_everywhere(cluster, "run/step_2", set(cluster.ports), 2),
               timeout=30)


def test_a_node_whose_ram_dir_is_full_lives_on_and_lists_a_peers_step_once_there_is_room(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd, small_shm: Path) -> None:
    """node1's RAM dir on a /dev/shm that other processes filled: node0's commit cannot be
    listed there (no room for its records). node1 lives on (before, the OSError ended its
    watch of the commits, and the daemon with it) and lists the step once there is room."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0 = cluster.start("node0")
    node1 = cluster.nodes["node1"] = mounts.mount(*cluster.args("node1"), "--ram-limit", "1G",
                                                  ram_dir=small_shm / "ram")
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    fill(small_shm / "other-user")
    step = node0 / "run/step_1"
    step.mkdir(parents=True)
    (step / "shard").write_bytes(os.urandom(100_000))
    (step / ".metadata").write_bytes(b"metadata")
    wait_until(lambda: "is not listed here yet" in node1.log() or not pid_alive(node1.pid),
               timeout=15)
    assert pid_alive(node1.pid), node1.log()[-3000:]
    (small_shm / "other-user").unlink()
    wait_until(lambda: (s := node1.step("run/step_1")) is not None and s["state"] == "committed",
               timeout=15)
    assert (node1 / "run/step_1/shard").read_bytes() == (step / "shard").read_bytes()


def test_a_node_back_on_a_full_ram_dir_applies_a_delete_it_missed_once_there_is_room(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd, small_shm: Path) -> None:
    """A step deleted while node1 was down: node1 comes back on a /dev/shm other processes
    filled, with no room to record the delete. It lives on (before, the OSError ended its
    catch-up, and the daemon with it) and applies the delete once there is room."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    node0 = cluster.start("node0")
    node1 = cluster.nodes["node1"] = mounts.mount(*cluster.args("node1"), "--ram-limit", "1G",
                                                  ram_dir=small_shm / "ram")
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    step = node0 / "run/step_1"
    step.mkdir(parents=True)
    (step / "shard").write_bytes(os.urandom(100_000))
    (step / ".metadata").write_bytes(b"metadata")
    wait_until(lambda: (s := node1.step("run/step_1")) is not None and s["state"] == "committed"
               and "node1" in node0.step("run/step_1")["replicas"], timeout=15)
    tierfs("umount", str(node1.mountpoint))
    subprocess.run(["rm", "-r", str(step)], check=True)
    fill(small_shm / "other-user")
    node1 = cluster.start("node1")
    wait_until(lambda: "not applied here yet" in node1.log() or not pid_alive(node1.pid),
               timeout=15)
    assert pid_alive(node1.pid), node1.log()[-3000:]
    (small_shm / "other-user").unlink()
    wait_until(lambda: node1.step("run/step_1") is None, timeout=15)
    assert not (node1 / "run/step_1").exists()
