"""The shared data model of tierfs: sealed files, step manifests, hashing and their codec.

A step manifest is the unit of commit: it names every file of a step directory with its size and
xxh3-128, and carries a version that only grows plus the id of the node that made the commit.
Every tier stores the same msgpack encoding. Decoding validates everything, because manifests
come from disks and, later, from the network and S3: a malformed one raises ManifestError.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Callable, Iterable, KeysView
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgpack
import xxhash

from tierfs import reserved
from tierfs.msgpack_map import decode_map

FORMAT_VERSION = 1
MANIFEST_NAME = reserved.MANIFEST
RESERVED_PREFIX = reserved.PREFIX  # tierfs's own names: never a user's file, in any tier
# Files are also hashed per chunk (xxh3-64) so that a range fetched from another tier can be
# checked before it is returned, long before the whole file's xxh3-128 can be.
CHUNK_SIZE = 8 << 20
# And per block (xxh3-64 of each BLOCK_SIZE piece, 8 raw bytes each, in the manifest's
# "blocks"): a read of a few bytes of a file in another tier fetches and checks the blocks it
# touches, not whole chunks. Manifests written before blocks existed have none: their ranges
# are fetched and checked by chunk.
BLOCK_SIZE = 1 << 20
BLOCK_DIGEST_SIZE = 8
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")
_MAX_FILES = 1_000_000
_MAX_DIRS = 1_000_000
NO_OWNER = -1  # an entry from before owners were recorded
NO_STEP = -1  # the step number of a loose file's manifest (its name carries none)
_MAX_ID = (1 << 32) - 1


class ManifestError(ValueError):
    """A manifest that cannot be decoded or does not hold together."""


@dataclass(frozen=True)
class FileEntry:
    """One sealed file of a step: `name` is relative to the step directory, '/'-separated;
    `chunks` holds the xxh3-64 of each CHUNK_SIZE piece, `blocks` (empty in entries from
    older manifests) the raw xxh3-64 of each BLOCK_SIZE piece, one after the other. Mode,
    mtime and owner are those of the file at commit, restored wherever the file is made again;
    `uid`/`gid` are NO_OWNER in manifests written before owners were recorded. `segments`:
    how the persistent tier holds an appended loose file (`tierfs.fs.lifecycle.appends`): empty, one
    object of the whole file; else
    the offsets where each appended segment starts, the file's object holding the bytes
    before the first one (its base) and each segment object those up to the next offset or
    the end (`layout.segment_key`)."""

    name: str
    size: int
    xxh3: str
    mtime_ns: int = 0
    mode: int = 0o644
    chunks: tuple[str, ...] = ()
    uid: int = NO_OWNER
    gid: int = NO_OWNER
    segments: tuple[int, ...] = ()
    # Derived from the bytes like `chunks`: two entries of the same file are equal with or
    # without them (an entry read from an older manifest has none).
    blocks: bytes = field(default=b"", compare=False, repr=False)

    @cached_property
    def encoded(self) -> bytes:
        """Its fields in msgpack, as a manifest holds them (`encode`): made once per entry, so
        that a settled file's is ready before its step's commit (`fs.model.nodes.Seal`)."""
        return msgpack.packb(entry_fields(self), use_bin_type=True)

    def pieces(self) -> list[tuple[int, int]]:
        """(offset, length) of each stored object of the file, in order: its base, then each
        segment (just the whole file when it has no segments)."""
        bounds = [0, *self.segments, self.size]
        return [(start, end - start) for start, end in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class DirEntry:
    """A directory's own attributes as they were at a commit (`path` relative to the mount,
    '/'-separated): given back to the directories a node makes for a step it did not write
    (`tierfs.fs.tree.dir_attributes`)."""

    path: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int


@dataclass(frozen=True)
class StepManifest:
    """The committed content of one step at one version: a step directory, or a single file
    (`single_file`: a file step or a loose file, `files` holds that one file, named as it is
    in its directory; `step` is NO_STEP for a loose file, one whose name carries no number)."""

    path: str
    step: int
    version: int
    node_id: str
    committed_ns: int
    files: tuple[FileEntry, ...] = field(default_factory=tuple)
    single_file: bool = False
    # The directories above the step's files as they were at the commit (those from the top
    # of the mount down to the step, and those inside a step directory): what a node that
    # makes them again gives them. Not part of what the version is (a run directory's mtime
    # moves at every step made in it); empty in manifests from before they were recorded.
    dirs: tuple[DirEntry, ...] = field(default=(), compare=False)
    # Committed by the quiet rules (idle, the next step made, an unmount), not by its saver's
    # mark or call (`.metadata`, a rename into place, a tracker, `tierfs commit`): whether its
    # saver finished is for `tierfs.fs.model.completion` to judge.
    by_idle: bool = field(default=False, compare=False)

    # A manifest never changes, so its totals and its index by name are computed once: steps
    # of 50,000 files are looked up file by file (status, eviction, start-up), which a linear
    # search would make quadratic.
    @cached_property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @cached_property
    def _by_name(self) -> dict[str, FileEntry]:
        return {f.name: f for f in self.files}

    def entry(self, name: str) -> FileEntry | None:
        return self._by_name.get(name)

    @property
    def names(self) -> KeysView[str]:
        """The files' names, as a set view."""
        return self._by_name.keys()

    def same_entries(self, entries: Iterable[FileEntry]) -> bool:
        """Whether `entries` are this version's files with the same bytes and the same mode,
        owner and mtime (a change of attributes alone is a new version too)."""
        key = lambda files: sorted((f.name, f.size, f.xxh3, f.mode, f.uid, f.gid,  # noqa: E731
                                    f.mtime_ns) for f in files)
        return key(self.files) == key(entries)

    def same_own_dirs(self, dirs: Iterable[DirEntry]) -> bool:
        """Whether `dirs` give the step's own directories (the step directory and those in it,
        not those above it) the attributes this version records for them."""
        def own(entries: Iterable[DirEntry]) -> list[DirEntry]:
            prefix = self.path + "/"
            return sorted((d for d in entries if d.path == self.path
                           or d.path.startswith(prefix)), key=lambda d: d.path)

        return self.single_file or own(self.dirs) == own(dirs)

    def same_content(self, other: StepManifest) -> bool:
        key = lambda m: sorted((f.name, f.size, f.xxh3) for f in m.files)  # noqa: E731
        return key(self) == key(other)

    @cached_property
    def content_digest(self) -> str:
        return content_digest(self.files)


