"""Unit tests of the manifest codec, its validation and hashing."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace as dataclass_replace
from pathlib import Path

import msgpack
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tierfs import manifest as mf

pytestmark = pytest.mark.core

names = st.lists(st.text("abcdefghij_.0123456789", min_size=1, max_size=12), min_size=1,
                 max_size=3).map("/".join).filter(
                     lambda n: all(p not in (".", "..") for p in n.split("/")))


def entry(name: str, size: int, digest: str = "a" * 32) -> mf.FileEntry:
    return mf.FileEntry(name, size, digest, 5, 0o644, ("0" * 16,) * mf.chunk_count(size))


@given(st.lists(st.tuples(names, st.integers(0, 2**34), st.binary(min_size=16, max_size=16)),
                max_size=20, unique_by=lambda t: t[0]),
       st.integers(1, 2**31), st.integers(0, 2**40))
def test_roundtrip(files, version: int, step: int) -> None:  # type: ignore[no-untyped-def]
    manifest = mf.StepManifest(
        path="run1/step_1", step=step, version=version, node_id="node0", committed_ns=123,
        files=tuple(entry(n, size, digest.hex()) for n, size, digest in files))
    assert mf.decode(mf.encode(manifest)) == manifest


def test_total_bytes_entry_and_same_content() -> None:
    a = mf.StepManifest("s/step_1", 1, 1, "n", 0, (entry("x", 3, "0" * 32),
                                                   entry("y", 4, "1" * 32)))
    b = mf.StepManifest("s/step_1", 1, 2, "m", 9, tuple(reversed(a.files)))
    assert a.total_bytes == 7 and a.entry("y").size == 4 and a.entry("z") is None
    assert a.same_content(b)


@pytest.mark.parametrize("bad", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"format": 99}),
                                 msgpack.packb({"format": 1, "path": "a"})])
def test_malformed_input_is_a_manifest_error(bad: bytes) -> None:
    with pytest.raises(mf.ManifestError):
        mf.decode(bad)


@pytest.mark.parametrize("name", ["../etc/passwd", "/abs", "a/../b", "a//b", "", "nul\0", ".",
                                  ".tierfs-manifest", "d/.tierfs-tmp-1"])
def test_unsafe_paths_are_refused(name: str) -> None:
    good = mf.StepManifest("run/step_1", 1, 1, "n", 0, (entry("ok", 1),))
    raw = msgpack.unpackb(mf.encode(good))
    raw["files"][0][0] = name
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))
    raw["files"][0][0] = "ok"
    raw["path"] = name
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))


def test_bad_digest_and_duplicates_are_refused() -> None:
    good = mf.StepManifest("run/step_1", 1, 1, "n", 0, (entry("ok", 1),))
    raw = msgpack.unpackb(mf.encode(good))
    raw["files"][0][2] = "xyz"
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))
    raw["files"][0][2] = "a" * 32
    raw["files"][0][5] = []  # one chunk hash is needed for one byte
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))
    raw["files"] = [["ok", 1, "a" * 32, 0, 0o644, ["0" * 16]]] * 2
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))


def test_hash_file_matches_xxh3_128(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = bytes(range(256)) * 40_000  # 10 MB: two hash chunks
    path = tmp_path / "f"
    path.write_bytes(data)
    digest = mf.hash_file(path)
    assert (digest.xxh3, digest.size) == (xxhash.xxh3_128_hexdigest(data), len(data))
    size = mf.CHUNK_SIZE
    assert digest.chunks == tuple(xxhash.xxh3_64_hexdigest(data[i:i + size])
                                  for i in range(0, len(data), size))
    assert len(digest.chunks) == 2
    (tmp_path / "empty").write_bytes(b"")
    assert mf.hash_file(tmp_path / "empty").chunks == ()
    assert mf.hash_bytes(data) == xxhash.xxh3_128_hexdigest(data)


@pytest.mark.parametrize("size", [1, mf.BLOCK_SIZE - 1, mf.BLOCK_SIZE, mf.BLOCK_SIZE + 1,
                                  mf.CHUNK_SIZE, 2 * mf.CHUNK_SIZE + mf.BLOCK_SIZE + 7])
def test_hash_file_digests_every_chunk_and_block(tmp_path: Path, size: int) -> None:
    """hash_fd reads block by block: chunks and blocks still end where the manifest says."""
    data = bytes(range(251)) * (size // 251 + 1)
    data = data[:size]
    path = tmp_path / "f"
    path.write_bytes(data)
    digest = mf.hash_file(path)
    assert (digest.xxh3, digest.size) == (xxhash.xxh3_128_hexdigest(data), size)
    assert digest.chunks == tuple(xxhash.xxh3_64_hexdigest(data[i:i + mf.CHUNK_SIZE])
                                  for i in range(0, size, mf.CHUNK_SIZE))
    assert digest.blocks == b"".join(xxhash.xxh3_64_digest(data[i:i + mf.BLOCK_SIZE])
                                     for i in range(0, size, mf.BLOCK_SIZE))


def test_owners_are_recorded_and_older_manifests_still_decode() -> None:
    owned = mf.FileEntry("x", 1, "0" * 32, 7, 0o640, ("1" * 16,), 1234, 2345)
    manifest = mf.StepManifest("s/step_1", 1, 1, "n", 0, (owned,))
    assert mf.decode(mf.encode(manifest)).files[0] == owned
    # a manifest written before owners were recorded: six fields per entry
    old = msgpack.unpackb(mf.encode(manifest))
    old["files"][0] = old["files"][0][:6]
    entry_before = mf.decode(msgpack.packb(old)).files[0]
    assert (entry_before.mode, entry_before.mtime_ns) == (0o640, 7)
    assert (entry_before.uid, entry_before.gid) == (mf.NO_OWNER, mf.NO_OWNER)
    six = old["files"][0]
    for bad in ([*six, -5, 0], [*six, 0, 1 << 40], [*six, "0", 0], six[:5]):
        old["files"][0] = bad
        with pytest.raises(mf.ManifestError):
            mf.decode(msgpack.packb(old))


def test_block_digests_round_trip_and_older_readers_and_manifests_are_unaffected(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = bytes(range(256)) * 12_000  # 3,072,000 bytes: three blocks, the last one short
    path = tmp_path / "f"
    path.write_bytes(data)
    digest = mf.hash_file(path)
    assert digest.blocks == b"".join(xxhash.xxh3_64_digest(data[i:i + mf.BLOCK_SIZE])
                                     for i in range(0, len(data), mf.BLOCK_SIZE))
    with_blocks = mf.FileEntry("x", len(data), digest.xxh3, 7, 0o640, digest.chunks,
                               blocks=digest.blocks)
    manifest = mf.StepManifest("s/step_1", 1, 1, "n", 0, (with_blocks, entry("y", 5)))
    decoded = mf.decode(mf.encode(manifest)).files
    assert [f.blocks for f in decoded] == [digest.blocks, b""]
    assert mf.block_digest_of(decoded[0], 2) == xxhash.xxh3_64_digest(data[2 << 20:])
    # beside the entries: a reader that predates blocks sees the entries it always saw
    raw = msgpack.unpackb(mf.encode(manifest))
    assert [len(fields) for fields in raw["files"]] == [8, 8]
    # a manifest without them (older) decodes with none
    del raw["blocks"]
    assert mf.decode(msgpack.packb(raw)).files[0].blocks == b""
    raw["blocks"] = [digest.blocks[:-1], b""]  # not one digest per block
    with pytest.raises(mf.ManifestError, match="block hashes"):
        mf.decode(msgpack.packb(raw))


def test_hashing_a_small_file_allocates_no_chunk_sized_buffer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A many-file step hashes thousands of small files: each hash allocates about the file's
    size (bytearray zeroes what it gets; 8 MiB per 4 KiB file cost more than the hash)."""
    path = tmp_path / "small"
    path.write_bytes(b"s" * 4096)
    tracemalloc.start()
    try:
        digest = mf.hash_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert digest == mf.Digest(xxhash.xxh3_128_hexdigest(b"s" * 4096), 4096,
                               (xxhash.xxh3_64_hexdigest(b"s" * 4096),))
    assert peak < 1 << 20
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert mf.hash_file(empty) == mf.Digest(xxhash.xxh3_128_hexdigest(b""), 0, ())


