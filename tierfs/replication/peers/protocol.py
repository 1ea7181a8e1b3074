"""The peer protocol, sans-IO: frames, message schemas and the authentication handshake as pure
functions over bytes, tested without sockets; `replication.peers.channel` adapts them to trio
streams.

A frame is `u32 header length | u32 payload length | msgpack header | raw payload`. The header is
a map with a `type` and that type's fields, each checked against a schema; the payload carries
file bytes only, never anything decoded. Lengths are capped before anything is buffered (to a
few KiB and no payload until the peer has authenticated, HANDSHAKE_LIMITS), paths
must be safe relative paths, and anything else (an unknown type, a missing or mistyped field, a
malformed header) is a ProtocolError, on which the connection is dropped.

Authentication comes first, both ways, over fresh nonces: each side sends HELLO (its node id and
a random nonce) and answers the other's HELLO with PROOF = HMAC-SHA256(token, context, the
other's nonce, both node ids). A replayed PROOF fails because the nonce it answers is new.

Every frame after the handshake carries its tags (FrameMac), sent after its payload: GMAC
(AES-GCM with nothing to encrypt) under a key of its direction of this connection (from the
token and both nonces, frame_key), one tag over its prefix and header and one over each
TAG_SLICE bytes of its payload, each under a nonce of the frame's number and the part's
place in it. A frame injected into an established connection, replayed, reordered, reflected
back or altered (a slice moved within it included) fails its tags, and the connection is
dropped. GMAC runs in OpenSSL with the GIL let go (`cryptography`'s AESGCM), in whichever
thread moves the frame's bytes: a worker thread's for file payloads. Frames are
authenticated, not encrypted: an eavesdropper sees file bytes (TLS is for that).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tierfs.manifest import ManifestError, check_relative_path, decode_dirs
from tierfs.msgpack_map import decode_map

T = TypeVar("T")

PREFIX = struct.Struct(">II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 16 << 20
NONCE_BYTES = 32
PROOF_CONTEXT = b"tierfs-peer-v1"
FRAME_KEY_CONTEXT = b"tierfs-frames-v1"
TAG_BYTES = 16  # one tag
# Payload bytes per tag: a slice is authenticated in one call while it is in the CPU's cache
# (the receiver tags each as its bytes come), and the tags of a frame stay few (17 at most).
TAG_SLICE = 1 << 20

# type -> {field: python type}; every field is required, no other field is allowed.
SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "HELLO": {"node_id": str, "nonce": bytes},
    "PROOF": {"mac": bytes},
    "PING": {"node_id": str},
    "PONG": {"node_id": str},
    "PUT": {"path": str, "name": str, "xxh3": str, "size": int, "offset": int},
    # small whole files of a step at once (`replicator.SMALL_FILE`): their names, xxh3-128
    # digests and sizes, their bytes one after the other as the payload; answered by OK
    # (each is here, verified), NO_ROOM or ERROR, as a PUT
    "PUT_FILES": {"path": str, "names": list, "digests": list, "sizes": list},
    # hold these files of the step's committed version (their objects were PUT): answered by
    # HELD with the names now held, verified, or ERROR
    "HOLD": {"path": str, "version": int, "names": list},
    "HELD": {"names": list},
    "GET": {"path": str, "name": str, "xxh3": str, "offset": int, "length": int},
    # a GET to a holder of the file that may instead be answered by SOURCE: the node (another
    # reader) to GET the chunk from (`replication.peers.sources`); `avoid`: relays that failed
    "SWARM_GET": {"path": str, "name": str, "xxh3": str, "offset": int, "length": int,
                  "avoid": list},
    "SOURCE": {"node": str},
    # the small files of a step read back many at once (`PeerReader.read_files`): whichever of
    # these objects (by the names and xxh3-128 digests of the asker's manifest, in the same
    # order) this node holds whole in RAM, answered by FILES_DATA: the names and sizes of
    # those it sends, their bytes one after the other as its payload
    "GET_FILES": {"path": str, "names": list, "digests": list},
    "FILES_DATA": {"names": list, "sizes": list},
    "VERIFY": {"path": str, "name": str, "xxh3": str, "repair": bool},  # check your copy
    "VERIFIED": {"state": str},             # good, bad, missing or repaired
    "DELETE": {"path": str, "version": int, "committed_ns": int},  # a step was deleted
    # the encoded manifest of the step's committed `version` from `offset` on: answered by
    # MANIFEST_PART (a chunk of it, `total` its whole length) or ERROR (not committed here)
    "MANIFEST": {"path": str, "version": int, "offset": int},
    "MANIFEST_PART": {"total": int},
    # which of these files of a step being written are in your tree (written there, sealed or
    # not, recorded in etcd or not): answered by HAVE naming them (`peers.peer_files`)
    "FILES": {"path": str, "names": list},
    "HAVE": {"names": list},
    # the files you write of the save under way of a step, in name order after `after`
    # (a page): answered by WRITES naming them, those of them still open for writing, the
    # directories inside the step that hold them (manifest directory entries: their owner
    # and mode, which the committer's manifest records), whether more follow, and the
    # version of the step committed there (`peers.peer_files`)
    "WRITTEN": {"path": str, "after": str},
    "WRITES": {"names": list, "open": list, "dirs": list, "more": bool, "version": int},
    "DATA": {},
    "OK": {},
    "ERROR": {"message": str},
    # a PUT refused for want of room on the receiving node (its RAM tier or the file system
    # of its RAM dir is full): the sender makes its copies on another node meanwhile
    "NO_ROOM": {"message": str},
}
PATH_FIELDS = ("path", "name")
NAME_LISTS = ("names", "open")  # lists of paths inside a step, each checked as a path field
MAX_AVOID = 16  # relays a SWARM_GET names as failed
# names per HOLD, HELD, FILES, HAVE, WRITES, GET_FILES, FILES_DATA or PUT_FILES: with paths of
# at most 4 KiB, under MAX_HEADER
MAX_NAMES = 1000
MAX_NAME_BYTES = 256 << 10  # bytes of names one such message carries at most

PAYLOAD_TYPES = {"PUT", "PUT_FILES", "DATA", "MANIFEST_PART", "FILES_DATA"}
STREAM_FROM = 1 << 18  # payload bytes from which a streamed type's payload is streamed


class ProtocolError(Exception):
    """The peer sent something malformed, oversized or unexpected."""


@dataclass(frozen=True)
class FrameLimits:
    """The largest header and payload a decoder accepts, checked at a frame's prefix."""

    name: str
    header: int
    payload: int


