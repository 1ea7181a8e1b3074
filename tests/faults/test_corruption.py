"""Corruption: flipped bytes in the RAM store, in a peer's replica and in S3 objects.

Reads return the right bytes (from another tier) or fail with EIO, never wrong bytes, and
`tierfs verify` finds every bad copy, repairs it from a good one, and says so; where no good
copy exists it fails with one line. What the design promises for the RAM tier is checked as
promised: a RAM object corrupted while no daemon watched is caught at start (background scan,
or first open), one corrupted under a running daemon is caught by `tierfs verify`."""

from __future__ import annotations

import errno
import json
import random
import time
from collections import Counter
from pathlib import Path

import pytest
import xxhash

from tests.conftest import Mount, MountFactory, getxattr, tierfs, wait_until
from tests.faults.results_io import flip_byte, pick, write_results
from tests.harness import Cluster
from tests.test_crash import save
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd
from tierfs.devtools.seaweed import SeaweedS3

pytestmark = pytest.mark.faults

SHARD = "__0_0.distcp"


def step_files(rng: random.Random, megabytes: int) -> dict[str, bytes]:
    return {SHARD: rng.randbytes(megabytes << 20), "__1_0.distcp": rng.randbytes(5000),
            ".metadata": b"meta"}


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def write(self, name: str, started: float) -> None:
        """No wrong bytes, ever; then the counts, for doc/RELIABILITY.md's table."""
        counts = dict(self.counts)
        assert counts.get("wrong_bytes", 0) == 0
        write_results(name, {
            **counts, "corruptions": sum(v for k, v in counts.items()
                                         if k.startswith("corruptions")),
            "wrong_bytes": 0, "seconds": round(time.monotonic() - started, 1)})

    def read(self, path: Path, expected: bytes, *, may_fail: bool) -> bool:
        """Read a whole file through the mount: right bytes, or EIO where allowed."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            assert exc.errno == errno.EIO, exc
            assert may_fail, f"{path}: EIO although a good copy exists"
            self.counts["reads_eio"] += 1
            return False
        if data != expected:
            self.counts["wrong_bytes"] += 1
            raise AssertionError(f"wrong bytes served for {path}")
        self.counts["reads_ok"] += 1
        return True

    def verify(self, mnt: Mount, relpath: str, *, expect_ok: bool,
               env: dict[str, str] | None = None) -> dict[str, object]:
        done = tierfs("verify", str(mnt / relpath), "--json", check=False, env=env,
                      timeout=300)
        self.counts["verify_runs"] += 1
        report = json.loads(done.stdout)
        if expect_ok:
            assert done.returncode == 0, done.stderr
        else:
            assert done.returncode == 1, done.stdout
            assert done.stderr.count("\n") == 1 and done.stderr.startswith("tierfs: verify: ")
        self.counts["copies_repaired"] += sum(len(t["repaired"]) for s in report["steps"]
                                              for t in s["tiers"])
        return report


def tier(report: dict[str, object], step: str, name: str) -> dict[str, object]:
    for s in report["steps"]:  # type: ignore[attr-defined]
        if s["path"] == step:
            for t in s["tiers"]:
                if t["tier"] == name:
                    return t
    raise AssertionError(f"no tier {name} for {step} in {report}")


def object_of(mnt: Mount, path: Path) -> Path:
    return mnt.ram_dir / "objects" / getxattr(path, "user.tierfs.xxh3")


def flip_s3(client, bucket: str, key: str, offset: int) -> bytes:  # type: ignore[no-untyped-def]
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    original = bytes(body)
    body[offset] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    return original


def test_corruption_in_ram_and_s3_single_node(mounts: MountFactory, s3_server: SeaweedS3,
                                              bucket: str, s3_env: dict[str, str]) -> None:
    started = time.monotonic()
    rng = random.Random(4)
    tally = Tally()
    client = s3_server.client()
    megabytes = pick(20, 40)
    args = ("--persist", f"s3://{bucket}/ckpt", "--s3-endpoint", s3_server.endpoint,
            "--persist-every", "2", "--keep-ram", "2")
    mnt = mounts.mount(*args, env=s3_env)
    for round_ in range(pick(1, 6)):
        run = f"run{round_}"
        # step_1: RAM only (not persisted); step_2: evicted, in S3 only; step_3: RAM only;
        # step_4: RAM and S3.
        saved = {n: step_files(rng, megabytes) for n in (1, 2, 3, 4)}
        for number, files in saved.items():
            save(mnt / f"{run}/step_{number}", files)
        tierfs("flush", str(mnt.mountpoint), "--timeout", "120", env=s3_env)
        wait_until(lambda r=run, m=mnt: not m.step(f"{r}/step_2")["ram"], timeout=30)
        shard = saved[4][SHARD]
        assert tally.verify(mnt, run, expect_ok=True)

        # 1. RAM, under a running daemon: `tierfs verify` finds it and fetches it from S3.
        offset = rng.randrange(len(shard))
        flip_byte(object_of(mnt, mnt / f"{run}/step_4" / SHARD), offset)
        tally.counts["corruptions:ram_live"] += 1
        report = tally.verify(mnt, f"{run}/step_4", expect_ok=True)
        assert tier(report, f"{run}/step_4", "ram")["repaired"] == [SHARD]
        assert tier(report, f"{run}/step_4", "persist")["good"] == 3
        tally.read(mnt / f"{run}/step_4" / SHARD, shard, may_fail=False)
        assert mf.hash_file(object_of(mnt, mnt / f"{run}/step_4" / SHARD)).xxh3 == \
            xxhash.xxh3_128_hexdigest(shard)

        # 2. RAM, while no daemon watched: caught at start; a persisted file comes back from
        # S3, one with no other copy reads as EIO and `verify` says it is lost.
        offset4, offset3 = rng.randrange(len(shard)), rng.randrange(len(shard))
        obj4 = object_of(mnt, mnt / f"{run}/step_4" / SHARD)
        obj3 = object_of(mnt, mnt / f"{run}/step_3" / SHARD)
        mnt.kill9()
        flip_byte(obj4, offset4)
        flip_byte(obj3, offset3)
        tally.counts["corruptions:ram_at_rest"] += 2
        mnt = mounts.remount(mnt, env=s3_env)
        tally.read(mnt / f"{run}/step_4" / SHARD, shard, may_fail=False)
        tally.read(mnt / f"{run}/step_3" / SHARD, saved[3][SHARD], may_fail=True)
        with open(mnt / f"{run}/step_3" / SHARD, "rb") as f:
            try:
                f.read(1 << 20)
                raise AssertionError("a corrupt RAM object with no other copy was served")
            except OSError as exc:
                assert exc.errno == errno.EIO
                tally.counts["reads_eio"] += 1
        for name in ("__1_0.distcp", ".metadata"):  # the good files of that step still read
            tally.read(mnt / f"{run}/step_3" / name, saved[3][name], may_fail=False)
        wait_until(lambda m=mnt: m.status()["ram_check"]["done"], timeout=60)
        assert "in this node's RAM has xxh3" in mnt.log()
        report = tally.verify(mnt, f"{run}/step_3", expect_ok=False)
        assert tier(report, f"{run}/step_3", "ram")["bad"] == [SHARD]
        assert tier(report, f"{run}/step_3", "any tier")["bad"] == [SHARD]
        tally.counts["unrecoverable_detected"] += 1
        tally.verify(mnt, f"{run}/step_4", expect_ok=True)

        # 3. S3, a step that left RAM: reads of the bad chunk fail, good chunks read; verify
        # reports it and, with no good copy anywhere, exits 1.
        key = f"ckpt/{run}/step_2/{SHARD}"
        bad_chunk = rng.randrange(mf.chunk_count(len(shard)))
        offset = bad_chunk * mf.CHUNK_SIZE + rng.randrange(1000)
        original = flip_s3(client, bucket, key, offset)
        tally.counts["corruptions:s3_only_copy"] += 1
        good_chunk = (bad_chunk + 1) % mf.chunk_count(len(shard))
        with open(mnt / f"{run}/step_2" / SHARD, "rb") as f:
            f.seek(good_chunk * mf.CHUNK_SIZE)
            assert f.read(4096) == original[good_chunk * mf.CHUNK_SIZE:][:4096]
            f.seek(offset)
            try:
                f.read(100)
                tally.counts["wrong_bytes"] += 1
                raise AssertionError("a corrupt S3 chunk was served")
            except OSError as exc:
                assert exc.errno == errno.EIO
                tally.counts["reads_eio"] += 1
        report = tally.verify(mnt, f"{run}/step_2", expect_ok=False)
        assert tier(report, f"{run}/step_2", "persist")["bad"] == [SHARD]
        tally.counts["unrecoverable_detected"] += 1
        client.put_object(Bucket=bucket, Key=key, Body=original)  # the operator restores it
        tally.read(mnt / f"{run}/step_2" / SHARD, original, may_fail=False)

        # 4. S3, a step also in RAM: reads come from RAM; verify uploads the object again.
        key = f"ckpt/{run}/step_4/{SHARD}"
        flip_s3(client, bucket, key, rng.randrange(len(shard)))
        tally.counts["corruptions:s3_with_ram_copy"] += 1
        tally.read(mnt / f"{run}/step_4" / SHARD, shard, may_fail=False)
        report = tally.verify(mnt, run, expect_ok=False)  # step_3 stays lost
        assert tier(report, f"{run}/step_4", "persist")["repaired"] == [SHARD]
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == shard
        human = tierfs("verify", str(mnt / run), check=False, env=s3_env)  # the table a user sees
        assert human.returncode == 1 and f"{run}/step_4 v1: 3 files" in human.stdout
        assert f"any tier: 1 BAD ({SHARD})" in human.stdout, human.stdout
        assert human.stderr == f"tierfs: verify: 1 file of {run}/step_3 has no reachable " \
            f"copy: {SHARD} (last held by {mnt.status()['node_id']})\n", human.stderr
        tally.counts["detected"] += 5
    tally.write("corruption_single_node", started)


def test_corruption_in_replicas(mounts: MountFactory, token_file: Path,  # noqa: F811
                                etcd_server: Etcd) -> None:
    """Three nodes, one replica each (node0 writes, node1 holds the copies, node2 reads): a bad
    replica is never served to a reader on another node, `verify` on the writer repairs the
    peer's copy and its own from each other, and a node that restarts with a bad replica
    repairs it from the writer at start."""
    started = time.monotonic()
    rng = random.Random(5)
    tally = Tally()
    megabytes = pick(12, 30)
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0 = cluster.mounts.mount(*cluster.args("node0"), "--keep-ram", "1")
    cluster.nodes["node0"] = node0
    node1 = cluster.start("node1")
    node2 = cluster.start("node2")
    for node_id in cluster.ports:
        wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)
    for round_ in range(pick(1, 5)):
        run = f"run{round_}"
        saved = {n: step_files(rng, megabytes) for n in (1, 2)}
        for number, files in saved.items():
            save(node0 / f"{run}/step_{number}", files)
        # both steps copied (step_2's copy may be recorded before step_1's)
        wait_until(lambda r=run, n=node0: all(n.step(f"{r}/step_{k}")["replicas"] == ["node1"]
                                              for k in (1, 2)), timeout=60)
        shard1, shard2 = saved[1][SHARD], saved[2][SHARD]

        # 1. The only live copy of step_1 (node1's replica: its writer node0 is down) goes
        # bad: node2 reads it from node1 and gets EIO for the bad chunk, never the bytes.
        offset = rng.randrange(len(shard1))
        flip_byte(object_of(node1, node1 / f"{run}/step_1" / SHARD), offset)
        tally.counts["corruptions:only_replica"] += 1
        node0.kill9()
        wait_until(lambda: cluster.peers_up("node2")["node0"] is False, timeout=15)
        with open(node2 / f"{run}/step_1" / SHARD, "rb") as f:
            f.seek(offset - offset % mf.CHUNK_SIZE)
            try:
                f.read(mf.CHUNK_SIZE)
                tally.counts["wrong_bytes"] += 1
                raise AssertionError("a corrupt replica was served to a peer")
            except OSError as exc:
                assert exc.errno == errno.EIO
                tally.counts["reads_eio"] += 1
        assert "does not match its checksum" in node2.log()
        report = tally.verify(node2, f"{run}/step_1", expect_ok=False)
        assert tier(report, f"{run}/step_1", "peer:node1")["bad"] == [SHARD]
        tally.counts["unrecoverable_detected"] += 1
        node0 = cluster.start("node0")  # with its RAM: its good copies are back
        for node_id in cluster.ports:
            wait_until(lambda n=node_id: all(cluster.peers_up(n).values()), timeout=15)

        # 2. node1's replica of step_2 goes bad: verify on node0 has node1 repair it.
        flip_byte(object_of(node1, node1 / f"{run}/step_2" / SHARD), rng.randrange(len(shard2)))
        tally.counts["corruptions:replica"] += 1
        report = tally.verify(node0, f"{run}/step_2", expect_ok=True)
        assert tier(report, f"{run}/step_2", "peer:node1")["repaired"] == [SHARD]
        assert tier(report, f"{run}/step_2", "ram")["good"] == 3
        assert mf.hash_file(object_of(node1, node1 / f"{run}/step_2" / SHARD)).xxh3 == \
            xxhash.xxh3_128_hexdigest(shard2)
        tally.read(node1 / f"{run}/step_2" / SHARD, shard2, may_fail=False)

        # 3. node0's own copy goes bad: verify repairs it from node1.
        flip_byte(object_of(node0, node0 / f"{run}/step_2" / SHARD), rng.randrange(len(shard2)))
        tally.counts["corruptions:writer_ram"] += 1
        report = tally.verify(node0, f"{run}/step_2", expect_ok=True)
        assert tier(report, f"{run}/step_2", "ram")["repaired"] == [SHARD]
        tally.read(node0 / f"{run}/step_2" / SHARD, shard2, may_fail=False)

        # 4. node1 goes down, its replica is damaged meanwhile: at start it is caught and
        # fetched again from node0; readers on node1 get the right bytes.
        obj = object_of(node1, node1 / f"{run}/step_2" / SHARD)
        node1.kill9()
        flip_byte(obj, rng.randrange(len(shard2)))
        tally.counts["corruptions:replica_at_rest"] += 1
        node1 = cluster.start("node1")
        tally.read(node1 / f"{run}/step_2" / SHARD, shard2, may_fail=False)
        wait_until(lambda n=node1: n.status()["ram_check"]["done"], timeout=60)
        assert node1.status()["ram_check"]["bad"] >= 1
        wait_until(lambda: all(cluster.peers_up("node0").values()), timeout=15)
        report = tally.verify(node0, f"{run}/step_2", expect_ok=True)
        assert tier(report, f"{run}/step_2", "peer:node1")["good"] == 3
        tally.counts["detected"] += 4
    tally.write("corruption_replicas", started)
