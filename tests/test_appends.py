"""Appended loose files (a log, a TensorBoard event file) through real mounts on a real S3
server (SeaweedFS): a file still being appended reaches the store every `--append-every`
seconds, and a fresh node reads exactly the bytes persisted so far; appends to a big file send
only the new bytes (segments beside the file's object), and the store's objects concatenated
as doc/SEMANTICS.md says give the file's exact bytes, also with a segment left by an upload
that a crash cut short."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests.conftest import Mount, MountFactory, tierfs, wait_until
from tests.test_s3 import persist_args
from tierfs import manifest as mf
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = pytest.mark.fuse

BASE = 1 << 20  # a 1 MiB file, then small appends
RECORD = 200


def stored_manifest(s3: SeaweedS3, bucket: str, name: str) -> mf.StepManifest | None:
    """The manifest of the loose file `run/<name>` in the store, None if there is none."""
    client = s3.client()
    try:
        data = client.get_object(Bucket=bucket,
                                 Key=f"ckpt/run/.tierfs-file-{name}/.tierfs-manifest")
    except client.exceptions.NoSuchKey:
        return None
    return mf.decode(data["Body"].read())


def stored_objects(s3: SeaweedS3, bucket: str, prefix: str) -> dict[str, int]:
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for o in listing.get("Contents", [])}


def as_a_person_reads_it(s3: SeaweedS3, bucket: str, name: str) -> bytes:
    """The file as doc/SEMANTICS.md tells a person without tierfs to read it: the object, then
    the `append.*` objects beside the manifest in key order, cut at the manifest's size."""
    client = s3.client()
    manifest = stored_manifest(s3, bucket, name)
    assert manifest is not None
    data = client.get_object(Bucket=bucket, Key=f"ckpt/run/{name}")["Body"].read()
    for key in sorted(stored_objects(s3, bucket, f"ckpt/run/.tierfs-file-{name}/append.")):
        data += client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return data[:manifest.files[0].size]


def stored_version(s3: SeaweedS3, bucket: str, name: str) -> int:
    manifest = stored_manifest(s3, bucket, name)
    return 0 if manifest is None else manifest.version


def persisted_version(mnt: Mount, path: str) -> int:
    step = mnt.step(path)
    return step["version"] if step is not None and step["persisted"] else 0


def test_a_file_appended_all_the_time_reaches_the_store_while_it_is_appended(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str,
        s3_env: dict[str, str]) -> None:
    # --commit-idle far away: only --append-every can put this file in the store.
    mnt = mounts.mount(*persist_args(s3_server, bucket, "--commit-idle", "60",
                                     "--append-every", "1"), env=s3_env)
    (mnt / "run").mkdir()
    written = bytearray(os.urandom(BASE))
    stop = threading.Event()
    lock = threading.Lock()

    def appender() -> None:  # TensorBoard's way: one descriptor, a record every 0.2 s
        with open(mnt / "run/events.out.tfevents.1.host", "wb", buffering=0) as f:
            f.write(bytes(written))
            number = 0
            while not stop.wait(0.2):
                record = f"record {number:06d} ".encode().ljust(RECORD, b".")
                with lock:
                    f.write(record)
                    written.extend(record)
                number += 1

    thread = threading.Thread(target=appender)
    thread.start()
    try:
        # Stored while still being appended, and at least once as base + segments.
        wait_until(lambda: (m := stored_manifest(s3_server, bucket,
                                                 "events.out.tfevents.1.host")) is not None
                   and m.files[0].segments, timeout=20, interval=0.2)
        assert thread.is_alive()
        manifest = stored_manifest(s3_server, bucket, "events.out.tfevents.1.host")
        assert manifest is not None
        fresh = mounts.mount(*persist_args(s3_server, bucket, "--commit-idle", "60"),
                             env=s3_env)
        seen = fresh.step("run/events.out.tfevents.1.host")
        assert seen is not None and seen["version"] >= manifest.version
        data = (fresh / "run/events.out.tfevents.1.host").read_bytes()
        with lock:
            assert BASE < len(data) <= len(written)
            assert data == bytes(written[:len(data)])  # exactly the bytes persisted so far
        assert thread.is_alive()  # all of it while the file was still being appended
    finally:
        stop.set()
        thread.join()


