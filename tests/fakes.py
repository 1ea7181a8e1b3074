"""In-memory fakes of the file system's outward ports (`tierfs.fs.ports`), for tests that drive
the core in process, on no FUSE mount, S3 server, peer or etcd (the layers above test those).

Each fake keeps to its port's contract, errors included: a tier that cannot answer raises
`TierError`, a missing object `ObjectMissing`, and nothing else; `BuggySource` breaks the
contract on purpose (an error of its own), which the core must never take for a tier's
failure."""

from __future__ import annotations

from collections.abc import Callable

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.ports import ObjectMissing, TierError


class MemoryTier:
    """A persistent tier (`ReadSource` and `PersistCopies`) in a dict: objects by their key
    (`layout.object_key`), manifests by step. `down` makes every call fail as an unreachable
    store does; `reads` counts the ranges served."""

    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self.objects: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}
        self.down = False
        self.reads = 0

    def put_step(self, manifest: mf.StepManifest, files: dict[str, bytes]) -> None:
        data_dir = layout.data_dir(manifest.path, manifest.single_file)
        for entry in manifest.files:
            self.objects[layout.object_key(data_dir, entry.name)] = files[entry.name]
        self.manifests[manifest.path] = mf.encode(manifest)

    def _check(self) -> None:
        if self.down:
            raise TierError(f"{self.name} does not answer")

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        self._check()
        data = self.objects.get(layout.object_key(step_path, entry.name))
        if data is None:
            raise ObjectMissing(f"no object {step_path}/{entry.name}")
        self.reads += 1
        return data[offset:offset + length]

    async def object_size(self, step_path: str, name: str) -> int | None:
        self._check()
        data = self.objects.get(layout.object_key(step_path, name))
        return None if data is None else len(data)

    async def stored_size(self, step_path: str, entry: mf.FileEntry) -> int | None:
        return await self.object_size(step_path, entry.name)  # one object per file here

    async def rewrite(self, step_path: str, entry: mf.FileEntry, path: str) -> None:
        self._check()
        with open(path, "rb") as f:
            self.objects[layout.object_key(step_path, entry.name)] = f.read()

    async def manifest(self, step_path: str, single_file: bool = False) -> bytes | None:
        self._check()
        return self.manifests.get(step_path)

    async def write_manifest(self, step_path: str, data: bytes,
                             single_file: bool = False) -> None:
        self._check()
        self.manifests[step_path] = data


class BuggySource(MemoryTier):
    """A read source with a bug: it fails with an error of its own, outside the contract."""

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        raise RuntimeError("a bug in a read source")


class MemoryPeers:
    """`PeerCopies`: each peer's answer about its copy of a file (`states[(peer, name)]`,
    "good" by default), peers that cannot be reached (`unreachable`), and the cluster's
    records of who holds each file (`holders`; None: the records cannot be read)."""

    def __init__(self, holders: dict[str, set[str]] | None = None) -> None:
        self.states: dict[tuple[str, str], str] = {}
        self.unreachable: set[str] = set()
        self.holders = holders
        self.asked: list[tuple[str, str, bool]] = []

    async def verify(self, node_id: str, step_path: str, entry: mf.FileEntry,
                     repair: bool) -> str:
        if node_id in self.unreachable:
            raise TierError(f"{node_id}: connection refused")
        self.asked.append((node_id, entry.name, repair))
        return self.states.get((node_id, entry.name), "good")

    async def file_holders(self, manifest: mf.StepManifest) -> dict[str, set[str]] | None:
        return self.holders


class Liveness:
    """`Liveness`: the members a test says are up (and may be)."""

    def __init__(self, up: set[str], may_be_up: Callable[[str], bool] | None = None) -> None:
        self.up = up
        self._may_be_up = may_be_up
        self.generation = 0

    def is_up(self, node_id: str) -> bool:
        return node_id in self.up

    def may_be_up(self, node_id: str) -> bool:
        return self.is_up(node_id) or (self._may_be_up is not None
                                       and self._may_be_up(node_id))
