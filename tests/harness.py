"""The harnesses the test modules share. In process: `Harness`, a namespace over a RAM store
in a temp dir driven through the calls pyfuse3 makes (`dcp_save` saves a step through it as
DCP does), and `UploaderHarness`, an Uploader over a file:// store with the namespace's side
played by records. Mounted: `Cluster`, daemons on 127.0.0.1 started by the real `tierfs mount`
as one cluster on a real etcd (the `cluster3` and `token_file` fixtures are in conftest.py),
and what a test reads of it: its file records, its copies, a step's bytes."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyfuse3
import trio
import trio.testing

from tests.conftest import Mount, MountFactory, free_port, wait_until
from tests.fakes import StepsForUploads
from tests.waiting import wait_until_async
from tierfs import manifest as mf
from tierfs.devtools.etcd import Etcd
from tierfs.fs.fuse.operations import Operations
from tierfs.fs.model.nodes import ROOT_INODE
from tierfs.fs.namespace import Core, Namespace
from tierfs.fs.store.ram_store import RamStore
from tierfs.observe import Events
from tierfs.replication.coordination.commit_records import CommitRecords
from tierfs.replication.coordination.etcd import Etcd as EtcdClient
from tierfs.replication.coordination.etcd import parse_cluster_url
from tierfs.s3tier.backend import BackendError, FileBackend
from tierfs.s3tier.uploader import Uploader
from tierfs.trackers import TrackedStep, is_tracker_name

CTX = SimpleNamespace(uid=os.geteuid(), gid=os.getegid(), umask=0o022, pid=os.getpid())


class Harness:
    """A namespace over a RAM store in a temp dir, with helpers that speak pyfuse3's calls;
    `tiers` are the Namespace's ports (none: a namespace with no other tier; the in-memory
    fakes of tests/fakes.py for more)."""

    def __init__(self, root: Path, limit: int = 1 << 30, *,
                 sealed_by: Callable[[Core], Any] | None = None, **tiers: Any) -> None:
        """`sealed_by`: the Namespace's `sealed` port, made from its core (a cluster's
        records number steps by the core's identity)."""
        self.root = root
        self.store = RamStore(root, limit)
        self.store.acquire()
        self.send, self.commits = trio.open_memory_channel[mf.StepManifest](100)
        self.events = Events()  # what operators would see: the metrics a test may read
        self.core = core = Core(self.store, node_id="n0")
        if sealed_by is not None:
            self.sealed = tiers["sealed"] = sealed_by(core)
        self.ns = Namespace(core, self.send, events=self.events, **tiers)
        self.ops = Operations(self.ns)

    def close(self) -> None:
        self.store.release()

    async def inode(self, path: str) -> int:
        ino = ROOT_INODE
        for part in filter(None, path.split("/")):
            ino = (await self.ops.lookup(ino, part.encode(), CTX)).st_ino
        return ino

    async def mkdirs(self, path: str) -> int:
        ino = ROOT_INODE
        for part in filter(None, path.split("/")):
            try:
                ino = (await self.ops.lookup(ino, part.encode(), CTX)).st_ino
            except pyfuse3.FUSEError:
                ino = (await self.ops.mkdir(ino, part.encode(), 0o755, CTX)).st_ino
        return ino

    async def write_file(self, path: str, data: bytes) -> None:
        parent, _, name = path.rpartition("/")
        try:
            info = await self.ops.open(await self.inode(path), os.O_WRONLY | os.O_TRUNC, CTX)
        except pyfuse3.FUSEError:
            info, _attrs = await self.ops.create(await self.mkdirs(parent), name.encode(),
                                                 0o644, os.O_WRONLY, CTX)
        await self.ops.write(info.fh, 0, data)
        await self.ops.flush(info.fh)
        await self.ops.release(info.fh)

    async def read_file(self, path: str) -> bytes:
        info = await self.ops.open(await self.inode(path), os.O_RDONLY, CTX)
        try:
            return await self.ops.read(info.fh, 0, 1 << 30)
        finally:
            await self.ops.release(info.fh)

    async def rename(self, old: str, new: str) -> None:
        old_parent, _, old_name = old.rpartition("/")
        new_parent, _, new_name = new.rpartition("/")
        await self.ops.rename(await self.inode(old_parent), old_name.encode(),
                              await self.inode(new_parent), new_name.encode(), 0, CTX)

    async def hashed(self) -> None:
        """Wait until every commit made before its files' hashes were in (the background runs:
        fs.model.pending_commits) has its manifest, and has announced it."""
        if not any(n.step.pending is not None for n in self.ns.tree.steps()):
            return
        with trio.fail_after(30):
            await wait_until_async(lambda: not any(n.step.pending is not None
                                                       for n in self.ns.tree.steps()),
                                   timeout=60, interval=0.005)
            await trio.testing.wait_all_tasks_blocked()

    async def state(self, path: str) -> str:
        return (await self.ops.getxattr(await self.inode(path), b"user.tierfs.state",
                                        CTX)).decode()