def test_appends_to_a_big_file_send_only_the_new_bytes(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str,
        s3_env: dict[str, str]) -> None:
    mnt = mounts.mount(*persist_args(s3_server, bucket, "--commit-idle", "0.3"), env=s3_env)
    (mnt / "run").mkdir()
    log = mnt / "run/train.log"
    content = os.urandom(BASE)
    log.write_bytes(content)
    wait_until(lambda: persisted_version(mnt, "run/train.log") == 1, timeout=20)
    sent_before = mnt.status()["persist"]["sent_bytes"]
    assert sent_before >= BASE
    # Appended more slowly than --commit-idle: a new version each time.
    for number in range(9):
        record = f"step {number}".encode().ljust(RECORD, b" ")
        with open(log, "ab") as f:
            f.write(record)
        content += record
        wait_until(lambda n=number: persisted_version(mnt, "run/train.log") == n + 2,
                   timeout=20)
    sent = mnt.status()["persist"]["sent_bytes"] - sent_before
    assert 9 * RECORD <= sent < 4 * 9 * RECORD, sent  # not 9 x 1 MiB

    # What the store holds: the 1 MiB object once, and nine segments of 200 bytes.
    assert stored_objects(s3_server, bucket, "ckpt/run/train.log") == {
        "ckpt/run/train.log": BASE}
    segments = stored_objects(s3_server, bucket, "ckpt/run/.tierfs-file-train.log/append.")
    assert sorted(segments.values()) == [RECORD] * 9
    assert as_a_person_reads_it(s3_server, bucket, "train.log") == content
    checked = tierfs("verify", str(mnt / "run"), "--json", "--no-repair", env=s3_env)
    tiers = {t["tier"]: t for t in json.loads(checked.stdout)["steps"][0]["tiers"]}
    assert tiers["persist"]["good"] == 1 and tiers["persist"]["ok"]  # every piece checked

    # An upload of the next segment cut short by a crash (its manifest never written) leaves
    # an object no manifest names: neither tierfs nor a person reads it as part of the file.
    leftover = f"ckpt/run/.tierfs-file-train.log/append.{len(content):020d}"
    s3_server.client().put_object(Bucket=bucket, Key=leftover, Body=b"not yet committed")
    assert as_a_person_reads_it(s3_server, bucket, "train.log") == content
    fresh = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    assert (fresh / "run/train.log").read_bytes() == content
    assert fresh.step("run/train.log")["version"] == 10


def test_a_rewritten_loose_file_is_one_object_again(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str,
        s3_env: dict[str, str]) -> None:
    """A version that does not extend the stored one (rewritten, not appended) replaces the
    object whole and takes the old segments away before its manifest goes up."""
    mnt = mounts.mount(*persist_args(s3_server, bucket, "--commit-idle", "0.3"), env=s3_env)
    (mnt / "run").mkdir()
    log = mnt / "run/state.txt"
    log.write_bytes(b"a" * 4096)
    wait_until(lambda: persisted_version(mnt, "run/state.txt") == 1, timeout=20)
    with open(log, "ab") as f:
        f.write(b"b" * 100)
    wait_until(lambda: persisted_version(mnt, "run/state.txt") == 2, timeout=20)
    assert len(stored_objects(s3_server, bucket, "ckpt/run/.tierfs-file-state.txt/append.")) == 1
    log.write_bytes(b"c" * 5000)  # rewritten from the start
    wait_until(lambda: persisted_version(mnt, "run/state.txt") == 3, timeout=20)
    assert stored_objects(s3_server, bucket, "ckpt/run/.tierfs-file-state.txt/append.") == {}
    assert stored_manifest(s3_server, bucket, "state.txt").files[0].segments == ()
    fresh = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    assert (fresh / "run/state.txt").read_bytes() == b"c" * 5000


def test_append_every_is_a_number_of_seconds_or_0(tmp_path: Path) -> None:
    result = tierfs("mount", str(tmp_path), "--append-every", "soon", check=False)
    assert result.returncode != 0
    assert "--append-every must be a number of seconds" in result.stderr


def test_a_daemon_killed_after_appends_keeps_them_and_commits_them(
        mounts: MountFactory, s3_server: SeaweedS3, bucket: str,
        s3_env: dict[str, str]) -> None:
    options = persist_args(s3_server, bucket, "--commit-idle", "60", "--append-every", "1")
    mnt = mounts.mount(*options, env=s3_env)
    (mnt / "run").mkdir()
    log = mnt / "run/metrics.csv"
    log.write_bytes(b"step,loss\n" * 400)
    wait_until(lambda: stored_version(s3_server, bucket, "metrics.csv") == 1, timeout=20)
    with open(log, "ab") as f:
        f.write(b"401,0.5\n")
    mnt.kill9()  # before --append-every commits the append
    mnt = mounts.remount(mnt, *options, env=s3_env)
    assert log.read_bytes() == b"step,loss\n" * 400 + b"401,0.5\n"
    wait_until(lambda: stored_version(s3_server, bucket, "metrics.csv") == 2, timeout=20)
    fresh = mounts.mount(*persist_args(s3_server, bucket), env=s3_env)
    assert (fresh / "run/metrics.csv").read_bytes() == b"step,loss\n" * 400 + b"401,0.5\n"
