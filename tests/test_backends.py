"""One contract suite for every persistent-tier backend: file:// and S3 (a real SeaweedFS)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tierfs import manifest as mf
from tierfs.devtools.seaweed import SeaweedS3
from tierfs.s3tier import holdings
from tierfs.s3tier.backend import (
    Backend,
    BackendError,
    FileBackend,
    NotFound,
    StoreUnavailable,
    open_backend,
)

pytestmark = pytest.mark.store


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    if request.param == "file":
        store = open_backend(f"file://{tmp_path}")
        assert store.check()  # new: an empty directory
        store.claim()
        yield store
        return
    server: SeaweedS3 = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("bucket")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    yield open_backend(f"s3://{bucket}/some/prefix", server.endpoint)


def test_put_get_list_delete(backend: Backend, tmp_path: Path) -> None:
    backend.check()
    backend.put_bytes("run/step_1/.tierfs-manifest", b"manifest")
    big = os.urandom(40 << 20)  # multipart on S3: 16 MiB parts sent in parallel
    source = tmp_path / "big.src"
    source.write_bytes(big)
    backend.put_file("run/step_1/big.bin", source)
    assert backend.get_bytes("run/step_1/.tierfs-manifest") == b"manifest"
    at = 17 << 20
    assert backend.get_range("run/step_1/big.bin", at, 1000) == big[at:at + 1000]
    assert backend.get_range("run/step_1/big.bin", 0, 0) == b""
    backend.put_bytes("run/step_10/x", b"x")
    listed = {o.key: o.size for o in backend.list("run/step_1/")}
    assert listed == {"run/step_1/.tierfs-manifest": 8, "run/step_1/big.bin": len(big)}
    assert {o.key for o in backend.list("")} >= set(listed) | {"run/step_10/x"}
    backend.put_bytes("run/step_1/.tierfs-manifest", b"replaced")
    assert backend.get_bytes("run/step_1/.tierfs-manifest") == b"replaced"
    backend.delete(["run/step_1/big.bin", "run/step_1/.tierfs-manifest", "missing/key"])
    assert list(backend.list("run/step_1/")) == []
    with pytest.raises(NotFound):
        backend.get_bytes("run/step_1/big.bin")


def test_what_the_store_holds_of_a_step_now(backend: Backend) -> None:
    """`size` (a HEAD) and `holdings.held_now`: what tierfs asks before it acts on its belief
    that the store holds a step (doc/SEMANTICS.md, "What tierfs checks")."""
    entries = tuple(mf.FileEntry(name, len(data), mf.hash_bytes(data))
                    for name, data in (("a.bin", b"aaaa"), ("sub/b.bin", b"bb")))
    step = mf.StepManifest(path="run/step_7", step=7, version=1, node_id="n",
                           committed_ns=1, files=entries)
    loose = mf.StepManifest(path="run/last.ckpt", step=mf.NO_STEP, version=1, node_id="n",
                            committed_ns=1, files=(mf.FileEntry("last.ckpt", 3, "0" * 32),),
                            single_file=True)
    assert backend.size("run/step_7/a.bin") is None
    assert holdings.held_now(backend, step) == holdings.Held(False, frozenset())
    backend.put_bytes("run/step_7/a.bin", b"aaaa")
    backend.put_bytes("run/step_7/sub/b.bin", b"b")  # short: not what the manifest names
    assert backend.size("run/step_7/a.bin") == 4
    held = holdings.held_now(backend, step)
    assert held.files == {"a.bin"} and not held.manifest and not held.whole(step)
    backend.put_bytes("run/step_7/sub/b.bin", b"bb")
    backend.put_bytes("run/step_7/.tierfs-manifest", b"m")
    assert holdings.held_now(backend, step).whole(step)
    backend.put_bytes("run/last.ckpt", b"ccc")
    assert holdings.held_now(backend, loose).lacking(loose) == ["last.ckpt"]  # no manifest
    backend.put_bytes("run/.tierfs-file-last.ckpt/.tierfs-manifest", b"m")
    assert holdings.held_now(backend, loose).whole(loose)


def test_copy_inside_the_store(backend: Backend, tmp_path: Path) -> None:
    """A rename in the store: the bytes are copied by the store itself, also an object larger
    than one copy request (S3: UploadPartCopy; here with small copy requests)."""
    small, big = b"small", os.urandom(11 << 20)
    backend.put_bytes("run/step_1/a", small)
    source = tmp_path / "big.src"
    source.write_bytes(big)
    backend.put_file("run/step_1/sub/big", source)
    if hasattr(backend, "copy_whole_max"):
        # S3's least part is 5 MiB
        backend.copy_whole_max, backend.copy_part_size = 5 << 20, 5 << 20  # type: ignore[attr-defined]
    backend.copy("run/step_1/a", "run-old/step_1/a")
    backend.copy("run/step_1/sub/big", "run-old/step_1/sub/big")
    backend.delete(["run/step_1/a", "run/step_1/sub/big"])
    assert backend.get_bytes("run-old/step_1/a") == small
    assert backend.get_bytes("run-old/step_1/sub/big") == big
    assert list(backend.list("run/")) == []
    backend.put_bytes("run-old/step_1/a", b"replaced")  # the copy is an object of its own
    backend.copy("run-old/step_1/a", "run-old/step_1/b")
    assert backend.get_bytes("run-old/step_1/b") == b"replaced"
    with pytest.raises(NotFound):
        backend.copy("run/step_1/a", "x/y")


def test_names_up_to_name_max(backend: Backend) -> None:
    """A file under the mount may have a 255-byte name; storing it must not need a longer one."""
    key = "run/step_1/" + "n" * 255
    backend.put_bytes(key, b"long")
    assert backend.get_bytes(key) == b"long"
    assert [o.key for o in backend.list("run/")] == [key]


def test_missing_file_source_is_not_retried(backend: Backend, tmp_path: Path) -> None:
    with pytest.raises(BackendError) as info:
        backend.put_file("k", tmp_path / "does-not-exist")
    assert not info.value.temporary


def test_s3_errors_are_classified(s3_server: SeaweedS3, bucket: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    with pytest.raises(BackendError, match="does not exist") as info:
        open_backend("s3://no-such-bucket-here/x", s3_server.endpoint).check()
    assert not info.value.temporary
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(BackendError, match="access denied") as info:
        open_backend(f"s3://{bucket}/x", s3_server.endpoint).check()
    assert not info.value.temporary
    with pytest.raises(BackendError) as info:
        open_backend(f"s3://{bucket}/x", "http://127.0.0.1:9").check()  # nothing listens
    assert info.value.temporary


def test_urls_are_checked() -> None:
    for url in ("ftp://x/y", "file://relative/path", "s3://ab"):
        with pytest.raises(ValueError):
            open_backend(url)


def test_file_store_is_writable_by_its_owner_only(tmp_path: Path) -> None:
    """Nothing in a file:// store is writable by group or others, and an object is readable
    by no more users than its file under the mount: its owner only until `restrict` gives it
    the file's read bits for group and others, and the file's group (it was 0644 whatever the
    file's mode: any local user read a 0600 checkpoint in the store)."""
    old = os.umask(0)  # as in the daemon
    try:
        backend = open_backend(f"file://{tmp_path}")
        assert backend.check()
        backend.claim()
        backend.put_bytes("run/step_1/sub/.tierfs-manifest", b"m")
        source = tmp_path / "src"
        source.write_bytes(b"data")
        backend.put_file("run/step_1/shard", source)
        backend.put_file("run/step_1/public", source)
    finally:
        os.umask(old)

    def modes() -> dict[str, int]:
        return {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777
                for p in tmp_path.rglob("*") if p.name != "src"}

    assert modes() == {".tierfs-store": 0o644, "run": 0o755, "run/step_1": 0o755,
                       "run/step_1/sub": 0o755, "run/step_1/sub/.tierfs-manifest": 0o600,
                       "run/step_1/shard": 0o600, "run/step_1/public": 0o600}
    backend.restrict([("run/step_1/shard", 0o700, 4321), ("run/step_1/public", 0o666, -1)])
    assert modes()["run/step_1/shard"] == 0o600 and modes()["run/step_1/public"] == 0o644
    assert (tmp_path / "run/step_1/shard").stat().st_gid == 4321
    assert (tmp_path / "run/step_1/public").stat().st_gid == os.getegid()


def test_file_store_root_must_be_empty_or_a_store(tmp_path: Path) -> None:
    for root in ("/", "/usr"):
        with pytest.raises(BackendError, match="is not empty and is not a tierfs store"):
            open_backend(f"file://{root}").check()
    home = tmp_path / "home"
    (home / "projects/step_1").mkdir(parents=True)
    (home / "projects/step_1/notes.txt").write_text("a user's file")
    with pytest.raises(BackendError, match="is not empty") as info:
        open_backend(f"file://{home}").check()
    assert not info.value.temporary
    assert not (home / FileBackend.STORE_MARK).exists()
    older = tmp_path / "older"  # a store written before stores were marked
    (older / "run/step_1").mkdir(parents=True)
    (older / "run/step_1/.tierfs-manifest").write_bytes(b"m")
    older_store = open_backend(f"file://{older}")
    assert not older_store.check()  # used before: not a new store
    older_store.claim()
    assert (older / FileBackend.STORE_MARK).exists()
    assert [o.key for o in open_backend(f"file://{older}").list()] == [
        "run/step_1/.tierfs-manifest"]


def test_a_new_store_is_told_from_one_used_before(backend: Backend) -> None:
    """`check` says whether a store is new (the mount refuses a new one where the RAM dir says
    steps were persisted); once an object is in it, it is not."""
    backend.put_bytes("run/step_1/.tierfs-manifest", b"m")
    assert backend.check() is False
    if isinstance(backend, FileBackend):
        backend.delete(["run/step_1/.tierfs-manifest"])
        assert backend.check() is False  # the mark stays: used before, though empty now


def test_a_file_store_away_is_unavailable_not_missing(tmp_path: Path) -> None:
    """A file:// store whose directory went away (an unmounted volume), or is an empty
    directory without its mark (the volume's mountpoint), is StoreUnavailable for every
    request: not "no object", not an empty listing, not a delete that succeeds, and nothing is
    written beside the volume. Back in place, it works again."""
    root = tmp_path / "store"
    root.mkdir()
    store = open_backend(f"file://{root}")
    assert store.check() is True
    store.claim()
    store.put_bytes("run/step_1/w.bin", b"w")
    source = tmp_path / "src"
    source.write_bytes(b"data")
    root.rename(tmp_path / "away")
    for absent in ("is missing", "has no .tierfs-store"):
        requests = [lambda: store.get_bytes("run/step_1/w.bin"), lambda: list(store.list("")),
                    lambda: store.put_file("run/step_2/w.bin", source),
                    lambda: store.put_bytes("run/step_2/.tierfs-manifest", b"m"),
                    lambda: store.delete(["run/step_1/w.bin"])]
        for request in requests:
            with pytest.raises(StoreUnavailable, match=absent) as info:
                request()
            assert not isinstance(info.value, NotFound)
            assert str(info.value).startswith(f"the store file://{root} is unavailable")
        if not root.exists():
            root.mkdir()  # the volume's empty mountpoint
    assert list(root.iterdir()) == []  # nothing was written into it
    root.rmdir()
    (tmp_path / "away").rename(root)
    assert store.get_bytes("run/step_1/w.bin") == b"w"
    store.put_file("run/step_2/w.bin", source)
    assert sorted(o.key for o in store.list("run/")) == ["run/step_1/w.bin", "run/step_2/w.bin"]


def temporary_objects(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _s, names in os.walk(root)
                  for n in names if n.startswith(".tierfs-upload") or n.endswith(".tierfs-upload"))


def test_a_file_store_moved_away_mid_write_keeps_no_temporary_object(tmp_path: Path) -> None:
    """The store moved away while a file was being written into it: the temporary object
    went with it (its removal failed), and came back with the store. Before, it stayed for
    good (the listing skips such names, so nothing removed it); now the next request does."""
    root, away = tmp_path / "store", tmp_path / "away"
    root.mkdir()
    store = open_backend(f"file://{root}")
    store.check()
    store.claim()
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    failures: list[BaseException] = []

    def upload() -> None:
        try:
            store.put_file("run/step_1/big.bin", pipe)
        except BackendError as exc:
            failures.append(exc)

    writer = threading.Thread(target=upload)
    writer.start()
    with open(pipe, "wb") as source:
        source.write(bytes(8 << 20))  # one read of the copy: it is written, then waits
        source.flush()
        wait_until(lambda: [os.path.getsize(root / p) for p in temporary_objects(root)]
                   == [8 << 20])
        root.rename(away)
    writer.join(10)
    assert len(failures) == 1 and isinstance(failures[0], StoreUnavailable)
    away.rename(root)
    assert len(temporary_objects(root)) == 1  # back with the store
    assert list(store.list("")) == []  # and never listed
    store.put_bytes("run/step_1/big.bin", b"the retry")
    assert temporary_objects(root) == []
    assert store.get_bytes("run/step_1/big.bin") == b"the retry"


def test_a_file_store_at_start_removes_what_uploads_cut_short_left(tmp_path: Path) -> None:
    """`remove_leftovers`: this host's temporary objects whose process is gone (also in the
    names older versions wrote), another host's once a day old; a live upload's stay, and
    so do the objects."""
    store = open_backend(f"file://{tmp_path}")
    store.check()
    store.claim()
    assert isinstance(store, FileBackend)
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    store.put_bytes("run/step_1/a.bin", b"a")
    made = {f"run/step_1/.tierfs-upload-{host}-{gone.pid}-3": True,  # a killed daemon's
            f"run/step_2/.tierfs-upload-{host}-{gone.pid}-4": True,  # alone in its directory
            f"run/step_1/.tierfs-upload-{gone.pid}-0": True,  # from before the host's name
            f"run/step_1/a.bin.{gone.pid}.tierfs-upload": True,  # older still
            f"run/step_1/.tierfs-upload-{host}-{os.getppid()}-0": False,  # alive: under way
            "run/step_1/.tierfs-upload-other-host-1-0": False,  # another host's, recent
            "run/step_1/.tierfs-upload-other-host-2-0": True}  # another host's, a day old
    for rel in made:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"partial")
    day_ago = time.time() - 25 * 3600
    os.utime(tmp_path / "run/step_1/.tierfs-upload-other-host-2-0", (day_ago, day_ago))
    assert store.remove_leftovers() == sum(made.values())
    assert temporary_objects(tmp_path) == sorted(rel for rel, gone in made.items() if not gone)
    assert not (tmp_path / "run/step_2").exists()
    assert store.get_bytes("run/step_1/a.bin") == b"a"
