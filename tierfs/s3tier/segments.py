"""A loose file stored as a base and segments (`FileEntry.segments`, decided by
`tierfs.fs.lifecycle.appends`): sending only the pieces the store lacks, reading a range across
pieces.

The store holds the file's object (its base: the bytes before the first segment) and one
object per segment, `layout.segment_key`, in its records directory. The uploader keeps one
rule for a crash at any point: while a manifest is in the store, the file's object followed by
the segment objects present, in key order, cut at the manifest's size, are exactly that
version's bytes. So a version that extends the stored one adds segments after the stored size
and then replaces the manifest; any other version removes the manifest first, as every upload
does, and removes the segment objects it does not name before its manifest goes up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import trio

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model.append_layout import extends
from tierfs.retry import POLICY, RetryPolicy
from tierfs.s3tier.interface import Backend
from tierfs.s3tier.sending import Call, send_range


def stored_start(stored: mf.FileEntry | None, entry: mf.FileEntry, new_bytes: str) -> int:
    """Where the pieces the store lacks start: the stored version's size if the store's
    objects hold the start of `entry` as `entry` names them (its size is one of `entry`'s
    segment offsets, its segments are `entry`'s below it, and its bytes are `entry`'s first
    bytes), else 0: everything goes (blocking: reads at most one chunk)."""
    if (stored is None or stored.size not in entry.segments
            or stored.segments != tuple(s for s in entry.segments if s < stored.size)):
        return 0
    return stored.size if extends(stored, entry, new_bytes) else 0


async def send_pieces(backend: Backend, file_key: str, entry: mf.FileEntry, path: str,
                      start: int, call: Call, limiter: trio.CapacityLimiter, *,
                      policy: RetryPolicy = POLICY,
                      still_wanted: Callable[[], bool] = lambda: True) -> int:
    """Send the pieces of `entry` (bytes at `path`) from offset `start` on, in parallel;
    returns the bytes sent."""
    pieces = [(key, offset, length) for key, (offset, length)
              in zip(layout.piece_keys(file_key, entry.segments), entry.pieces(), strict=True)
              if offset >= start]
    async with trio.open_nursery() as nursery:
        for key, offset, length in pieces:
            nursery.start_soon(partial(send_range, backend, key, path, offset, length, call,
                                       limiter, policy=policy, still_wanted=still_wanted))
    return sum(length for _key, _offset, length in pieces)


def stale_segments(backend: Backend, file_key: str, entry: mf.FileEntry) -> list[str]:
    """The segment objects of the file at `file_key` that `entry` does not name (blocking)."""
    named = set(layout.piece_keys(file_key, entry.segments)[1:])
    prefix = f"{layout.records_dir(file_key, True)}/{layout.SEGMENT_PREFIX}"
    return [o.key for o in backend.list(prefix) if o.key not in named]


async def read_pieces(get_range: Callable[[str, int, int], Awaitable[bytes]], file_key: str,
                      entry: mf.FileEntry, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of a file stored in segments, each piece read with
    `get_range(key, offset in the piece, length)`."""
    end = min(offset + length, entry.size)
    parts = []
    for key, (start, size) in zip(layout.piece_keys(file_key, entry.segments),
                                  entry.pieces(), strict=True):
        low, high = max(offset, start), min(end, start + size)
        if low < high:
            parts.append(await get_range(key, low - start, high - low))
    return b"".join(parts)
