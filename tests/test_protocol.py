"""The peer protocol without sockets: framing, schemas, limits and the handshake, plus
property-based fuzzing of the decoder with random, truncated and oversized input."""

from __future__ import annotations

import contextlib
import os
import struct

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.channel import AuthError, PeerChannel, authenticate

pytestmark = pytest.mark.core

TOKEN = b"s3cret-token-for-tests"


def frame(kind: str, payload: bytes = b"", **fields: object) -> bytes:
    return b"".join(proto.encode(kind, payload, **fields))


def decode_all(data: bytes) -> list[proto.Message]:
    decoder = proto.FrameDecoder()
    decoder.feed(data)
    messages = []
    while (message := decoder.next_message()) is not None:
        messages.append(message)
    return messages


def test_roundtrip_and_byte_by_byte_feeding() -> None:
    data = (frame("PING", node_id="a")
            + frame("PUT", b"\x00" * 1000, path="run/step_1", name="__0_0.distcp",
                    xxh3="a" * 32, size=1000, offset=0)
            + frame("GET", path="run/step_1", name="x", xxh3="b" * 32, offset=5, length=7))
    whole = decode_all(data)
    assert [m.type for m in whole] == ["PING", "PUT", "GET"]
    assert whole[1].payload == b"\x00" * 1000 and whole[1]["offset"] == 0
    decoder = proto.FrameDecoder()
    seen = []
    for i in range(len(data)):
        decoder.feed(data[i:i + 1])
        while (message := decoder.next_message()) is not None:
            seen.append(message)
    assert seen == whole


def test_a_payload_goes_into_the_buffer_offered_if_it_fits() -> None:
    """A fetched chunk is received straight into the fetcher's (pooled) buffer; one larger
    than it goes to the decoder's own buffer, so the offer never truncates a payload."""
    put = dict(path="run/step_1", name="x", xxh3="a" * 32, size=100, offset=0)
    decoder = proto.FrameDecoder()
    mine = bytearray(10)
    decoder.offer(memoryview(mine))
    decoder.feed(frame("PUT", b"0123456789", **put))
    message = decoder.next_message()
    assert message is not None and message.payload == b"0123456789"
    assert mine == b"0123456789" and message.payload.obj is mine  # type: ignore[union-attr]
    decoder.offer(memoryview(mine))
    decoder.feed(frame("PUT", b"x" * 11, **put))
    message = decoder.next_message()
    assert message is not None and message.payload == b"x" * 11 and mine == b"0123456789"


@pytest.mark.parametrize("kind, fields, payload", [
    ("NOPE", {}, b""),
    ("PING", {}, b""),                                       # missing field
    ("PING", {"node_id": "a", "extra": 1}, b""),             # unexpected field
    ("PING", {"node_id": 5}, b""),                           # wrong type
    ("PING", {"node_id": "a"}, b"payload"),                  # payload where none belongs
    ("GET", {"path": "../etc", "name": "passwd", "xxh3": "a", "offset": 0, "length": 1}, b""),
    ("GET", {"path": "/abs", "name": "x", "xxh3": "a", "offset": 0, "length": 1}, b""),
    ("GET", {"path": "a", "name": "x\0y", "xxh3": "a", "offset": 0, "length": 1}, b""),
    ("GET", {"path": "a", "name": "x", "xxh3": "a", "offset": -1, "length": 1}, b""),
    ("GET", {"path": "a", "name": "x", "xxh3": "a", "offset": 0, "length": 1 << 30}, b""),
    ("HELLO", {"node_id": "a", "nonce": b"short"}, b""),
    ("GET_FILES", {"path": "a", "names": ["x", "y"], "digests": ["0" * 32]}, b""),  # unpaired
    ("GET_FILES", {"path": "a", "names": ["x"], "digests": ["0" * 31 + "G"]}, b""),
    ("GET_FILES", {"path": "a", "names": ["../x"], "digests": ["0" * 32]}, b""),
    ("GET_FILES", {"path": "a", "names": ["x"] * 1001, "digests": ["0" * 32] * 1001}, b""),
    ("FILES_DATA", {"names": ["x"], "sizes": [-1]}, b""),
    ("FILES_DATA", {"names": ["x"], "sizes": [True]}, b"x"),
    ("FILES_DATA", {"names": ["x"], "sizes": []}, b"x"),
    ("PUT_FILES", {"path": "a", "names": ["x", "y"], "digests": ["0" * 32] * 2,
                   "sizes": [1]}, b"xy"),                    # a size for each name
    ("PUT_FILES", {"path": "a", "names": ["x"], "digests": ["0" * 32], "sizes": [-1]}, b""),
    ("PUT_FILES", {"path": "a", "names": ["x"], "digests": ["x" * 32], "sizes": [1]}, b"x"),
    ("PUT_FILES", {"path": "a", "names": ["/x"], "digests": ["0" * 32], "sizes": [1]}, b"x"),
])
def test_bad_messages_are_protocol_errors(kind: str, fields: dict, payload: bytes) -> None:  # type: ignore[type-arg]
    header = msgpack.packb({"type": kind, **fields}, use_bin_type=True)
    with pytest.raises(proto.ProtocolError):
        decode_all(proto.PREFIX.pack(len(header), len(payload)) + header + payload)


