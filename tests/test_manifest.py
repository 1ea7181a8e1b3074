"""Unit tests of the manifest codec, its validation and hashing."""

from __future__ import annotations

import msgpack
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tierfs import manifest as mf

names = st.lists(st.text("abcdefghij_.0123456789", min_size=1, max_size=12), min_size=1,
                 max_size=3).map("/".join).filter(
                     lambda n: all(p not in (".", "..") for p in n.split("/")))


@given(st.lists(st.tuples(names, st.integers(0, 2**48), st.binary(min_size=16, max_size=16)),
                max_size=20, unique_by=lambda t: t[0]),
       st.integers(1, 2**31), st.integers(0, 2**40))
def test_roundtrip(files, version: int, step: int) -> None:  # type: ignore[no-untyped-def]
    manifest = mf.StepManifest(
        path="run1/step_1", step=step, version=version, node_id="node0", committed_ns=123,
        files=tuple(mf.FileEntry(n, size, digest.hex(), 5, 0o644) for n, size, digest in files))
    assert mf.decode(mf.encode(manifest)) == manifest


def test_total_bytes_entry_and_same_content() -> None:
    a = mf.StepManifest("s/step_1", 1, 1, "n", 0, (mf.FileEntry("x", 3, "0" * 32),
                                                   mf.FileEntry("y", 4, "1" * 32)))
    b = mf.StepManifest("s/step_1", 1, 2, "m", 9, tuple(reversed(a.files)))
    assert a.total_bytes == 7 and a.entry("y").size == 4 and a.entry("z") is None
    assert a.same_content(b)


@pytest.mark.parametrize("bad", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"format": 99}),
                                 msgpack.packb({"format": 1, "path": "a"})])
def test_malformed_input_is_a_manifest_error(bad: bytes) -> None:
    with pytest.raises(mf.ManifestError):
        mf.decode(bad)


@pytest.mark.parametrize("name", ["../etc/passwd", "/abs", "a/../b", "a//b", "", "nul\0", "."])
def test_unsafe_paths_are_refused(name: str) -> None:
    good = mf.StepManifest("run/step_1", 1, 1, "n", 0, (mf.FileEntry("ok", 1, "a" * 32),))
    raw = msgpack.unpackb(mf.encode(good))
    raw["files"][0][0] = name
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))
    raw["files"][0][0] = "ok"
    raw["path"] = name
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))


def test_bad_digest_and_duplicates_are_refused() -> None:
    good = mf.StepManifest("run/step_1", 1, 1, "n", 0, (mf.FileEntry("ok", 1, "a" * 32),))
    raw = msgpack.unpackb(mf.encode(good))
    raw["files"][0][2] = "xyz"
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))
    raw["files"] = [["ok", 1, "a" * 32, 0, 0o644]] * 2
    with pytest.raises(mf.ManifestError):
        mf.decode(msgpack.packb(raw))


def test_hash_file_matches_xxh3_128(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = bytes(range(256)) * 40_000  # spans several hash chunks
    path = tmp_path / "f"
    path.write_bytes(data)
    assert mf.hash_file(path) == (xxhash.xxh3_128_hexdigest(data), len(data))
    assert mf.hash_bytes(data) == xxhash.xxh3_128_hexdigest(data)