def content_digest(files: Iterable[FileEntry]) -> str:
    """xxh3-128 (hex) over the sorted (name, size, xxh3) of `files`: what a step's content
    is, whatever the order of its entries or their mode and mtime. Each field ends with a
    NUL, which no name (check_relative_path), size or hex digest holds."""
    hasher = xxhash.xxh3_128()
    for name, size, xxh3 in sorted((f.name, f.size, f.xxh3) for f in files):
        hasher.update(f"{name}\0{size}\0{xxh3}\0".encode())
    return hasher.hexdigest()


def check_relative_path(name: str) -> str:
    """Return `name` if it is a safe relative path ('a/b'), else raise ManifestError."""
    if not name or "\0" in name or name.startswith("/"):
        raise ManifestError(f"unsafe path {name!r}")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ManifestError(f"unsafe path {name!r}")
    if any(part.startswith(RESERVED_PREFIX) for part in name.split("/")):
        raise ManifestError(f"reserved name in {name!r}")
    return name


def entry_from_stat(name: str, digest: Digest, st: os.stat_result) -> FileEntry:
    """The entry of a sealed file as it is now: its digest, and its mode, mtime and owner."""
    return FileEntry(name, digest.size, digest.xxh3, st.st_mtime_ns, st.st_mode & 0o7777,
                     digest.chunks, st.st_uid, st.st_gid, blocks=digest.blocks)


def entry_fields(entry: FileEntry) -> list[object]:
    fields: list[object] = [entry.name, entry.size, entry.xxh3, entry.mtime_ns, entry.mode,
                            list(entry.chunks), entry.uid, entry.gid]
    if entry.segments:  # only for a file stored in segments: other entries are as they were
        fields.append(list(entry.segments))
    return fields