async def dcp_save(h: Harness, step: str, files: dict[str, bytes], *,
                   hashed: bool = True) -> None:
    """DCP's way: the shards, then `.metadata` renamed into place; then (`hashed`) until the
    commit's hashes are in and its manifest announced, which with the background running
    follow the rename."""
    for name, data in files.items():
        await h.write_file(f"{step}/{name}", data)
    await h.write_file(f"{step}/.metadata.tmp", b"meta")
    await h.rename(f"{step}/.metadata.tmp", f"{step}/.metadata")
    if hashed:
        await h.hashed()


def committed_step(objects: Path, path: str, files: dict[str, bytes]) -> mf.StepManifest:
    """A committed step as the namespace hands it over: objects named by their xxh3-128."""
    objects.mkdir(exist_ok=True)
    entries = []
    for name, data in files.items():
        staging = objects / "staging"
        staging.write_bytes(data)
        digest = mf.hash_file(staging)
        staging.rename(objects / digest.xxh3)
        entries.append(mf.FileEntry(name, digest.size, digest.xxh3, chunks=digest.chunks))
    step = int(re.sub(r"\D", "", path.rpartition("/")[2]))
    return mf.StepManifest(path, step, 1, "n", 0, tuple(entries))


class FailingFirst(FileBackend):
    """A file:// store whose first `failures` uploads fail as a temporary outage would."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(root)
        self.failures = failures

    def put_file(self, key: str, path: str | bytes | os.PathLike[str]) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise BackendError("503 Service Unavailable", temporary=True)
        super().put_file(key, path)


class UploaderHarness:
    """An Uploader wired to a store and to records of what it reported."""

    def __init__(self, tmp: Path, *, every: int = 1, keep: int = 0, failures: int = 0) -> None:
        self.objects = tmp / "objects"
        self.store = tmp / "store"
        self.store.mkdir()
        self.backend = FailingFirst(self.store, failures)
        self.backend.claim()
        self.current: set[str] = set()
        self.versions: dict[str, mf.StepManifest] = {}  # a tracker's current version
        self.persisted_paths: list[str] = []
        self.retired: list[str] = []
        self.steps = StepsForUploads(
            lambda xxh3: str(self.objects / xxh3), self._number,
            lambda m: m.path in self.current and self.versions.get(m.path, m) is m,
            self._on_persisted, self.retired.append, tracked_step=self._tracked)
        self.uploader = Uploader(self.backend, self.steps, persist_every=every,
                                 keep_persist=keep, events=Events())

    @staticmethod
    def _number(name: str) -> int | None:
        found = re.fullmatch(r"step_(\d+)", name)
        return int(found[1]) if found else None

    def _tracked(self, manifest: mf.StepManifest, content: bytes | None = None
                 ) -> TrackedStep | None:
        """A tracker names `run/step_<its content>` (as `OtherTiers.tracked_step` reads it:
        these bytes, else those of its object)."""
        if manifest.step != mf.NO_STEP or not is_tracker_name(manifest.path):
            return None
        if content is None:
            content = (self.objects / manifest.files[0].xxh3).read_bytes()
        number = int(content)
        path = f"run/step_{number}"
        return TrackedStep(number, path in self.current, path in self.persisted_paths)

    def tracker(self, names: int, version: int) -> mf.StepManifest:
        """Version `version` of run/latest_checkpointed_iteration.txt, naming step `names`."""
        path = "run/latest_checkpointed_iteration.txt"
        self.current.add(path)
        entry = committed_step(self.objects, "run/step_0", {
            "latest_checkpointed_iteration.txt": str(names).encode()}).files[0]
        manifest = mf.StepManifest(path, mf.NO_STEP, version, "n", 0, (entry,),
                                   single_file=True)
        self.versions[path] = manifest  # the tracker's current version from now on
        return manifest

    def _on_persisted(self, manifest: mf.StepManifest) -> None:
        self.persisted_paths.append(manifest.path)

    def step(self, path: str, files: dict[str, bytes]) -> mf.StepManifest:
        self.current.add(path)
        return committed_step(self.objects, path, files)

    async def persist(self, *manifests: mf.StepManifest,
                      until: Callable[[], bool] | None = None) -> None:
        """Submit the steps and run the uploader until it persisted those it wants (or until
        `until()` holds) and has nothing left to do."""
        wanted = [m.path for m in manifests if self.uploader.wanted(m)]
        for manifest in manifests:
            self.uploader.submit(manifest)
        condition = until or (lambda: all(p in self.persisted_paths for p in wanted))

        def done() -> bool:  # and no upload cut short by the end of the run
            return condition() and not self.uploader.queue.pending
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.uploader.run)
            await wait_until_async(done, timeout=20)
            nursery.cancel_scope.cancel()

    def stored(self) -> list[str]:
        return sorted(o.key for o in self.backend.list(""))


class Cluster:
    def __init__(self, mounts: MountFactory, token_file: Path, size: int, etcd: Etcd) -> None:
        self.mounts = mounts
        self.ports = {f"node{i}": free_port() for i in range(size)}
        # a cluster of its own in the shared etcd: its prefix is the test's tmp dir's name
        self.url = etcd.cluster_url(f"test/{mounts.tmp_path.name}")
        self.token_file = token_file
        self.nodes: dict[str, Mount] = {}

    def args(self, node_id: str) -> list[str]:
        return ["--node-id", node_id, "--cluster", self.url,
                "--listen", f"127.0.0.1:{self.ports[node_id]}",
                "--token-file", str(self.token_file)]

    def start(self, node_id: str) -> Mount:
        old = self.nodes.get(node_id)
        if old is None:
            self.nodes[node_id] = self.mounts.mount(*self.args(node_id))
        else:
            self.nodes[node_id] = self.mounts.remount(old)
        return self.nodes[node_id]

    def start_all(self, *options: str) -> list[Mount]:
        """Every node, with these options too, once each sees all the others up."""
        for node_id in self.ports:
            self.nodes[node_id] = self.mounts.mount(*self.args(node_id), *options)
        for node_id in self.ports:
            wait_until(lambda n=node_id: all(self.peers_up(n).values()), timeout=15)
        return list(self.nodes.values())

    def peers_up(self, node_id: str) -> dict[str, bool]:
        return {p["node_id"]: p["up"] for p in self.nodes[node_id].status()["peers"]}


def file_records(cluster: Cluster, step: str) -> dict[str, Any]:
    """The etcd file records of a step (name -> FileRecord): who holds which file."""
    url = parse_cluster_url(cluster.url)
    return trio.run(CommitRecords(EtcdClient(url.endpoints), url).files, step)


def copies_everywhere(cluster: Cluster, step: str, live: set[str], copies: int) -> bool:
    """Every file of the step is recorded on `copies` live nodes, each holding its object."""
    records = file_records(cluster, step)
    for record in records.values():
        holders = set(record.holders) & live
        if len(holders) < copies:
            return False
        for holder in holders:
            if not (cluster.nodes[holder].ram_dir / "objects" / record.xxh3).exists():
                return False
    return bool(records)


def check_step_bytes(node: Mount, step: str, expected: dict[str, str]) -> None:
    """Every file of the step reads back on `node` with the bytes its manifest names."""
    for name, xxh3 in expected.items():
        assert mf.hash_bytes((node / f"{step}/{name}").read_bytes()) == xxh3, name
