"""Mode, owner and mtime of committed files are recorded at commit and are the same on every
tier: before a fetch (attributes from the manifest), after a read-back from the persistent tier
or a peer, and on a peer's replica."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import MountFactory, tierfs, wait_until
from tests.test_cluster import Cluster, token_file  # noqa: F401  (a fixture)
from tests.test_crash import save
from tierfs.devtools.etcd import Etcd

pytestmark = pytest.mark.cluster

MTIME_NS = 1_600_000_000_123_456_789
OWNERS = {"shard.bin": (1234, 2345, 0o640), "small": (4321, 5432, 0o604),
          ".metadata": (0, 0, 0o644)}


def save_with_attributes(step_dir: Path) -> dict[str, bytes]:
    """Files with their own mode, owner and mtime, set before `.metadata` commits the step."""
    files = {"shard.bin": os.urandom(9 << 20), "small": b"x" * 100}
    step_dir.mkdir(parents=True)
    for name, data in files.items():
        path = step_dir / name
        path.write_bytes(data)
        uid, gid, mode = OWNERS[name]
        os.chown(path, uid, gid)
        os.chmod(path, mode)
        os.utime(path, ns=(MTIME_NS, MTIME_NS + OWNERS[name][0]))
    save(step_dir, {".metadata": b"meta"})
    return files | {".metadata": b"meta"}


def attributes(path: Path) -> tuple[int, int, int, int, int]:
    st = os.stat(path)
    return (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size)


def expected(step_dir: Path, files: dict[str, bytes]) -> dict[str, tuple[int, ...]]:
    return {name: attributes(step_dir / name) for name in files}


def check_everywhere(step_dir: Path, files: dict[str, bytes],
                     want: dict[str, tuple[int, ...]]) -> None:
    """Attributes before the read (not in RAM), the bytes, then the attributes after it."""
    for name, data in files.items():
        assert attributes(step_dir / name) == want[name], f"{name} before the read"
        assert (step_dir / name).read_bytes() == data
        assert attributes(step_dir / name) == want[name], f"{name} after the read"


def test_attributes_survive_eviction_and_a_fresh_node(mounts: MountFactory,
                                                      tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--keep-ram", "1")
    files = save_with_attributes(mnt / "run/step_1")
    want = expected(mnt / "run/step_1", files)
    assert want["shard.bin"][:4] == (0o100640, 1234, 2345, MTIME_NS + 1234)
    save(mnt / "run/step_2", {"other": b"o", ".metadata": b"m"})
    tierfs("flush", str(mnt.mountpoint), "--timeout", "60")
    wait_until(lambda: not mnt.step("run/step_1")["ram"], timeout=30)
    check_everywhere(mnt / "run/step_1", files, want)  # read back from the store

    fresh = mounts.mount("--persist", f"file://{store}")  # an empty RAM dir
    assert not fresh.step("run/step_1")["ram"]
    check_everywhere(fresh / "run/step_1", files, want)
    assert fresh.step("run/step_1")["ram"]


def test_attributes_on_replicas_and_reads_from_peers(mounts: MountFactory,
                                                     token_file: Path,  # noqa: F811
                                                     etcd_server: Etcd) -> None:
    cluster = Cluster(mounts, token_file, 3, etcd_server)
    node0 = cluster.start("node0")
    node1 = cluster.start("node1")
    wait_until(lambda: cluster.peers_up("node0")["node1"], timeout=15)
    files = save_with_attributes(node0 / "run/step_1")
    want = expected(node0 / "run/step_1", files)
    wait_until(lambda: node0.step("run/step_1")["replicas"] == ["node1"], timeout=30)
    for name in files:  # the replica's own files
        assert attributes(node1 / "run/step_1" / name) == want[name], name
    node2 = cluster.start("node2")  # holds no copy: reads through the peers
    wait_until(lambda: node2.step("run/step_1") is not None, timeout=15)
    check_everywhere(node2 / "run/step_1", files, want)
