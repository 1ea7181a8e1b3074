"""Every call the file system makes outward, as typed Protocols, in one place.

`fs` imports no tier, no peer protocol and no daemon: what it needs from them is handed to the
constructors of its classes (see doc/ARCHITECTURE.md), in dependency order, by
`mount_helper/daemon/assembly.py` (or by a test). The Protocols below say exactly what is asked.

Outward (implemented outside `fs`):

* `CommitSink`: where a commit's manifest goes (the daemon's channel to uploads and replicas).
* `ReadSource`: a tier that serves ranges of committed files (peers, the persistent tier);
  defined beside `Fetch`, which uses it, and re-exported here, with `Store`: the check and
  write of fetched bytes that a source which can (`can_store`, peers) calls where they came
  in.
* `SealedCollector`: the cluster's records of which node holds which file of a step.
* `ShardsOnPeers`: which other nodes have files of a step being written (their records late).
* `PeerCopies`, `PersistCopies`: the tiers `tierfs verify` checks and repairs.
* `StoreCheck`: what the persistent tier holds of a step now, asked before the last copy of
  a file leaves RAM on the strength of the store.
* `CopiesWait`: --sync-replicas: until every file of a committed version has its copies.
* `Liveness`: which peers are live members of the cluster now (eviction counts only those), and
  which may be (a copy on such a peer still counts as reachable: `fs.recoverable`).

Errors: a port that reaches another tier fails only with a `TierError` (its adapter
translates whatever its client raises: boto's, the peer protocol's, etcd's): `ObjectMissing`
(the tier holds no such object: the next may), `CoordinationUnavailable` (etcd did not answer
or take the change by the deadline), or a plain `TierError` (down, refused, timed out); the
types are in `fs.tier_errors`. So a caller in `fs` catches `TierError`, and anything else is a
bug: logged with its traceback at the edge that catches everything (`fs.background`, the FUSE
handlers' boundary), never taken for a tier's failure. `tests/fakes.py` has an in-memory fake
of each outward port, to the same contracts.

Inward (implemented inside `fs`, injected so that the core imports no collaborator):

* `ReadGate`: hashes a RAM object found at start before its first read (`fs.verify`).
* `StepWatch`: told when a step changes or a newer one starts (`fs.quiet_commits`).
* `DeleteLog`: records a deleted committed step so that it leaves every tier (`fs.deletes`).
* `Spawner`: runs background work under an owner that cancels it at unmount
  (`fs.background`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from tierfs import manifest as mf
from tierfs.fs.fetch import ReadSource, Store
from tierfs.fs.nodes import Node
from tierfs.fs.tier_errors import ObjectMissing, TierError

__all__ = ["CommitSink", "CoordinationUnavailable", "CopiesWait", "DeleteLog", "FilesOnPeers",
           "Liveness", "ObjectMissing", "PeerCopies", "PersistCopies", "ReadGate",
           "ReadSource", "SealedCollector", "ShardsOnPeers", "Spawner", "StepWatch", "Store",
           "StoreCheck", "TierError"]


class CommitSink(Protocol):
    """Receives the manifest of every new commit (a trio memory channel's send end)."""

    async def send(self, value: mf.StepManifest) -> None: ...


class CoordinationUnavailable(TierError):
    """The cluster's coordination (etcd) did not answer, or take a change, by the deadline it
    was given: what a `SealedCollector` raises, so that the commit waiting for it fails the
    saver's call rather than waiting on (or returning success for a step that did not
    commit)."""


class SealedCollector(Protocol):
    """The cluster's records of which node holds which file of a step (etcd). The calls
    given a `deadline` (trio time; None: a default of their own) return by then or raise
    `CoordinationUnavailable`."""

    async def record_sealed(self, step_path: str, entries: list[mf.FileEntry],
                            base: int) -> None:
        """Record files this node sealed into a step over its committed version `base` (0:
        none)."""

    async def collect(self, step_path: str, names: set[str], deadline: float, base: int
                      ) -> dict[str, tuple[str, mf.FileEntry]]:
        """Which other nodes hold these files of a step saved over its committed version
        `base`: name -> (node, entry), those recorded by this save by the deadline."""

    async def publish(self, manifest: mf.StepManifest, held_here: set[str],
                      deadline: float | None) -> None:
        """This node committed `manifest`: the cluster's commit record."""

    async def manifest_of(self, step_path: str, *, patient: bool = True
                          ) -> tuple[mf.StepManifest, list[str]] | None:
        """The step's committed manifest in the cluster and the nodes holding its files (not
        `patient`: None at once while etcd is known not to answer)."""

    async def leave_files(self, manifest: mf.StepManifest, names: list[str], need: int,
                          live: Callable[[str], bool]) -> set[str] | None:
        """This node's copies of these files are about to leave RAM: the records stop counting
        it, where they still list `need` other `live` holders when the change is made. The
        names that may leave now; None if the records could not be changed."""

    async def drop_copies(self, manifest: mf.StepManifest, names: list[str]) -> None:
        """This node's copies of these files are gone (bad): the records stop counting it,
        and the other holders restore them. CoordinationUnavailable if that could not be
        done."""

    async def writers_of(self, manifest: mf.StepManifest) -> dict[str, str] | None:
        """Which node wrote each file of this committed version, from its records (None if
        they cannot be read)."""
        ...


@dataclass
class FilesOnPeers:
    """What the other nodes said of files of a step: `held`, name -> a node that has it;
    `unanswered`, the nodes that could not say (down, unreachable, too slow): they may have
    any of them."""

    held: dict[str, str]
    unanswered: set[str]


class ShardsOnPeers(Protocol):
    """Asks every other node which of these files of a step it has in its tree (written
    there, recorded in etcd or not), by `deadline` (trio time); never raises (a node that
    cannot answer is in `unanswered`)."""

    async def ask(self, step_path: str, names: set[str], deadline: float) -> FilesOnPeers: ...


class CopiesWait(Protocol):
    """Returns once every file of this committed version has K + 1 verified copies on live
    nodes (as many as there are live nodes, if fewer), as the cluster's records say; raises
    `CoordinationUnavailable` if that is not so by `deadline` (trio time)."""

    async def __call__(self, manifest: mf.StepManifest, deadline: float) -> None: ...


class Liveness(Protocol):
    """The cluster's live members (`replication.peers.directory.PeerDirectory`). `may_be_up`:
    live, or gone so recently that its lease may have ended in an etcd outage while it lives,
    and not a member whose peer handshake fails (`replication.peers.handshakes`);
    `generation` changes whenever either answer may change."""

    def is_up(self, node_id: str) -> bool: ...

    def may_be_up(self, node_id: str) -> bool: ...

    @property
    def generation(self) -> int: ...


class PeerCopies(Protocol):
    """Asks a peer to check (and repair) its own copy of a file: good, bad, missing, repaired.
    Raises TierError when the peer cannot be reached or answers wrongly. `file_holders`:
    who holds each file of a committed version, from the cluster's records ({name: nodes},
    files without a record left out), or None if the records cannot be read."""

    async def verify(self, node_id: str, step_path: str, entry: mf.FileEntry,
                     repair: bool) -> str: ...

    async def file_holders(self, manifest: mf.StepManifest) -> dict[str, set[str]] | None: ...


class PersistCopies(Protocol):
    """The persistent tier, as much as verification needs (`step_path` of a file: the
    directory its name is relative to, `layout.data_dir`). Raises TierError (ObjectMissing
    for a missing object where a method has no None for it); `rewrite` also OSError if the
    local file cannot be read."""

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes: ...

    async def object_size(self, step_path: str, name: str) -> int | None: ...

    async def stored_size(self, step_path: str, entry: mf.FileEntry) -> int | None: ...

    async def rewrite(self, step_path: str, entry: mf.FileEntry, path: str) -> None: ...

    async def manifest(self, step_path: str, single_file: bool = False) -> bytes | None: ...

    async def write_manifest(self, step_path: str, data: bytes,
                             single_file: bool = False) -> None: ...


class StoreCheck(Protocol):
    """The persistent tier asked what it holds of a committed version at this moment (a
    listing of the step's objects, or a HEAD of a single file's; never a mark written
    earlier): the files whose objects are there at their sizes, and none at all unless the
    step's manifest is there too (a step without one is never served, and is removed).
    Raises TierError when the store cannot answer."""

    async def held_files(self, manifest: mf.StepManifest) -> set[str]: ...


class ReadGate(Protocol):
    """Called before a resident file is opened for reading; may take it out of service (then
    it is non-resident and its reads go to the other tiers)."""

    async def before_read_open(self, node: Node) -> None: ...


class StepWatch(Protocol):
    """Follows the steps being written (see `fs.quiet_commits`)."""

    def touch(self, step_node: Node) -> None: ...

    def step_started(self, step_node: Node) -> None: ...


class DeleteLog(Protocol):
    """The durable record of deleted steps (see `fs.deletes`)."""

    def record(self, path: str, version: int, committed_ns: int,
               targets: list[str] | None = None, *, moved_to: str | None = None,
               keep_store: bool = False) -> None:
        """On disk before it returns; OSError (no room) with nothing recorded. `keep_store`:
        every tier but the persistent one."""
        ...

    def record_all(self, deleted: list[tuple[str, int, int, str | None]],
                   targets: list[str] | None = None) -> None:
        """`record` for several steps (path, version, committed_ns, moved_to): all or none."""
        ...

    def old_keys(self, key: str) -> list[str]: ...

    def poke(self) -> None: ...


class Spawner(Protocol):
    """Runs `work(*args)` in the background, owned by something that cancels it at unmount;
    a failure is logged, never fatal to the mount."""

    def spawn(self, work: Callable[..., Awaitable[object]], *args: object) -> None: ...

    @property
    def running(self) -> bool:
        """Whether spawned work runs now (else it waits until the owner starts)."""
        ...