def test_many_files_asked_and_sent_in_one_frame_each() -> None:
    """GET_FILES names files with their digests, FILES_DATA sends their bytes one after the
    other with their names and sizes."""
    ask = {"path": "run/step_1", "names": ["a/x", "y"], "digests": ["0" * 32, "f" * 32]}
    answer = {"names": ["y"], "sizes": [3]}
    messages = decode_all(frame("GET_FILES", **ask) + frame("FILES_DATA", b"abc", **answer))
    assert [(m.type, m.fields, bytes(m.payload)) for m in messages] == [
        ("GET_FILES", ask, b""), ("FILES_DATA", answer, b"abc")]


def test_oversized_frames_are_refused_before_buffering() -> None:
    decoder = proto.FrameDecoder()
    with pytest.raises(proto.ProtocolError, match="too large"):
        decoder.feed(struct.pack(">II", 10, proto.MAX_PAYLOAD + 1))
    with pytest.raises(proto.ProtocolError, match="too large"):
        proto.FrameDecoder().feed(struct.pack(">II", proto.MAX_HEADER + 1, 0))
    handshake = proto.FrameDecoder(proto.HANDSHAKE_LIMITS)
    with pytest.raises(proto.ProtocolError, match="too large before authentication"):
        handshake.feed(struct.pack(">II", 90, proto.MAX_PAYLOAD))
    with pytest.raises(proto.ProtocolError, match="too large before authentication"):
        proto.FrameDecoder(proto.HANDSHAKE_LIMITS).feed(struct.pack(">II", 5000, 0))


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    with contextlib.suppress(proto.ProtocolError):
        decode_all(data)


@settings(max_examples=1000, deadline=None)
@given(st.integers(0, 200), st.binary(max_size=64))
def test_fuzz_truncated_and_corrupted_frames(cut: int, noise: bytes) -> None:
    good = frame("PUT", b"x" * 100, path="run/step_1", name="f", xxh3="c" * 32, size=100,
                 offset=0)
    for data in (good[:cut], good[:cut] + noise, noise + good):
        with contextlib.suppress(proto.ProtocolError):
            decode_all(data)


async def handshake(token_a: bytes, token_b: bytes, members: set[str]) -> list[object]:
    left, right = trio.testing.memory_stream_pair()
    results: list[object] = [None, None]

    async def side(index: int, stream, token: bytes, me: str) -> None:  # type: ignore[no-untyped-def]
        try:
            results[index] = await authenticate(PeerChannel(stream, timeout=5), token, me,
                                                 members)
        except proto.ProtocolError as exc:
            results[index] = exc
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, 0, left, token_a, "node0")
        nursery.start_soon(side, 1, right, token_b, "node1")
    return results


