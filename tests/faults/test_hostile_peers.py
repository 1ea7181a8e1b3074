"""Hostile network input on the peer protocol: property-based fuzzing (hypothesis) of the sans-IO
core, then of a live daemon's peer port, with random, truncated, oversized and replayed frames,
wrong tokens, strangers, and path traversal (`..`, absolute paths, NUL, reserved names) in every
request that carries a path or a list of file names (HOLD), and in manifests (the codec).
Every bad connection is dropped with a log line,
no handler fails unexpectedly, the daemon keeps serving (a real replication afterwards), and
nothing is written outside the RAM dir. The frames tried are counted."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import time
import uuid
from collections import Counter
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MountFactory, wait_until
from tests.faults.results_io import pick, write_results
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_crash import save, verify_committed
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd
from tierfs.replication.peers import protocol as proto

pytestmark = pytest.mark.faults

MARK = f"tierfs-escape-{uuid.uuid4().hex[:8]}"  # in every hostile path: searched for after
HEX = "0123456789abcdef"


def hostile_paths() -> st.SearchStrategy[str]:
    parts = st.sampled_from(["..", ".", "", MARK, "step_1", "a\x00b", ".tierfs-manifest",
                             ".tierfs-tmp-1", "run", "x" * 300, "é", "\\..\\"])
    return st.one_of(
        st.sampled_from([f"../{MARK}", f"../../{MARK}", f"/tmp/{MARK}", f"/dev/shm/{MARK}",
                         f"run/../../{MARK}", f"{MARK}\x00/x", f"./{MARK}", f"run//{MARK}",
                         f"run/{MARK}/..", "", "/", ".."]),
        st.lists(parts, min_size=1, max_size=6).map("/".join),
        st.lists(parts, min_size=1, max_size=4).map(lambda p: "/" + "/".join(p)),
        st.text(max_size=40))


def hex32() -> st.SearchStrategy[str]:
    return st.one_of(st.text(alphabet=HEX, min_size=32, max_size=32),
                     st.sampled_from([f"../{MARK}", "/" * 32, "g" * 32, ""]))


def field_value(kind: object, paths: st.SearchStrategy[str]) -> st.SearchStrategy[object]:
    number = st.integers(-2**63, 2**64 - 1)
    wrong = st.one_of(st.none(), st.booleans(), number, st.binary(max_size=40),
                      st.text(max_size=10), st.lists(number, max_size=3))
    if kind is str:
        return st.one_of(paths, wrong)
    if kind is int:
        return st.one_of(st.integers(0, 1 << 40), st.just(-1), st.just(2**64 - 1), wrong)
    return wrong


def raw_manifest(paths: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    entry = st.tuples(paths, st.integers(-1, 1 << 20), hex32(), st.integers(0, 10),
                      st.integers(0, 0o7777), st.lists(st.text(alphabet=HEX, min_size=16,
                                                               max_size=16), max_size=2))
    return st.builds(
        lambda path, version, node, files: msgpack.packb(
            {"format": 1, "path": path, "step": 1, "version": version, "node_id": node,
             "committed_ns": 0, "files": [list(f) for f in files]}, use_bin_type=True),
        paths, st.integers(-1, 3), st.sampled_from(["node1", "node0", "stranger"]),
        st.lists(entry, max_size=3))


def raw_frame(kind: str, fields: dict[str, object], payload: bytes = b"") -> bytes:
    header = msgpack.packb({"type": kind, **fields}, use_bin_type=True)
    return proto.PREFIX.pack(len(header), len(payload)) + header + payload


@st.composite
def hostile_frame(draw: st.DrawFn) -> bytes:
    """One frame a hostile or broken peer might send (mostly invalid, some valid)."""
    paths = hostile_paths()
    kind = draw(st.sampled_from([*proto.SCHEMAS, "NOPE", ""]))
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.binary(min_size=1, max_size=300))  # noise
    if choice == 1:  # a prefix that announces too much
        return struct.pack(">II", draw(st.integers(proto.MAX_HEADER + 1, 2**32 - 1)),
                           draw(st.integers(0, 2**32 - 1)))
    if choice == 2:  # a path field with a hostile value, everything else well formed
        kind = draw(st.sampled_from(["PUT", "GET", "VERIFY", "HOLD", "HELD", "MANIFEST"]))
        fields = {"path": draw(paths), "name": draw(paths), "xxh3": draw(hex32()), "size": 10,
                  # a manifest's offset may be beyond its end (refused); a PUT's stays 0
                  "offset": draw(st.sampled_from([0, 1, 2**40])) if kind == "MANIFEST" else 0,
                  "length": 10, "names": draw(st.lists(paths, max_size=3)),
                  "repair": True, "version": 1}
        fields = {k: v for k, v in fields.items() if k in proto.SCHEMAS[kind]}
        return raw_frame(kind, fields, b"x" * 10 if kind == "PUT" else b"")
    if choice == 3:  # HOLD of a step this node may or may not know, hostile names among many
        names = draw(st.lists(st.one_of(paths, st.just("__0_0.distcp"), st.integers(-9, 9)),
                              max_size=5))
        if draw(st.booleans()):  # more names than one message may carry
            names = names + ["f"] * (proto.MAX_NAMES + 1 - len(names))
        return raw_frame("HOLD", {"path": draw(st.sampled_from(["run/step_1", "run/step_7",
                                                                 f"run/{MARK}"])),
                                  "version": draw(st.integers(0, 3)), "names": names})
    schema = proto.SCHEMAS.get(kind, {"x": str})
    fields = {name: draw(field_value(t, paths)) for name, t in schema.items()}
    if choice == 4 and fields:  # a field missing
        fields.pop(draw(st.sampled_from(sorted(fields))))
    if choice == 5:  # an extra field (a path in HELD, say)
        fields["path"] = draw(paths)
    payload = draw(st.binary(max_size=64)) if choice == 6 else b""
    frame = raw_frame(kind, fields, payload)
    if choice == 7:  # truncated: the peer goes away mid-frame
        return frame[:draw(st.integers(1, max(1, len(frame) - 1)))]
    if choice == 8:  # a lying prefix
        return struct.pack(">II", draw(st.integers(0, 4096)), draw(st.integers(0, 4096))) + \
            frame[8:]
    return frame


# -- the sans-IO core -----------------------------------------------------------------------

def test_fuzz_sans_io_core_and_manifest_codec() -> None:
    counts: Counter[str] = Counter()

    @settings(max_examples=pick(600, 8000), deadline=None, database=None)
    @given(st.lists(hostile_frame(), min_size=1, max_size=4), st.integers(1, 64))
    def frames_in_pieces(frames: list[bytes], piece: int) -> None:
        decoder = proto.FrameDecoder()
        data = b"".join(frames)
        counts["frames"] += len(frames)
        try:
            for start in range(0, len(data), piece):
                decoder.feed(data[start:start + piece])
                while (message := decoder.next_message()) is not None:
                    check_accepted(message)
                    counts["accepted"] += 1
        except proto.ProtocolError:
            counts["refused"] += 1

    @settings(max_examples=pick(400, 5000), deadline=None, database=None)
    @given(raw_manifest(hostile_paths()))
    def manifests(data: bytes) -> None:
        counts["manifests"] += 1
        try:
            manifest = mf.decode(data)
        except mf.ManifestError:
            counts["manifests_refused"] += 1
            return
        for name in [manifest.path, *(f.name for f in manifest.files)]:
            assert mf.check_relative_path(name) == name

    frames_in_pieces()
    manifests()
    assert counts["refused"] > counts["frames"] // 10 and counts["manifests_refused"]
    write_results("hostile_sans_io", dict(counts))


def check_accepted(message: proto.Message) -> None:
    """What the decoder lets through is well formed: known type, exact fields, safe paths."""
    schema = proto.SCHEMAS[message.type]
    assert set(message.fields) == set(schema)
    values = [message.fields[name] for name in proto.PATH_FIELDS if name in message.fields]
    for name in proto.NAME_LISTS:
        if name in message.fields:
            assert len(message.fields[name]) <= proto.MAX_NAMES
            values += message.fields[name]
    for value in values:
        assert mf.check_relative_path(value) == value
        assert not value.startswith("/") and ".." not in value.split("/")
        assert "\0" not in value


# -- the live port --------------------------------------------------------------------------

class RawPeer:
    """A blocking client that speaks (or abuses) the peer protocol."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.decoder = proto.FrameDecoder()
        self.send_mac: proto.FrameMac | None = None  # after the handshake: every frame's MAC

    def send_frame(self, frame: bytes) -> None:
        """A whole frame, with its MAC once authenticated (so it reaches the decoder and the
        request's checks, not just the MAC check)."""
        tag = self.send_mac.tag(frame) if self.send_mac is not None else b""
        self.sock.sendall(frame + tag)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def receive(self) -> proto.Message | None:
        while (message := self.decoder.next_message()) is None:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.decoder.feed(data)
        return message

    def handshake(self, token: bytes, me: str, server: str = "node0",
                  replay_proof: bytes | None = None) -> tuple[bool, bytes]:
        """Authenticate as `me`; True if the server accepted. Returns the PROOF sent."""
        mac = b""
        nonce = proto.new_nonce()
        try:
            self.sock.sendall(b"".join(proto.encode("HELLO", node_id=me, nonce=nonce)))
            hello = self.receive()
            if hello is None or hello.type != "HELLO":
                return False, b""
            mac = replay_proof or proto.proof(token, hello["nonce"], me, server)
            self.sock.sendall(b"".join(proto.encode("PROOF", mac=mac)))
            answer = self.receive()
            if answer is None or answer.type != "PROOF":
                return False, mac
            self.send_mac = proto.FrameMac(proto.frame_key(token, me, server, nonce,
                                                           hello["nonce"]))
            self.decoder.mac = proto.FrameMac(proto.frame_key(token, server, me,
                                                              hello["nonce"], nonce))
            # the server has checked our proof once it answers this
            self.send_frame(b"".join(proto.encode("PING", node_id=me)))
            pong = self.receive()
        except OSError:
            return False, mac
        return pong is not None and pong.type == "PONG", mac

    def finish(self) -> str:
        """Stop sending, read until the server closes: 'closed' or 'reset'."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            while self.sock.recv(65536):
                pass
            return "closed"
        except TimeoutError:
            return "timeout"
        except OSError:  # reset, or already gone
            return "reset"
        finally:
            self.close()


def escaped_files(shallow: list[Path], deep: Path, skip: list[Path]) -> list[str]:
    """Anything named with MARK in the places a traversal from a RAM dir could reach: the
    directories listed (not their subdirectories: other engineers' mounts may live there),
    and the whole of `deep` (this test's own directory) except the mountpoints."""
    found = [str(p / n) for p in shallow if p.is_dir() for n in os.listdir(p) if MARK in n]
    skipped = {str(p) for p in skip}
    for dirpath, dirs, files in os.walk(deep):
        dirs[:] = [d for d in dirs if os.path.join(dirpath, d) not in skipped]
        found += [os.path.join(dirpath, n) for n in files + dirs if MARK in n]
    return found


def test_fuzz_live_peer_port(mounts: MountFactory, token_file: Path, etcd_server: Etcd,  # noqa: F811
                             tmp_path: Path) -> None:
    started = time.monotonic()
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    for node_id in cluster.ports:
        cluster.start(node_id)
    node0, node1 = cluster.nodes["node0"], cluster.nodes["node1"]
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    port = cluster.ports["node0"]
    token = token_file.read_bytes().strip()
    counts: Counter[str] = Counter()
    before = node0.log().count("peer connection from")

    # A replayed PROOF: recorded from a good session, sent again on a new connection.
    peer = RawPeer(port)
    accepted, recorded = peer.handshake(token, "node1")
    peer.finish()
    assert accepted
    counts["frames"] += 3
    for _ in range(3):
        peer = RawPeer(port)
        accepted, _mac = peer.handshake(token, "node1", replay_proof=recorded)
        assert not accepted, "a replayed proof got in"
        counts["replays_refused"] += 1
        counts["frames"] += 2
        peer.finish()

    @settings(max_examples=pick(150, 1500), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["none", "token", "wrong_token", "stranger"]),
           st.lists(hostile_frame(), min_size=1, max_size=5))
    def session(auth: str, frames: list[bytes]) -> None:
        peer = RawPeer(port)
        try:
            if auth != "none":
                me = "stranger" if auth == "stranger" else "node1"
                key = b"not-the-token" if auth == "wrong_token" else token
                accepted, _mac = peer.handshake(key, me)
                counts["frames"] += 3
                assert accepted == (auth == "token"), f"{auth} session accepted={accepted}"
                counts[f"sessions:{auth}"] += 1
                if not accepted:
                    return
            else:
                counts["sessions:unauthenticated"] += 1
            for frame in frames:
                try:
                    peer.send_frame(frame)
                except OSError:
                    break  # dropped already
                counts["frames"] += 1
            counts[f"ended:{peer.finish()}"] += 1
        finally:
            peer.close()

    session()

    # Every path field, every request, each traversal form: refused, always.
    for path in [f"../{MARK}", f"/tmp/{MARK}", f"run/../../{MARK}", f"{MARK}\x00", "..",
                 f"run/.tierfs-manifest/{MARK}"]:
        hostile = [
            raw_frame("PUT", {"path": path, "name": "f", "xxh3": "a" * 32, "size": 3,
                              "offset": 0}, b"abc"),
            raw_frame("PUT", {"path": "run/step_1", "name": path, "xxh3": "a" * 32, "size": 3,
                              "offset": 0}, b"abc"),
            raw_frame("GET", {"path": path, "name": "f", "xxh3": "a" * 32, "offset": 0,
                              "length": 3}),
            raw_frame("GET", {"path": "run/step_1", "name": path, "xxh3": "a" * 32,
                              "offset": 0, "length": 3}),
            raw_frame("VERIFY", {"path": path, "name": "f", "xxh3": "a" * 32, "repair": True}),
            raw_frame("HOLD", {"path": path, "version": 1, "names": ["f"]}),
            raw_frame("HOLD", {"path": "run/step_1", "version": 1, "names": ["f", path]}),
            raw_frame("HELD", {"names": [path]}),
        ]
        for frame in hostile:
            peer = RawPeer(port)
            accepted, _mac = peer.handshake(token, "node1")
            assert accepted
            peer.send_frame(frame)
            reply = peer.receive()
            counts["frames"] += 4
            counts["traversal_requests"] += 1
            assert reply is None, f"a hostile request was answered: {reply}"
            peer.finish()

    # The daemon is alive, logged every drop, never failed unexpectedly, wrote nowhere else.
    log = node0.log()
    assert node0.status()["pid"] == node0.pid
    dropped = log.count("peer connection from") - before
    assert dropped >= counts["traversal_requests"] + counts["sessions:wrong_token"] + \
        counts["sessions:stranger"] + counts["replays_refused"]
    unexpected = re.findall(r"peer connection from \S+ \(\S+\) failed", log)
    assert not unexpected and "Traceback" not in log, "a handler failed unexpectedly"
    ram = node0.ram_dir
    shallow = [Path("/"), Path("/tmp"), Path("/dev/shm"), Path("/etc"), ram, ram / "tree",
               ram / "objects", ram.parent, tmp_path.parent]
    escaped = escaped_files(shallow, tmp_path, skip=[node0.mountpoint, node1.mountpoint])
    assert not escaped, escaped

    # And it still replicates for real.
    files = {"__0_0.distcp": os.urandom(9 << 20), ".metadata": b"meta"}
    save(node0 / "run/step_7", files)
    wait_until(lambda: node0.step("run/step_7")["replicas"] == ["node1"], timeout=30)
    verify_committed(node1, {"run/step_7": files})
    write_results("hostile_live_port", {
        **dict(counts), "connections_dropped_with_log_line": dropped,
        "seconds": round(time.monotonic() - started, 1)})


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def cut_off_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes (or resets) the connection within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset: closed with our bytes unread
        return True


def test_a_big_frame_before_authentication_is_refused_at_its_prefix(
        mounts: MountFactory, token_file: Path, etcd_server: Etcd) -> None:  # noqa: F811
    """Strangers announce 16 MiB frames (a PUT header, then all but the last byte of its
    payload) without authenticating: each connection is closed at the frame's prefix, the
    daemon buffers nothing (its RSS stays put), and honest peers still replicate."""
    cluster = Cluster(mounts, token_file, 2, etcd_server)
    for node_id in cluster.ports:
        cluster.start(node_id)
    node0 = cluster.nodes["node0"]
    wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
    port = cluster.ports["node0"]
    connections, size = 8, proto.MAX_PAYLOAD
    header = msgpack.packb({"type": "PUT", "path": "run/step_1", "name": "f",
                            "xxh3": "a" * 32, "size": size, "offset": 0}, use_bin_type=True)
    body = bytes(size - 1)  # the frame stays incomplete: a buffering server keeps waiting
    rss_before = rss_bytes(node0.pid)
    peers = []
    try:
        for _ in range(connections):
            peer = RawPeer(port)
            peers.append(peer)
            peer.sock.sendall(proto.PREFIX.pack(len(header), size) + header)
            with contextlib.suppress(OSError):  # closed under us: the point
                peer.sock.sendall(body)
        grown = rss_bytes(node0.pid) - rss_before
        started = time.monotonic()
        cut = [cut_off_within(peer.sock, 2.0) for peer in peers]
        waited = time.monotonic() - started
    finally:
        for peer in peers:
            peer.close()
    assert grown < 16 << 20, f"daemon RSS grew by {grown >> 20} MiB"
    assert all(cut), f"{cut.count(False)} of {connections} connections kept open " \
                     f"(waited {waited:.1f} s)"
    wait_until(lambda: node0.log().count("frame too large before authentication") ==
               connections, timeout=5)
    assert "Traceback" not in node0.log() and node0.status()["pid"] == node0.pid

    files = {"__0_0.distcp": os.urandom(9 << 20), ".metadata": b"meta"}  # > one 8 MiB frame
    save(node0 / "run/step_3", files)
    wait_until(lambda: node0.step("run/step_3")["replicas"] == ["node1"], timeout=30)
    verify_committed(cluster.nodes["node1"], {"run/step_3": files})
