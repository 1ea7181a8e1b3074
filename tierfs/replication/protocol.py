"""The peer protocol, sans-IO: frames, message schemas and the authentication handshake as pure
functions over bytes, tested without sockets; `replication.channel` adapts them to trio streams.

A frame is `u32 header length | u32 payload length | msgpack header | raw payload`. The header is
a map with a `type` and that type's fields, each checked against a schema; the payload carries
file bytes only, never anything decoded. Lengths are capped before anything is buffered, paths
must be safe relative paths, and anything else (an unknown type, a missing or mistyped field, a
malformed header) is a ProtocolError, on which the connection is dropped.

Authentication comes first, both ways, over fresh nonces: each side sends HELLO (its node id and
a random nonce) and answers the other's HELLO with PROOF = HMAC-SHA256(token, context, the
other's nonce, both node ids). A replayed PROOF fails because the nonce it answers is new.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from tierfs.manifest import ManifestError, check_relative_path

PREFIX = struct.Struct(">II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 16 << 20
NONCE_BYTES = 32
PROOF_CONTEXT = b"tierfs-peer-v1"

# type -> {field: python type}; every field is required, no other field is allowed.
SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "HELLO": {"node_id": str, "nonce": bytes},
    "PROOF": {"mac": bytes},
    "PING": {"node_id": str},
    "PONG": {"node_id": str},
    "PUT": {"path": str, "name": str, "xxh3": str, "size": int, "offset": int},
    # hold these files of the step's committed version (their objects were PUT): answered by
    # HELD with the names now held, verified, or ERROR
    "HOLD": {"path": str, "version": int, "names": list},
    "HELD": {"names": list},
    "GET": {"path": str, "name": str, "xxh3": str, "offset": int, "length": int},
    "VERIFY": {"path": str, "name": str, "xxh3": str, "repair": bool},  # check your copy
    "VERIFIED": {"state": str},             # good, bad, missing or repaired
    "DELETE": {"path": str, "version": int, "committed_ns": int},  # a step was deleted
    "DATA": {},
    "OK": {},
    "ERROR": {"message": str},
}
PATH_FIELDS = ("path", "name")
NAME_LISTS = ("names",)  # lists of paths inside a step, each checked as a path field
MAX_NAMES = 1000  # names per HOLD or HELD: with paths of at most 4 KiB, under MAX_HEADER

PAYLOAD_TYPES = {"PUT", "DATA"}


class ProtocolError(Exception):
    """The peer sent something malformed, oversized or unexpected."""


@dataclass(frozen=True)
class Message:
    type: str
    fields: dict[str, Any]
    payload: bytes = b""

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


def encode(kind: str, payload: bytes = b"", **fields: Any) -> list[bytes]:
    """The buffers of one frame (header and payload kept apart: no copy of the payload)."""
    message = Message(kind, fields, payload)
    validate(message)
    header = msgpack.packb({"type": kind, **fields}, use_bin_type=True)
    return [PREFIX.pack(len(header), len(payload)), header, payload]


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
    if message.payload and message.type not in PAYLOAD_TYPES:
        raise ProtocolError(f"{message.type} carries no payload")
    if message.type == "HELLO" and len(message.fields["nonce"]) != NONCE_BYTES:
        raise ProtocolError("HELLO nonce has the wrong length")
    if message.type == "GET" and message.fields["length"] > MAX_PAYLOAD:
        raise ProtocolError("GET asks for too much at once")
    return message


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
    """Bytes in, validated messages out; buffers at most one frame."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= PREFIX.size:
            header_len, payload_len = PREFIX.unpack_from(self._buffer)
            if header_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
                raise ProtocolError(f"frame too large ({header_len}+{payload_len} bytes)")

    def next_message(self) -> Message | None:
        if len(self._buffer) < PREFIX.size:
            return None
        header_len, payload_len = PREFIX.unpack_from(self._buffer)
        end = PREFIX.size + header_len + payload_len
        if len(self._buffer) < end:
            return None
        raw_header = bytes(self._buffer[PREFIX.size:PREFIX.size + header_len])
        payload = bytes(self._buffer[PREFIX.size + header_len:end])
        del self._buffer[:end]
        try:
            header = msgpack.unpackb(raw_header, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise ProtocolError(f"malformed header: {exc}") from None
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            raise ProtocolError("header is not a typed map")
        kind = header.pop("type")
        return validate(Message(kind, header, payload))

    def wanted(self) -> int:
        """How many more bytes complete the frame being read (at least 1)."""
        if len(self._buffer) < PREFIX.size:
            return PREFIX.size - len(self._buffer)
        header_len, payload_len = PREFIX.unpack_from(self._buffer)
        return max(1, PREFIX.size + header_len + payload_len - len(self._buffer))


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(token: bytes, their_nonce: bytes, prover: str, verifier: str) -> bytes:
    """What `prover` sends to show `verifier` it knows the token, for `verifier`'s nonce."""
    message = b"|".join([PROOF_CONTEXT, their_nonce, prover.encode(), verifier.encode()])
    return hmac.new(token, message, hashlib.sha256).digest()


def check_proof(token: bytes, my_nonce: bytes, prover: str, verifier: str, mac: bytes) -> bool:
    return hmac.compare_digest(proof(token, my_nonce, prover, verifier), mac)