def entry_from_fields(fields: object) -> FileEntry:
    """A FileEntry from its msgpack form, validated (ManifestError if malformed). Entries of
    six fields come from manifests written before owners were recorded."""
    if isinstance(fields, list) and len(fields) == 6:
        fields = [*fields, NO_OWNER, NO_OWNER]
    if isinstance(fields, list) and len(fields) == 8:
        fields = [*fields, []]
    try:
        (name, size, digest, mtime_ns, mode, chunks, uid, gid,  # type: ignore[misc]
         segments) = fields
    except (TypeError, ValueError):
        raise ManifestError("malformed file entry") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (mtime_ns, mode, uid,
                                                                        gid)):
        raise ManifestError(f"bad attributes for {name!r}")
    if not (0 <= mode <= 0o7777 and NO_OWNER <= uid <= _MAX_ID and NO_OWNER <= gid <= _MAX_ID):
        raise ManifestError(f"bad mode or owner for {name!r}")
    if not (isinstance(size, int) and size >= 0 and isinstance(digest, str)
            and isinstance(name, str)):
        raise ManifestError(f"bad file entry {name!r}")
    if not _HEX128.match(digest):
        raise ManifestError(f"bad xxh3 for {name!r}")
    if (not isinstance(chunks, list) or len(chunks) != chunk_count(size)
            or not all(isinstance(c, str) and _HEX64.match(c) for c in chunks)):
        raise ManifestError(f"bad chunk hashes for {name!r}")
    bounds = [0, *segments, size] if isinstance(segments, list) and segments else []
    if (not isinstance(segments, list)
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in segments)
            or any(a >= b for a, b in itertools.pairwise(bounds))):
        raise ManifestError(f"bad segments for {name!r}")
    return FileEntry(check_relative_path(name), size, digest, mtime_ns, mode, tuple(chunks),
                     uid, gid, tuple(segments))


def encode(manifest: StepManifest) -> bytes:
    """The manifest's msgpack: a map of its fields, "files" the list of its entries' fields,
    "blocks" beside them (a reader that predates blocks ignores the key), and "file" only in
    single-file manifests (those of step directories are as they always were). The entries
    come already packed (`FileEntry.encoded`): a 10,000-file commit packs none of them."""
    files = manifest.files
    packer = msgpack.Packer(use_bin_type=True)
    head = {"format": FORMAT_VERSION, "path": manifest.path, "step": manifest.step,
            "version": manifest.version, "node_id": manifest.node_id,
            "committed_ns": manifest.committed_ns}
    tail: dict[str, object] = {}
    if any(f.blocks for f in files):
        tail["blocks"] = [f.blocks for f in files]
    if manifest.single_file:
        tail["file"] = True
    if manifest.by_idle:
        tail["idle"] = True
    if manifest.dirs:
        tail["dirs"] = encode_dirs(manifest.dirs)
    return b"".join([
        packer.pack_map_header(len(head) + 1 + len(tail)),
        *(packer.pack(item) for pair in head.items() for item in pair),
        packer.pack("files"), packer.pack_array_header(len(files)),
        *(f.encoded for f in files),
        *(packer.pack(item) for pair in tail.items() for item in pair),
    ])


