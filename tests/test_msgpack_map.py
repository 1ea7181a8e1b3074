"""The one decoder of msgpack maps from outside (tierfs.msgpack_map): whatever the bytes, the
caller gets its own error or a map of the kind it asked for."""

from __future__ import annotations

import msgpack
import pytest

from tierfs.msgpack_map import decode_map

pytestmark = pytest.mark.core


class Bad(Exception):
    pass


def test_a_map_of_the_kind_asked_for_is_returned() -> None:
    data = msgpack.packb({"format": 2, "files": [1, 2]})
    assert decode_map(data, Bad, "thing", kind=2) == {"format": 2, "files": [1, 2]}
    assert decode_map(msgpack.packb({"type": "PUT"}), Bad, "header", key="type")["type"] == "PUT"


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", msgpack.packb({1: 2}),
                                  msgpack.packb([1] * 10)])
def test_bytes_that_do_not_decode_are_the_callers_error(data: bytes) -> None:
    with pytest.raises(Bad, match="thing"):
        decode_map(data, Bad, "thing", kind=1, max_array_len=5)


@pytest.mark.parametrize("value", [[1], {"format": 3}, {"other": 1}, {"format": "1"}])
def test_anything_but_a_map_of_that_kind_is_refused(value: object) -> None:
    with pytest.raises(Bad, match="unknown thing format"):
        decode_map(msgpack.packb(value), Bad, "thing", kind=1)
    with pytest.raises(Bad, match="unknown thing format"):
        decode_map(msgpack.packb({"type": 1}), Bad, "thing", key="type")