LIMITS = FrameLimits("authenticated", MAX_HEADER, MAX_PAYLOAD)
# Until the peer has proven the token only HELLO and PROOF come, small and without payload: an
# unauthenticated connection must not make the daemon buffer a 17 MiB frame (times however many
# connections a stranger opens). A HELLO is a node id (a host name) and a 32-byte nonce.
HANDSHAKE_LIMITS = FrameLimits("before authentication", 4096, 0)


@dataclass(frozen=True)
class Message:
    """One decoded message. A received `payload` is a memoryview of the receiver's reused
    buffer: valid until the next message is received on that channel (or decoded by that
    FrameDecoder), unless the receiver takes it (PeerChannel.take_payload). A message whose
    payload is streamed (`FrameDecoder.streamed`) comes with none: `pending` says how many
    bytes of it follow, to be taken with `FrameDecoder.take_stream` before anything else."""

    type: str
    fields: dict[str, Any]
    payload: bytes | memoryview = b""
    pending: int = 0

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


def encode(kind: str, payload: bytes | memoryview = b"", **fields: Any) -> list[bytes]:
    """The buffers of one frame (header and payload kept apart: no copy of the payload)."""
    return [encode_header(kind, len(payload), **fields), payload]  # type: ignore[list-item]


def encode_header(kind: str, payload_len: int, **fields: Any) -> bytes:
    """The prefix and header of a frame whose `payload_len` payload bytes follow it (sent by
    the caller, e.g. straight from a file with sendfile)."""
    validate(Message(kind, fields))
    _check_payload(kind, payload_len)
    header = msgpack.packb({"type": kind, **fields}, use_bin_type=True)
    return PREFIX.pack(len(header), payload_len) + header


