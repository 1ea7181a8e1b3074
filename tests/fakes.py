"""In-memory fakes of the outward ports (`tierfs.fs.model.ports`; etcd and the cluster's members for
the coordination side), for tests that drive the core in process, on no FUSE mount, S3 server
or etcd (the layers above test those).

Each fake keeps to its port's contract, errors included: a tier that cannot answer raises
`TierError`, a missing object `ObjectMissing`, and nothing else; `BuggySource` breaks the
contract on purpose (an error of its own), which the core must never take for a tier's
failure."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model.ports import FilesOnPeers, ObjectMissing, TierError
from tierfs.replication.coordination import placement
from tierfs.replication.coordination.etcd import (
    EtcdUnavailable,
    KeyValue,
    Snapshot,
    WatchEvent,
    retry_unavailable,
)
from tierfs.replication.coordination.membership import DEFAULT_TTL, REJOIN_MARGIN, MemberInfo


class MemoryTier:
    """A persistent tier (`ReadSource`, `PersistCopies` and `StoreCheck`) in a dict: objects
    by their key (`layout.object_key`), manifests by step. `down` makes every call fail as an
    unreachable store does; `reads` counts the ranges served."""

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

    async def held_files(self, manifest: mf.StepManifest) -> set[str]:
        self._check()
        if manifest.path not in self.manifests:
            return set()
        data_dir = layout.data_dir(manifest.path, manifest.single_file)
        return {e.name for e in manifest.files
                if len(self.objects.get(layout.object_key(data_dir, e.name), b"")) == e.size
                and layout.object_key(data_dir, e.name) in self.objects}


class BuggySource(MemoryTier):
    """A read source with a bug: it fails with an error of its own, outside the contract."""

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        raise RuntimeError("a bug in a read source")


class MemoryPeers:
    """`PeerCopies`: each peer's answer about its copy of a file (`states[(peer, name)]`,
    "good" by default), peers that cannot be reached (`unreachable`), and the cluster's
    records of who holds each file (`holders`; None: the records cannot be read), and the
    copies each file should have (`copies`)."""

    def __init__(self, holders: dict[str, set[str]] | None = None, copies: int = 2) -> None:
        self.copies = copies
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

    def copies_wanted(self) -> int:
        return self.copies


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


class MemoryEtcd:
    """The key-value part of `coordination.etcd.Etcd` in a dict, with etcd's revisions and
    versions, its compare-and-swap transactions and its watches (`follow_prefix`: a snapshot,
    then every change); no leases. `down` makes every call fail as an etcd that does not
    answer (`EtcdUnavailable`), `fail_next` only the next few calls; `calls` counts the calls
    that reached it."""

    def __init__(self, timeout: float = 2.0) -> None:
        self.timeout = timeout
        self.endpoints = ["memory:2379"]
        self.last_failure: str | None = None
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 1
        self.down = False
        self.fail_next = 0
        self.calls = 0
        self._watchers: list[tuple[str, trio.MemorySendChannel[list[WatchEvent]]]] = []

    def _answer(self) -> None:
        if self.down or self.fail_next:
            self.fail_next = max(0, self.fail_next - 1)
            self.last_failure = "memory:2379 (connection refused)"
            raise EtcdUnavailable("etcd does not answer: connection refused")
        self.calls += 1

    def _put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.revision += 1
        old = self.kvs.get(key)
        kv = KeyValue(key, value, old.version + 1 if old else 1, self.revision,
                      old.create_revision if old else self.revision, lease)
        self.kvs[key] = kv
        self._notify(WatchEvent("put", kv))

    def _delete(self, key: str) -> bool:
        if self.kvs.pop(key, None) is None:
            return False
        self.revision += 1
        self._notify(WatchEvent("delete", KeyValue(key, b"", 0, self.revision)))
        return True

    def _notify(self, event: WatchEvent) -> None:
        for prefix, send in self._watchers:
            if event.kv.key.startswith(prefix):
                send.send_nowait([event])

    def _version(self, key: str) -> int:
        kv = self.kvs.get(key)
        return kv.version if kv is not None else 0

    async def get(self, key: str) -> KeyValue | None:
        self._answer()
        return self.kvs.get(key)

    async def get_all(self, keys: Sequence[str]) -> dict[str, KeyValue]:
        self._answer()
        return {key: self.kvs[key] for key in keys if key in self.kvs}

    async def get_prefix(self, prefix: str, changed_after: int = 0) -> Snapshot:
        self._answer()
        under = [kv for key, kv in sorted(self.kvs.items()) if key.startswith(prefix)]
        return Snapshot([kv for kv in under if kv.mod_revision > changed_after],
                        self.revision, len(under))

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._answer()
        self._put(key, value, lease)
        return self.revision

    async def put_all(self, items: Sequence[tuple[str, bytes]]) -> None:
        self._answer()
        for key, value in items:
            self._put(key, value)

    async def put_if_version(self, key: str, value: bytes, version: int,
                             lease: int = 0) -> bool:
        self._answer()
        if self._version(key) != version:
            return False
        self._put(key, value, lease)
        return True

    async def put_if_absent(self, key: str, value: bytes, lease: int = 0) -> bool:
        return await self.put_if_version(key, value, 0, lease)

    async def put_all_if_version(self, items: Sequence[tuple[str, bytes, int]]) -> bool:
        self._answer()
        if any(self._version(key) != version for key, _value, version in items):
            return False
        for key, value, _version in items:
            self._put(key, value)
        return True

    async def delete(self, key: str) -> bool:
        self._answer()
        return self._delete(key)

    async def delete_all(self, keys: Sequence[str]) -> None:
        self._answer()
        for key in keys:
            self._delete(key)

    async def delete_prefix(self, prefix: str) -> int:
        self._answer()
        return sum(self._delete(key) for key in [k for k in self.kvs if k.startswith(prefix)])

    async def delete_if_unchanged(self, items: Sequence[tuple[str, int]]) -> bool:
        self._answer()
        if any(key not in self.kvs or self.kvs[key].mod_revision != revision
               for key, revision in items):
            return False
        for key, _revision in items:
            self._delete(key)
        return True

    async def follow_prefix(self, prefix: str,
                            send: trio.abc.SendChannel[Snapshot | list[WatchEvent]]) -> None:
        changes, receive = trio.open_memory_channel[list[WatchEvent]](math.inf)
        snapshot = await retry_unavailable(lambda: self.get_prefix(prefix), f"reading {prefix}")
        watcher = (prefix, changes)
        self._watchers.append(watcher)
        try:
            await send.send(snapshot)
            async for batch in receive:
                await send.send(batch)
        finally:
            self._watchers.remove(watcher)

    async def aclose(self) -> None:
        pass


class StaticMembership:
    """`coordination.membership.Membership` without etcd's leases: the live members are the
    ones a test sets (`set_members`: each change is an event, as a watch would bring), and
    registering (`run`) only records that it happened."""

    def __init__(self, etcd: MemoryEtcd, node_id: str, address: str) -> None:
        self.etcd = etcd
        self.node_id = node_id
        self.info = MemberInfo(node_id, address, 0.0)
        self.members: dict[str, MemberInfo] = {}
        self.changed = trio.Event()
        self.generation = 0
        self.starting = False
        self.registered = False
        self.etcd_answers = True  # its lease's keepalives answered (there is none to lose)
        self.rejoin_grace = DEFAULT_TTL + REJOIN_MARGIN

    def set_members(self, members: dict[str, str]) -> None:
        """The live members now: {node id: HOST:PORT}."""
        self.members = {node: MemberInfo(node, address, 0.0)
                        for node, address in members.items()}
        self.generation += 1
        self.changed.set()
        self.changed = trio.Event()

    @property
    def ring(self) -> list[str]:
        return placement.ring(self.members)

    @property
    def domains(self) -> dict[str, str]:
        return {}

    @property
    def admitted(self) -> dict[str, MemberInfo]:
        return dict(self.members)

    def is_up(self, node_id: str) -> bool:
        return node_id in self.members

    def admits(self, node_id: str) -> bool:
        return node_id in self.members

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        self.registered = True
        self.set_members({**{n: i.address for n, i in self.members.items()},
                          self.node_id: self.info.address})
        task_status.started()
        await trio.sleep_forever()


class MemoryShards:
    """`ShardsOnPeers`: what each other node has written of each step (`files`: node ->
    step path -> names); the nodes in `down` cannot answer."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, set[str]]] = {}
        self.down: set[str] = set()

    async def ask(self, step_path: str, names: set[str], deadline: float) -> FilesOnPeers:
        found = FilesOnPeers({}, set())
        for node, steps in sorted(self.files.items()):
            if node in self.down:
                found.unanswered.add(node)
                continue
            for name in sorted(names & steps.get(step_path, set())):
                found.held.setdefault(name, node)
        return found


@dataclass
class StepsForUploads:
    """The uploader's port to the file system (`s3tier.uploader.UploadedSteps`) for an uploader
    tested alone: each answer a function the test gives, the rest those of plain steps."""

    object_path: Callable[[str], str]
    step_number: Callable[[str], int | None]
    is_current: Callable[[mf.StepManifest], bool]
    persisted: Callable[[mf.StepManifest], None]
    retired: Callable[[str], None] = lambda _path: None
    file_step_number: Callable[[str], int | None] = lambda _name: None
    tracked_step: Callable[..., Any] = lambda _manifest, _content=None: None
    copy_sources: Callable[[str], list[tuple[str, str]]] = lambda _key: []
    single_writer: Callable[[mf.StepManifest], bool] = lambda _manifest: True

    async def users_quiet(self) -> None:
        """No mount, no users to wait for."""
