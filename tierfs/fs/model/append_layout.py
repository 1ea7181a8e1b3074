"""How the persistent tier holds an appended loose file, decided at each of its commits (the
pure part of `tierfs.fs.lifecycle.appends`, which the tree and the uploader use): whether a version
extends the one before it, and the segments it is stored in (`FileEntry.segments`).

A version that extends the one before it keeps that one's objects and adds one segment object
with the new bytes (`layout.segment_key`), so only the appended bytes travel. Once the segments
together hold as much as the base, or there are MAX_SEGMENTS of them, the next version is one
whole object again, so that bytes sent per byte appended stay bounded and a read needs few
requests. Whether a version extends another is decided from the chunk hashes both entries
carry, plus a hash of the new bytes of the older file's last partial chunk (at most CHUNK_SIZE
read): no whole file is read again.
"""

from __future__ import annotations

import dataclasses
import os
import re

import xxhash

from tierfs import manifest as mf
from tierfs.step_names import CHECKPOINT_EXTENSIONS
from tierfs.trackers import is_tracker_name

MAX_SEGMENTS = 256  # then the next version is one whole object again
_CHECKPOINT = re.compile(CHECKPOINT_EXTENSIONS)


def extends(old: mf.FileEntry, new: mf.FileEntry, new_bytes: bytes | str) -> bool:
    """Whether the file `new` (its bytes at `new_bytes`) starts with exactly the bytes of `old`
    (blocking: reads at most one chunk)."""
    if not 0 < old.size <= new.size:
        return False
    whole, tail = divmod(old.size, mf.CHUNK_SIZE)
    if old.chunks[:whole] != new.chunks[:whole]:
        return False
    if not tail:
        return True
    with open(new_bytes, "rb") as f:
        f.seek(whole * mf.CHUNK_SIZE)
        piece = f.read(tail)
    return len(piece) == tail and xxhash.xxh3_64_hexdigest(piece) == old.chunks[whole]


def appended_to(path: bytes | str, entry: mf.FileEntry) -> bool:
    """Whether the file at `path` holds `entry`'s bytes and more after them (blocking: reads
    the entry's bytes once). At start-up: a loose file appended after its last commit keeps
    what was appended, instead of being put back as that commit."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size <= entry.size:
                return False
            hasher = xxhash.xxh3_128()
            left = entry.size
            while left and (piece := f.read(min(left, mf.CHUNK_SIZE))):
                hasher.update(piece)
                left -= len(piece)
    except FileNotFoundError:
        return False
    return not left and hasher.hexdigest() == entry.xxh3


def lay_out(old: mf.StepManifest | None, path: str, entry: mf.FileEntry,
            new_bytes: bytes | str) -> mf.FileEntry:
    """`entry`, the new version of the loose file at `path`, with the segments it is stored
    in (see the module docstring; blocking, reads at most one chunk)."""
    before = old.files[0] if old is not None and old.path == path and old.files else None
    if before is None:
        return entry
    if before.size == entry.size and before.xxh3 == entry.xxh3:
        return dataclasses.replace(entry, segments=before.segments)  # attributes only
    if not extends(before, entry, new_bytes):
        return entry  # rewritten, not appended: one whole object
    segments = (*before.segments, before.size)
    base = segments[0]
    if entry.size - base >= base or len(segments) > MAX_SEGMENTS:
        return entry
    return dataclasses.replace(entry, segments=segments)


def never_snapshot(name: bytes) -> bool:
    """A file whose copy while it is written would be a partial checkpoint or tracker."""
    text = os.fsdecode(name)
    return bool(_CHECKPOINT.search(text)) or is_tracker_name(text)