def _check_payload(kind: str, length: int) -> None:
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"{kind} payload too large ({length} bytes)")
    if length and kind not in PAYLOAD_TYPES:
        raise ProtocolError(f"{kind} carries no payload")


def validate(message: Message) -> Message:
    schema = SCHEMAS.get(message.type)
    if schema is None:
        raise ProtocolError(f"unknown message type {message.type!r}")
    if set(message.fields) != set(schema):
        raise ProtocolError(f"{message.type}: fields {sorted(message.fields)} are not "
                            f"{sorted(schema)}")
    for name, kind in schema.items():
        value = message.fields[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ProtocolError(f"{message.type}.{name} has the wrong type")
        if kind is int and value < 0:
            raise ProtocolError(f"{message.type}.{name} is negative")
    for name in PATH_FIELDS:
        if name in message.fields:
            try:
                check_relative_path(message.fields[name])
            except ManifestError as exc:
                raise ProtocolError(f"{message.type}.{name}: {exc}") from None
    for name in NAME_LISTS:
        if name in message.fields:
            _check_names(message.type, message.fields[name])
    _check_payload(message.type, len(message.payload))
    if message.type == "HELLO" and len(message.fields["nonce"]) != NONCE_BYTES:
        raise ProtocolError("HELLO nonce has the wrong length")
    if message.type == "SWARM_GET":
        _check_node_ids(message.fields["avoid"])
    if message.type in ("GET", "SWARM_GET") and message.fields["length"] > MAX_PAYLOAD:
        raise ProtocolError("GET asks for too much at once")
    if message.type in ("GET_FILES", "PUT_FILES"):
        _check_paired(message, "digests", lambda d: isinstance(d, str) and is_xxh3_128(d))
    if message.type in ("FILES_DATA", "PUT_FILES"):
        _check_paired(message, "sizes", lambda n: type(n) is int and 0 <= n <= MAX_PAYLOAD)
    if message.type == "WRITES":
        if len(message.fields["dirs"]) > MAX_NAMES:
            raise ProtocolError(f"WRITES names more than {MAX_NAMES} directories")
        try:
            decode_dirs(message.fields["dirs"])
        except ManifestError as exc:
            raise ProtocolError(f"WRITES.dirs: {exc}") from None
    return message


def name_batches(items: Sequence[T], name: Callable[[T], str]) -> list[list[T]]:
    """`items` in batches one message may name (`name(item)`): MAX_NAMES names and
    MAX_NAME_BYTES of them at most each, so that a frame's header stays far under its cap."""
    batches: list[list[T]] = [[]]
    size = 0
    for item in items:
        name_bytes = len(name(item).encode())
        if batches[-1] and (len(batches[-1]) >= MAX_NAMES
                            or size + name_bytes > MAX_NAME_BYTES):
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += name_bytes
    return batches


def cut_files(message: Message, payload: bytes | memoryview) -> list[memoryview]:
    """The files of a FILES_DATA or PUT_FILES, whose payload holds them one after the other
    at the message's `sizes`: a view of each, in order (ProtocolError if the sizes do not add
    up to the payload)."""
    sizes: list[int] = message["sizes"]
    if sum(sizes) != len(payload):
        raise ProtocolError(f"{message.type} of {len(payload)} bytes names {sum(sizes)}")
    view, at, files = memoryview(payload), 0, []
    for size in sizes:
        files.append(view[at:at + size])
        at += size
    return files


def is_xxh3_128(value: str) -> bool:
    """A file's xxh3-128 as manifests and object names spell it: 32 lowercase hex digits."""
    return len(value) == 32 and not set(value) - _HEX_DIGITS


_HEX_DIGITS = set("0123456789abcdef")


def _check_paired(message: Message, field: str, good: Callable[[Any], bool]) -> None:
    """`field` holds one good value for each of the message's names."""
    values = message.fields[field]
    if len(values) != len(message.fields["names"]) or not all(map(good, values)):
        raise ProtocolError(f"{message.type}.{field} is not one value for each name")


def _check_node_ids(nodes: list[Any]) -> None:
    if len(nodes) > MAX_AVOID or not all(isinstance(n, str) and 0 < len(n) <= 255
                                         for n in nodes):
        raise ProtocolError("SWARM_GET.avoid is not a short list of node ids")


def _check_names(kind: str, names: list[Any]) -> None:
    if len(names) > MAX_NAMES:
        raise ProtocolError(f"{kind} names more than {MAX_NAMES} files")
    for item in names:
        if not isinstance(item, str):
            raise ProtocolError(f"{kind}.names holds a non-string")
        try:
            check_relative_path(item)
        except ManifestError as exc:
            raise ProtocolError(f"{kind}.names: {exc}") from None


class FrameDecoder:
    """Bytes in, validated messages out, one frame at a time, in three parts: the prefix (its
    lengths are checked before anything else is buffered), the header, and the payload,
    received into a buffer reused from frame to frame; the header is decoded and validated
    once the frame is complete. `writable()` is where the next bytes go (e.g.
    `socket.recv_into`), `advance(n)` says how many arrived; `feed` does both for bytes that
    are already in hand. `limits` may be raised between frames (once the peer has
    authenticated)."""

    def __init__(self, limits: FrameLimits = LIMITS) -> None:
        self.limits = limits
        self._prefix = bytearray(PREFIX.size)
        self._part: bytearray | memoryview = self._prefix  # the part being filled
        self._filled = 0
        self._payload_buffer = bytearray()
        self._payload_len = 0
        self._header: bytes | None = None  # once read, until its payload is in
        self._target: memoryview | None = None  # where the next payload goes, if offered
        self._ready: Message | None = None
        self._fed = bytearray()  # bytes given to feed() beyond the current frame
        # once set (after the handshake, between frames), every frame ends with its tags
        self.mac: FrameMac | None = None
        self._tag = bytearray()  # the tags of the frame being read, once its payload is in
        self._running: FrameTags | None = None  # the tags of the frame being read
        self._payload: bytes | memoryview = b""  # of the frame whose tags are being read
        # Types whose payloads of STREAM_FROM bytes or more are not buffered: their message
        # comes once its header is in (checked then), and the caller takes the payload and its
        # tags itself (`take_stream`), a slice at a time, straight where it goes.
        self.streamed: frozenset[str] = frozenset()
        self._stream: tuple[int, FrameTags | None] | None = None  # announced, not taken
        self._streaming = False  # a streamed payload is being taken: no frame until it ends

    def writable(self) -> memoryview:
        """Where the next bytes of the current frame go (empty while a message is ready)."""
        if self._streaming:
            raise ProtocolError("a streamed payload was not taken")
        if self._ready is not None:
            return memoryview(b"")
        return memoryview(self._part)[self._filled:]

    def advance(self, count: int) -> None:
        """`count` bytes were written at the start of `writable()`. A payload's slices are
        tagged as they come in (in the caller's thread: a worker's for bulk data)."""
        self._filled += count
        if self._running is not None and self.in_payload:
            self._running.payload(memoryview(self._part), self._filled)
        while self._ready is None and self._filled == len(self._part):
            self._part_done()

    def _part_done(self) -> None:
        self._filled = 0
        if self._part is self._prefix:
            header_len, self._payload_len = PREFIX.unpack(self._prefix)
            limits = self.limits
            if header_len > limits.header or self._payload_len > limits.payload:
                raise ProtocolError(
                    f"frame too large {limits.name} ({header_len}+{self._payload_len} bytes, "
                    f"at most {limits.header}+{limits.payload})")
            if self.mac is not None:
                self._running = self.mac.start(self._payload_len)
            self._part = bytearray(header_len)
        elif self._header is None:
            self._header = bytes(self._part)
            if self._running is not None:
                self._running.head(bytes(self._prefix) + self._header)
            if self.streamed and self._payload_len >= STREAM_FROM and self._stream_it():
                return
            self._part = self._payload_view()
        elif self._part is not self._tag:
            self._payload = self._part if self._payload_len else b""
            if self._running is None:
                self._frame_done()
            else:
                self._tag = bytearray(tag_length(self._payload_len))
                self._part = self._tag
        else:
            assert self._running is not None
            if not self._running.matches(self._tag):
                raise ProtocolError("a frame failed its MAC (injected, replayed, reordered "
                                    "or altered)")
            self._running = None
            self._frame_done()

    def _stream_it(self) -> bool:
        """The header of a frame with a large payload is in: if its type is streamed, its
        message is ready now (its header checked), with its payload `pending`."""
        assert self._header is not None
        kind, fields = _decode_header(self._header, self._payload_len)
        if kind not in self.streamed:
            return False
        self._ready = Message(kind, fields, pending=self._payload_len)
        self._stream = (self._payload_len, self._running)
        self._streaming = True
        self._header = None
        self._running = None
        self._part = self._prefix
        return True

    def take_stream(self) -> tuple[int, FrameTags | None]:
        """The streamed payload announced by the last message: its length, and its tags so
        far (None before authentication), to be fed its slices (`FrameTags.slice`) and
        checked against the tag bytes after it (`tag_length`); `stream_done` once it is
        taken."""
        if self._stream is None:
            raise ProtocolError("no streamed payload to take")
        stream, self._stream = self._stream, None
        return stream

    def stream_done(self) -> None:
        self._streaming = False

    def _frame_done(self) -> None:
        # checked once the whole frame is in: a refused frame leaves nothing unread, so the
        # peer sees its connection closed, not reset
        assert self._header is not None
        kind, fields = _decode_header(self._header, self._payload_len)
        self._ready = Message(kind, fields, self._payload)
        self._header = None
        self._payload = b""
        self._part = self._prefix

    def _payload_view(self) -> memoryview:
        target, self._target = self._target, None
        if target is not None and len(target) >= self._payload_len:
            return target[:self._payload_len]  # straight into the caller's buffer: no copy
        if len(self._payload_buffer) < self._payload_len:
            # a new buffer, not a resize: views of the old one may still be in use
            self._payload_buffer = bytearray(max(self._payload_len, 1 << 16))
        return memoryview(self._payload_buffer)[:self._payload_len]

    def offer(self, target: memoryview | None) -> None:
        """Receive the next frame's payload into `target` (the caller's, e.g. a pooled buffer)
        if it fits there; a larger payload goes to the decoder's own buffer as usual."""
        self._target = target

    @property
    def in_payload(self) -> bool:
        """The part being filled is a payload (its frame's lengths were checked)."""
        return self._header is not None and self._ready is None and \
            self._part is not self._tag

    @property
    def ready(self) -> bool:
        """A whole message is waiting (`next_message`)."""
        return self._ready is not None

    def give_away_payload(self) -> None:
        """The last message's payload now belongs to its receiver: the next payload goes to a
        new buffer rather than over it (instead of a copy of it)."""
        self._payload_buffer = bytearray()

    def next_message(self) -> Message | None:
        if self._ready is None and self._fed:
            self._pump()
        message, self._ready = self._ready, None
        return message

    def feed(self, data: bytes) -> None:
        self._fed += data
        self._pump()

    def _pump(self) -> None:
        while self._fed and self._ready is None:
            target = self.writable()
            count = min(len(target), len(self._fed))
            target[:count] = self._fed[:count]
            del self._fed[:count]
            self.advance(count)

    @property
    def idle(self) -> bool:
        """Between frames: nothing of a next frame read yet, no message waiting."""
        return (self._ready is None and self._part is self._prefix and not self._filled
                and not self._fed and not self._streaming)


def _decode_header(raw: bytes, payload_len: int) -> tuple[str, dict[str, Any]]:
    header = decode_map(raw, ProtocolError, "message header", key="type")
    kind = header.pop("type")
    validate(Message(kind, header))
    _check_payload(kind, payload_len)
    return kind, header


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(token: bytes, their_nonce: bytes, prover: str, verifier: str) -> bytes:
    """What `prover` sends to show `verifier` it knows the token, for `verifier`'s nonce."""
    message = b"|".join([PROOF_CONTEXT, their_nonce, prover.encode(), verifier.encode()])
    return hmac.new(token, message, hashlib.sha256).digest()


def check_proof(token: bytes, my_nonce: bytes, prover: str, verifier: str, mac: bytes) -> bool:
    return hmac.compare_digest(proof(token, my_nonce, prover, verifier), mac)


def frame_key(token: bytes, sender: str, receiver: str, sender_nonce: bytes,
              receiver_nonce: bytes) -> bytes:
    """The key of the frames `sender` sends `receiver` on one connection: new with each
    connection's nonces, and one per direction, so a frame cannot be sent back to its sender."""
    message = b"|".join([FRAME_KEY_CONTEXT, sender_nonce, receiver_nonce, sender.encode(),
                         receiver.encode()])
    return hmac.new(token, message, hashlib.sha256).digest()


def tag_length(payload_len: int) -> int:
    """The bytes of tags after a frame with `payload_len` payload bytes: one for its prefix
    and header, one per TAG_SLICE of payload (a last short slice included)."""
    return TAG_BYTES * (1 + -(-payload_len // TAG_SLICE))


class FrameMac:
    """The tags of one direction of a connection, frame after frame: frame n (from 0, the
    first after the handshake) has a GMAC tag (AES-256-GCM, nothing encrypted) of its prefix
    and header under the nonce (n, 0), and one of its payload's slice i (TAG_SLICE bytes)
    under (n, i + 1). The sender and the receiver each hold one, made from the same key;
    their counts move together, frame by frame. OpenSSL computes each tag with the GIL let
    go, at well over the copy rate of memory."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._sequence = 0

    def start(self, payload_len: int) -> FrameTags:
        """The tags of the next frame, to be given its parts in order."""
        tags = FrameTags(self._aead, self._sequence, payload_len)
        self._sequence += 1
        return tags

    def tag(self, *parts: bytes | memoryview) -> bytes:
        """The tags of the next frame, given whole: `parts` joined are its prefix, header and
        payload (as `encode` makes them)."""
        frame = b"".join(parts)
        # (bytes that are no frame get tags too, of their first bytes and the rest: what a
        # hostile peer's test sends must get past the tags to the checks behind them)
        header_len = PREFIX.unpack_from(frame)[0] if len(frame) >= PREFIX.size else 0
        split = min(len(frame), PREFIX.size + header_len)
        payload = memoryview(frame)[split:]
        tags = self.start(len(payload))
        tags.head(frame[:split])
        tags.payload(payload, len(payload))
        return tags.digest()


class FrameTags:
    """The tags of one frame, made as its parts come: `head` (prefix and header), then
    `payload` as its bytes arrive, a slice tagged once it is whole (a last short one once the
    payload is complete)."""

    def __init__(self, aead: AESGCM, sequence: int, payload_len: int) -> None:
        self._aead = aead
        self._nonce = sequence.to_bytes(8, "big")
        self._payload_len = payload_len
        self._tags: list[bytes] = []
        self._tagged = 0  # payload bytes tagged so far

    def _tag(self, data: bytes | memoryview) -> None:
        nonce = self._nonce + len(self._tags).to_bytes(4, "big")
        self._tags.append(self._aead.encrypt(nonce, b"", data))

    def head(self, prefix_and_header: bytes) -> None:
        self._tag(prefix_and_header)

    def payload(self, payload: memoryview, filled: int) -> None:
        """`payload[:filled]` of the frame's payload are in: tag the slices now whole."""
        while self._tagged < filled and (filled - self._tagged >= TAG_SLICE
                                         or filled == self._payload_len):
            end = min(self._tagged + TAG_SLICE, filled)
            self._tag(payload[self._tagged:end])
            self._tagged = end

    def slice(self, data: bytes | memoryview) -> None:
        """The next slice of the payload, whole (TAG_SLICE bytes, or the last ones)."""
        self._tag(data)
        self._tagged += len(data)

    def digest(self) -> bytes:
        if self._tagged != self._payload_len or not self._tags:
            raise ProtocolError("a frame's tags were asked for before its payload was in")
        return b"".join(self._tags)

    def matches(self, received: bytes | bytearray) -> bool:
        return hmac.compare_digest(self.digest(), bytes(received))