async def test_handshake_with_the_same_token() -> None:
    assert await handshake(TOKEN, TOKEN, {"node0", "node1"}) == ["node1", "node0"]


async def test_handshake_with_a_wrong_token_fails_on_both_sides() -> None:
    results = await handshake(TOKEN, b"wrong", {"node0", "node1"})
    assert all(isinstance(r, proto.ProtocolError) for r in results)
    assert any(isinstance(r, AuthError) for r in results)


async def test_handshake_with_a_stranger_fails() -> None:
    results = await handshake(TOKEN, TOKEN, {"node0"})  # node1 is not a member
    assert isinstance(results[0], AuthError)


def test_a_proof_is_bound_to_nonce_and_names() -> None:
    nonce = proto.new_nonce()
    mac = proto.proof(TOKEN, nonce, "node1", "node0")
    assert proto.check_proof(TOKEN, nonce, "node1", "node0", mac)
    assert not proto.check_proof(TOKEN, proto.new_nonce(), "node1", "node0", mac)  # replayed
    assert not proto.check_proof(TOKEN, nonce, "node2", "node0", mac)


async def test_a_channel_takes_big_frames_only_once_authenticated() -> None:
    """Before the handshake a frame announcing a 16 MiB payload is refused at its prefix (not
    waited for, not buffered); after it, the same frame goes through."""
    put = {"path": "run/step_1", "name": "f", "xxh3": "c" * 32, "size": 1 << 20, "offset": 0}
    left, right = trio.testing.memory_stream_pair()
    stranger = PeerChannel(right, timeout=2)
    await left.send_all(proto.encode_header("PUT", proto.MAX_PAYLOAD, **put))  # no body
    with pytest.raises(proto.ProtocolError, match="too large before authentication"):
        await stranger.receive()

    left, right = trio.testing.memory_stream_pair()
    sender, receiver = PeerChannel(left, timeout=5), PeerChannel(right, timeout=5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(authenticate, sender, TOKEN, "node0", {"node0", "node1"})
        nursery.start_soon(authenticate, receiver, TOKEN, "node1", {"node0", "node1"})
    payload = bytes(range(256)) * 4096
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: sender.send("PUT", payload, **put))
        message = await receiver.receive("PUT")
    assert bytes(message.payload) == payload


def sealed(mac: proto.FrameMac, kind: str, payload: bytes = b"", **fields: object) -> bytes:
    """A frame with its MAC, as an authenticated channel sends it."""
    header, body = proto.encode(kind, payload, **fields)
    return header + body + mac.tag(header, body)


def receiving(key: bytes) -> proto.FrameDecoder:
    decoder = proto.FrameDecoder()
    decoder.mac = proto.FrameMac(key)
    return decoder


PUT = {"path": "run/step_1", "name": "f", "xxh3": "c" * 32, "size": 100, "offset": 0}


def test_every_frame_after_the_handshake_needs_its_mac_in_sequence() -> None:
    """Frames tagged in order are accepted; a frame without a tag, with a wrong one, replayed,
    reordered, altered, or tagged for the other direction is a ProtocolError."""
    key = proto.frame_key(TOKEN, "node0", "node1", proto.new_nonce(), proto.new_nonce())
    sender = proto.FrameMac(key)
    first, second = sealed(sender, "PING", node_id="node0"), sealed(sender, "PUT", b"x" * 100,
                                                                    **PUT)
    decoder = receiving(key)
    decoder.feed(first + second)
    assert [decoder.next_message().type, decoder.next_message().type] == ["PING", "PUT"]  # type: ignore[union-attr]

    def refused(data: bytes) -> None:
        with pytest.raises(proto.ProtocolError, match="MAC"):
            decode_with(receiving(key), data)

    refused(second + first)                                         # reordered
    refused(first + first)                                          # replayed
    refused(frame("PING", node_id="node0") + b"\0" * proto.TAG_BYTES)  # injected
    altered = bytearray(second)
    altered[-proto.tag_length(100) - 1] ^= 1                         # one payload bit
    refused(first + bytes(altered))
    back = proto.frame_key(TOKEN, "node1", "node0", proto.new_nonce(), proto.new_nonce())
    refused(sealed(proto.FrameMac(back), "PING", node_id="node0"))  # the other key