def decode(data: bytes) -> StepManifest:
    """Decode and validate; raises ManifestError for anything malformed."""
    raw = decode_map(data, ManifestError, "manifest", kind=FORMAT_VERSION,
                     max_array_len=_MAX_FILES)
    try:
        files = _with_blocks([entry_from_fields(fields) for fields in raw["files"]],
                             raw.get("blocks"))
        manifest = StepManifest(
            path=check_relative_path(raw["path"]),
            step=int(raw["step"]),
            version=int(raw["version"]),
            node_id=str(raw["node_id"]),
            committed_ns=int(raw["committed_ns"]),
            files=tuple(files),
            single_file=_single_file_flag(raw.get("file", False)),
            dirs=decode_dirs(raw.get("dirs", [])),
            by_idle=_flag(raw.get("idle", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"malformed manifest: {exc!r}") from None
    if manifest.version < 1 or len({f.name for f in files}) != len(files):
        raise ManifestError("bad version or duplicate file names")
    if manifest.single_file and (
            len(files) != 1 or files[0].name != manifest.path.rpartition("/")[2]):
        raise ManifestError("a single-file manifest names exactly its own file")
    return manifest


def _with_blocks(files: list[FileEntry], blocks: object) -> list[FileEntry]:
    """The entries with their block digests from the manifest's "blocks" (if any), each
    validated: one digest per block of the file, or none."""
    if blocks is None:
        return files
    if not isinstance(blocks, list) or len(blocks) != len(files):
        raise ManifestError("bad block hashes")
    for entry, digests in zip(files, blocks, strict=True):
        if not isinstance(digests, bytes) or (
                digests and len(digests) != block_count(entry.size) * BLOCK_DIGEST_SIZE):
            raise ManifestError(f"bad block hashes for {entry.name!r}")
    return [dataclasses.replace(entry, blocks=digests)
            for entry, digests in zip(files, blocks, strict=True)]


def encode_dirs(dirs: Iterable[DirEntry]) -> list[list[Any]]:
    """Directory entries as a manifest (or a peer's WRITES) carries them."""
    return [[d.path, d.mode, d.uid, d.gid, d.mtime_ns] for d in dirs]


def decode_dirs(raw: object) -> tuple[DirEntry, ...]:
    """The directories a manifest (or a peer's WRITES) records, validated (ManifestError if
    malformed)."""
    if not isinstance(raw, list) or len(raw) > _MAX_DIRS:
        raise ManifestError("bad directory entries")
    dirs = []
    for fields in raw:
        if not (isinstance(fields, list) and len(fields) == 5 and isinstance(fields[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in fields[1:])):
            raise ManifestError("malformed directory entry")
        path, mode, uid, gid, mtime_ns = fields
        if not (0 <= mode <= 0o7777 and 0 <= uid <= _MAX_ID and 0 <= gid <= _MAX_ID):
            raise ManifestError(f"bad attributes for directory {path!r}")
        dirs.append(DirEntry(check_relative_path(path), mode, uid, gid, mtime_ns))
    return tuple(dirs)


def dir_entry_from_stat(path: str, st: os.stat_result) -> DirEntry:
    """A directory's entry as it is now."""
    return DirEntry(path, st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns)


def _single_file_flag(value: object) -> bool:
    return _flag(value, "single-file")


def _flag(value: object, what: str = "idle") -> bool:
    if not isinstance(value, bool):
        raise ManifestError(f"bad {what} flag {value!r}")
    return value


def chunk_count(size: int) -> int:
    return -(-size // CHUNK_SIZE)


def block_count(size: int) -> int:
    return -(-size // BLOCK_SIZE)


@dataclass(frozen=True)
class Digest:
    xxh3: str
    size: int
    chunks: tuple[str, ...]
    blocks: bytes = field(default=b"", compare=False)  # derived, as in FileEntry

    @classmethod
    def of(cls, entry: FileEntry) -> Digest:
        """The digest a committed entry records."""
        return cls(entry.xxh3, entry.size, entry.chunks, entry.blocks)


def hash_file(path: str | bytes | os.PathLike[str]) -> Digest:
    """Whole-file xxh3-128 and per-chunk xxh3-64 of a file (blocking: use a thread)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def hash_fd(fd: int, between: Callable[[], None] | None = None) -> Digest:
    """Whole-file xxh3-128, per-chunk and per-block xxh3-64, in one pass with pread
    (blocking). `between`, if given, is called between whole chunks (the hash's owner may
    pause there: `fs.tree.sealing`).

    The file is read one block (1 MiB) at a time and each block goes to all three digests
    while it is in the CPU's cache; a chunk's xxh3-64 is streamed over its blocks. (Reading a
    whole 8 MiB chunk and hashing it three times took about a quarter more CPU per GiB: the
    chunk's later passes came back from memory.)"""
    whole = xxhash.xxh3_128()
    chunk = xxhash.xxh3_64()
    chunks: list[str] = []
    blocks: list[bytes] = []
    # A buffer no larger than the file: bytearray zeroes what it allocates, and a zeroed
    # buffer for each small file of a many-file step cost more than hashing it. A file that
    # grew since the fstat is hashed up to its old size; its seal then does not describe it.
    size = os.fstat(fd).st_size
    buf = bytearray(min(BLOCK_SIZE, size) or 1)
    view = memoryview(buf)
    offset = 0
    while True:
        filled = 0
        while filled < len(buf) and (n := os.preadv(fd, [view[filled:]], offset + filled)):
            filled += n
        if not filled:
            break
        piece = view[:filled]
        whole.update(piece)
        chunk.update(piece)
        blocks.append(block_digest(piece))
        offset += filled
        if offset % CHUNK_SIZE == 0:
            chunks.append(chunk.hexdigest())
            chunk.reset()
            if between is not None and offset < size:  # not after the last one
                between()
        if filled < BLOCK_SIZE:
            break
    if offset % CHUNK_SIZE:
        chunks.append(chunk.hexdigest())
    return Digest(whole.hexdigest(), offset, tuple(chunks), b"".join(blocks))


def chunk_digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def block_digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_64_digest(data)


def block_digest_of(entry: FileEntry, index: int) -> bytes:
    """What the manifest says block `index` of the file hashes to (the entry has blocks)."""
    start = index * BLOCK_DIGEST_SIZE
    return entry.blocks[start:start + BLOCK_DIGEST_SIZE]


def hash_bytes(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)
