"""The shared data model of tierfs: sealed files, step manifests, hashing and their codec.

A step manifest is the unit of commit: it names every file of a step directory with its size and
xxh3-128, and carries a version that only grows plus the id of the node that made the commit.
Every tier stores the same msgpack encoding. Decoding validates everything, because manifests
come from disks and, later, from the network and S3: a malformed one raises ManifestError.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import msgpack
import xxhash

FORMAT_VERSION = 1
MANIFEST_NAME = ".tierfs-manifest"
HASH_CHUNK = 4 << 20
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_MAX_FILES = 1_000_000


class ManifestError(ValueError):
    """A manifest that cannot be decoded or does not hold together."""


@dataclass(frozen=True)
class FileEntry:
    """One sealed file of a step: `name` is relative to the step directory, '/'-separated."""

    name: str
    size: int
    xxh3: str
    mtime_ns: int = 0
    mode: int = 0o644


@dataclass(frozen=True)
class StepManifest:
    """The committed content of one step directory at one version."""

    path: str
    step: int
    version: int
    node_id: str
    committed_ns: int
    files: tuple[FileEntry, ...] = field(default_factory=tuple)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, name: str) -> FileEntry | None:
        for f in self.files:
            if f.name == name:
                return f
        return None

    def same_content(self, other: StepManifest) -> bool:
        key = lambda m: sorted((f.name, f.size, f.xxh3) for f in m.files)  # noqa: E731
        return key(self) == key(other)


def check_relative_path(name: str) -> str:
    """Return `name` if it is a safe relative path ('a/b'), else raise ManifestError."""
    if not name or "\0" in name or name.startswith("/") or "\\" in name:
        raise ManifestError(f"unsafe path {name!r}")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ManifestError(f"unsafe path {name!r}")
    return name


def encode(manifest: StepManifest) -> bytes:
    return msgpack.packb(
        {
            "format": FORMAT_VERSION,
            "path": manifest.path,
            "step": manifest.step,
            "version": manifest.version,
            "node_id": manifest.node_id,
            "committed_ns": manifest.committed_ns,
            "files": [[f.name, f.size, f.xxh3, f.mtime_ns, f.mode] for f in manifest.files],
        },
        use_bin_type=True,
    )


def decode(data: bytes) -> StepManifest:
    """Decode and validate; raises ManifestError for anything malformed."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=_MAX_FILES)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ManifestError(f"not a manifest: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_VERSION:
        raise ManifestError("unknown manifest format")
    try:
        files = []
        for name, size, digest, mtime_ns, mode in raw["files"]:
            if not (isinstance(size, int) and size >= 0 and isinstance(digest, str)):
                raise ManifestError(f"bad file entry {name!r}")
            if not _HEX128.match(digest):
                raise ManifestError(f"bad xxh3 for {name!r}")
            files.append(FileEntry(check_relative_path(name), size, digest, int(mtime_ns),
                                   int(mode)))
        manifest = StepManifest(
            path=check_relative_path(raw["path"]),
            step=int(raw["step"]),
            version=int(raw["version"]),
            node_id=str(raw["node_id"]),
            committed_ns=int(raw["committed_ns"]),
            files=tuple(files),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"malformed manifest: {exc!r}") from None
    if manifest.version < 1 or len({f.name for f in files}) != len(files):
        raise ManifestError("bad version or duplicate file names")
    return manifest


def hash_file(path: str | bytes | os.PathLike[str]) -> tuple[str, int]:
    """xxh3-128 hex digest and size of a file (blocking: use a thread)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def hash_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def hash_fd(fd: int) -> tuple[str, int]:
    """xxh3-128 hex digest and size of an open file, read with pread (blocking: use a thread)."""
    hasher = xxhash.xxh3_128()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    offset = 0
    while n := os.preadv(fd, [buf], offset):
        hasher.update(view[:n])
        offset += n
    return hasher.hexdigest(), offset