def test_segments_roundtrip_and_are_validated() -> None:
    size = 3000
    segmented = mf.FileEntry("log", size, "a" * 32, 5, 0o644, ("0" * 16,), 0, 0, (1000, 2500))
    manifest = mf.StepManifest("run/log", mf.NO_STEP, 2, "n", 1, (segmented,), single_file=True)
    assert mf.decode(mf.encode(manifest)) == manifest
    assert segmented.pieces() == [(0, 1000), (1000, 1500), (2500, 500)]
    plain = mf.entry_fields(mf.FileEntry("log", size, "a" * 32, chunks=("0" * 16,)))
    assert len(plain) == 8  # entries without segments are encoded as before
    for bad in ([0], [1000, 1000], [2500, 1000], [size], [3001], ["x"], 7):
        with pytest.raises(mf.ManifestError):
            mf.entry_from_fields([*plain, bad])


def test_directories_round_trip_are_validated_and_are_no_part_of_the_version() -> None:
    """A manifest records the directories above its files (fs.tree.dir_attributes); older readers
    and manifests are unaffected, and two manifests that differ only there are equal."""
    dirs = (mf.DirEntry("run", 0o750, 1000, 1000, 123), mf.DirEntry("run/step_1", 0o700, 1000,
                                                                    100, -5))
    plain = mf.StepManifest("run/step_1", 1, 1, "n", 0, (entry("x", 3),))
    with_dirs = mf.StepManifest("run/step_1", 1, 1, "n", 0, (entry("x", 3),), dirs=dirs)
    decoded = mf.decode(mf.encode(with_dirs))
    assert decoded.dirs == dirs and decoded == plain
    assert mf.decode(mf.encode(plain)).dirs == ()
    assert "dirs" not in msgpack.unpackb(mf.encode(plain))
    # so is how it was committed (fs.model.completion)
    idle = mf.StepManifest("run/step_1", 1, 1, "n", 0, (entry("x", 3),), by_idle=True)
    assert mf.decode(mf.encode(idle)).by_idle and not mf.decode(mf.encode(plain)).by_idle
    assert "idle" not in msgpack.unpackb(mf.encode(plain))
    # the step's own directories, not those above it, make a change of attributes
    moved_run = (dataclass_replace(dirs[0], mtime_ns=999), dirs[1])
    assert with_dirs.same_own_dirs(moved_run)
    assert not with_dirs.same_own_dirs((dirs[0], dataclass_replace(dirs[1], mode=0o755)))
    raw = msgpack.unpackb(mf.encode(with_dirs))
    for bad in (["run", 0o750, 1, 1], ["../x", 0o750, 1, 1, 0], ["run", 0o17777, 1, 1, 0],
                ["run", 0o750, -1, 1, 0], ["run", "0750", 1, 1, 0], "run"):
        raw["dirs"] = [bad]
        with pytest.raises(mf.ManifestError):
            mf.decode(msgpack.packb(raw))