def test_a_large_payload_is_tagged_slice_by_slice_each_in_its_place() -> None:
    """A payload of several TAG_SLICEs carries a tag per slice, each bound to its frame and
    its place in it: the frame as sent is accepted, also fed in odd pieces (the receiver tags
    each slice once it is whole); two slices swapped, or one slice's bytes altered with every
    tag kept, are refused."""
    key = proto.frame_key(TOKEN, "node0", "node1", proto.new_nonce(), proto.new_nonce())
    payload = os.urandom(2 * proto.TAG_SLICE + 12345)
    put = {**PUT, "size": len(payload)}
    good = sealed(proto.FrameMac(key), "PUT", payload, **put)
    assert len(good) - len(frame("PUT", payload, **put)) == proto.tag_length(len(payload)) \
        == 4 * proto.TAG_BYTES
    decoder = receiving(key)
    for start in range(0, len(good), 999_983):
        decoder.feed(good[start:start + 999_983])
    message = decoder.next_message()
    assert message is not None and bytes(message.payload) == payload

    def refused(data: bytes) -> None:
        with pytest.raises(proto.ProtocolError, match="MAC"):
            decode_with(receiving(key), data)

    at = len(good) - proto.tag_length(len(payload)) - len(payload)  # the payload's start
    first, second = slice(at, at + proto.TAG_SLICE), slice(at + proto.TAG_SLICE,
                                                            at + 2 * proto.TAG_SLICE)
    swapped = bytearray(good)
    swapped[first], swapped[second] = good[second], good[first]
    refused(bytes(swapped))
    altered = bytearray(good)
    altered[at + proto.TAG_SLICE + 7] ^= 0x40
    refused(bytes(altered))


def decode_with(decoder: proto.FrameDecoder, data: bytes) -> list[proto.Message]:
    decoder.feed(data)
    messages = []
    while (message := decoder.next_message()) is not None:
        messages.append(message)
    return messages


async def test_a_frame_injected_into_an_authenticated_channel_is_refused() -> None:
    """An attacker who can write into an established connection (but knows neither token nor
    nonces' keys) gets its frame refused; the genuine frames before it went through."""
    left, right = trio.testing.memory_stream_pair()
    sender, receiver = PeerChannel(left, timeout=5), PeerChannel(right, timeout=5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(authenticate, sender, TOKEN, "node0", {"node0", "node1"})
        nursery.start_soon(authenticate, receiver, TOKEN, "node1", {"node0", "node1"})
    payload = os.urandom(1 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: sender.send("PUT", payload, **PUT))
        message = await receiver.receive("PUT")
    assert bytes(message.payload) == payload
    await left.send_all(frame("PUT", b"evil", **PUT) + b"\0" * proto.tag_length(4))
    with pytest.raises(proto.ProtocolError, match="MAC"):
        await receiver.receive()


def test_files_one_after_the_other_are_cut_at_their_sizes() -> None:
    """FILES_DATA and PUT_FILES carry files one after the other: cut at the sizes the header
    names, which must add up to the payload."""
    message = proto.Message("PUT_FILES", {"sizes": [2, 0, 3]})
    assert [bytes(f) for f in proto.cut_files(message, b"abcde")] == [b"ab", b"", b"cde"]
    with pytest.raises(proto.ProtocolError, match="PUT_FILES of 4 bytes names 5"):
        proto.cut_files(message, b"abcd")
