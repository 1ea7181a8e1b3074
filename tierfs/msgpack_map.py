"""Decoding a msgpack map that came from outside this process (a manifest, a pack index, a
pending record, a directory's links, a peer's message header), in one place: bytes msgpack
refuses, and anything but a map of the expected kind, become the caller's own error, never one
of the several unrelated types msgpack raises. The caller then validates the map's fields."""

from __future__ import annotations

from typing import Any

import msgpack


def decode_map(data: bytes, error: type[Exception], what: str, *, key: str = "format",
               kind: object = None, **limits: int) -> dict[str, Any]:
    """`data` as a msgpack map whose `key` is `kind` (with `kind` None: any str), strings
    decoded and map keys str or bytes only; `limits`: msgpack's (max_array_len...). Raises
    `error` "not a <what>: ..." for bytes that do not decode, "unknown <what> format" else."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, **limits)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise error(f"not a {what}: {exc}") from None
    if not isinstance(raw, dict) or (
            not isinstance(raw.get(key), str) if kind is None else raw.get(key) != kind):
        raise error(f"unknown {what} format")
    return raw
