"""Every call the file system makes outward, as typed Protocols, in one place.

`fs` imports no tier, no peer protocol and no daemon: what it needs from them is handed to the
constructors of its classes (see doc/ARCHITECTURE.md), in dependency order, by
`mount_helper/daemon/assembly.py` (or by a test). The Protocols below say exactly what is asked.

Outward (implemented outside `fs`):

* `CommitSink`: where a commit's manifest goes (the daemon's channel to uploads and replicas).
* `EventSink`: what operators watch: a step committed in RAM, a write refused for want of room
  (`tierfs.observe.Events` implements it: fs imports neither it nor prometheus_client).
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
  which may be (a copy on such a peer still counts as reachable: `fs.tree.recoverable`).

Errors: a port that reaches another tier fails only with a `TierError` (its adapter
translates whatever its client raises: boto's, the peer protocol's, etcd's): `ObjectMissing`
(the tier holds no such object: the next may), `CoordinationUnavailable` (etcd did not answer
or take the change by the deadline), or a plain `TierError` (down, refused, timed out); the
types are in `fs.store.tier_errors`. So a caller in `fs` catches `TierError`, and anything else is a
bug: logged with its traceback at the edge that catches everything (`fs.lifecycle.background`, the
FUSE handlers' boundary), never taken for a tier's failure. `tests/fakes.py` has an in-memory fake
of each outward port, to the same contracts.

Inward (implemented inside `fs`, injected so that the core imports no collaborator):

* `StepCopies`: what the other tiers tell the file system of a step's copies and ask it
  (`fs.lifecycle.other_tiers.OtherTiers`; the uploader, the replicator, the daemon).

* `ReadGate`: hashes a RAM object found at start before its first read (`fs.lifecycle.verify`).
* `StepWatch`: told when a step changes or a newer one starts (`fs.lifecycle.quiet_watch`).
* `RoomInRam`: room made in the RAM tier (`fs.lifecycle.eviction.Eviction`; for commits and
  append snapshots).
* `BringBack`: files brought back into the RAM tier from the others
  (`fs.lifecycle.fetch_back.FetchBack`; for commits and checks of copies).
* `CommitTiers`: what a commit asks of the cluster: the DCP shards other nodes hold, the
  records of sealed files and of the commit (`fs.lifecycle.cluster_writes.ClusterWrites`; for
  `Commits`); `LatePublication`: the commit records etcd could not take, written later
  (`ClusterWrites`; for `OtherTiers`, whose `StepCopies` the daemon calls).
* `OwedMarks`: persisted marks written once the RAM dir has room (`OtherTiers`; for the
  commits' retry round).
* `Announcer`: a version committed outside a commit call, reported as commits are
  (`fs.lifecycle.commits.Commits.announce`; for append snapshots).
* `StoreLoss`: a step the persistent tier was found to lack (`StepVersions.set_store_lost`;
  for `Eviction`).
* `KeepRam`, `Repairs`: the steps beyond --keep-ram leave RAM; bad or missing copies reported
  (`Eviction`; for `OtherTiers` and `Verifier`).
* `ManifestReader`: a step directory's committed manifest (`fs.tree.records.StepRecords`; for
  `fs.tree.step_identity`).
* `DeleteLog`: records a deleted committed step so that it leaves every tier
  (`fs.lifecycle.deletes`).
* `Spawner`: runs background work under an owner that cancels it at unmount
  (`fs.lifecycle.background`).

The lifecycle's parts name one another through these rather than by their classes, so that
its modules seldom import one another and the chain of imports inside `fs` stays short
(tests/test_structure.py holds it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tierfs import manifest as mf
from tierfs.fs.store.fetch import ReadSource, Store
from tierfs.fs.store.tier_errors import ObjectMissing, TierError

if TYPE_CHECKING:
    import trio

    from tierfs.fs.model.nodes import Node
    from tierfs.fs.model.tombstones import Tombstone
    from tierfs.trackers import TrackedStep

__all__ = ["Announcer", "BringBack", "CommitSink", "CommitTiers", "CoordinationUnavailable",
           "CopiesWait", "DeleteLog", "EventSink", "FilesOnPeers", "KeepRam",
           "LatePublication", "Liveness", "ManifestReader", "ObjectMissing", "OwedMarks",
           "PeerCopies", "PersistCopies", "ReadGate", "ReadSource", "Repairs", "RoomInRam",
           "SealedCollector", "ShardsOnPeers", "Spawner", "StepCopies", "StepWatch", "Store",
           "StoreCheck", "StoreLoss", "TierError"]


class CommitSink(Protocol):
    """Receives the manifest of every new commit (a trio memory channel's send end)."""

    async def send(self, value: mf.StepManifest) -> None: ...


class EventSink(Protocol):
    """The observer fs reports to: each report writes its event line and moves its metrics."""

    def committed(self, manifest: mf.StepManifest, seconds: float) -> None:
        """A step committed in RAM, its commit taking `seconds`."""

    def write_refused(self) -> None:
        """A call answered ENOSPC because the RAM tier was full."""


class CoordinationUnavailable(TierError):
    """The cluster's coordination (etcd) did not answer, or take a change, by the deadline it
    was given: what a `SealedCollector` raises, so that the commit waiting for it fails the
    saver's call rather than waiting on (or returning success for a step that did not
    commit). `waits_for`: what the commit waits for, as status shows it (etcd, or the nodes
    that write the step when one of them cannot say which files it wrote)."""

    ETCD = "etcd (the cluster's records of its files)"

    def __init__(self, message: str, waits_for: str = ETCD) -> None:
        super().__init__(message)
        self.waits_for = waits_for


class SealedCollector(Protocol):
    """The cluster's records of which node holds which file of a step (etcd). The calls
    given a `deadline` (trio time; None: a default of their own) return by then or raise
    `CoordinationUnavailable`."""

    async def record_sealed(self, step_path: str, entries: list[mf.FileEntry],
                            base: int) -> None:
        """Record files this node sealed into a step over its committed version `base` (0:
        none)."""

    async def note_writer(self, step_path: str, base: int) -> None:
        """This node writes files of a save of a step over its committed version `base`: the
        step's committer, wherever it is, asks this node for them (`other_writers`)."""

    async def other_writers(self, step_path: str, base: int, deadline: float,
                            previous: str | None = None) -> set[str] | None:
        """The other nodes that write files of the save of a step over `base` (once those
        that wrote the step `previous` do, or at `deadline`); None if etcd cannot say now
        (away, slow)."""

    def queue_sealed(self, step_path: str, entries: list[mf.FileEntry], base: int) -> None:
        """`record_sealed` without waiting: written by the next `write_queued`."""

    @property
    def seals_queued(self) -> bool:
        """Whether seals wait for `write_queued`."""
        ...

    async def write_queued(self) -> None:
        """Returns once the seals queued so far are recorded."""

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
    # of the files a node writes (`ShardsOnPeers.written`): those it has still open for
    # writing, the version of the step each node has committed (0: none), and the
    # directories inside the step that hold them there, by path (their owner and mode)
    writing: dict[str, str] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    dirs: dict[str, mf.DirEntry] = field(default_factory=dict)


@dataclass
class SaveHere:
    """What this node writes of the save under way of a step directory (a `WRITTEN` request
    from the step's committer): the files (step-relative names, in name order), those of them
    open for writing, the directories inside the step that hold them (step-relative path ->
    its entry, the path the mount's), and the version of the step committed here (0: none)."""

    names: list[str]
    still_open: set[str]
    dirs: dict[str, mf.DirEntry]
    version: int


class ShardsOnPeers(Protocol):
    """Asks every other node which of these files of a step it has in its tree (written
    there, recorded in etcd or not), by `deadline` (trio time); never raises (a node that
    cannot answer is in `unanswered`)."""

    async def ask(self, step_path: str, names: set[str], deadline: float) -> FilesOnPeers: ...

    async def written(self, step_path: str, nodes: set[str] | None,
                      deadline: float) -> FilesOnPeers:
        """Asks these nodes (None: every live peer) which files of the save under way of a
        step they write (`held`), which of those they have still open for writing
        (`writing`), the directories that hold them there (`dirs`), and which version of the
        step they have committed (`versions`)."""


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
    files without a record left out), or None if the records cannot be read.
    `copies_wanted`: the copies each file should have on nodes, K + 1 or one on each of the
    cluster's nodes (up or not) if there are fewer (the replica-count rule)."""

    async def verify(self, node_id: str, step_path: str, entry: mf.FileEntry,
                     repair: bool) -> str: ...

    async def file_holders(self, manifest: mf.StepManifest) -> dict[str, set[str]] | None: ...

    def copies_wanted(self) -> int: ...


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


class StepCopies(Protocol):
    """Inward: the file system's view of the copies of its steps elsewhere, as the parts that
    make and find those copies use it: the uploader, the replicator and the receiver, the
    cluster's commit follower, start-up and `tierfs status` (`fs.lifecycle.other_tiers`
    implements it). They tell it what became of a step's copies and ask it what to copy."""

    recheck_wanted: trio.Event  # set when steps' file records are to be read again

    def is_current(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is still the committed version of its step (worth uploading)."""

    def committed_manifests(self) -> list[mf.StepManifest]:
        """Committed steps whose version has not reached the persistent tier and that this node
        uploads: those made here with every file in RAM (or renamed, with files the store holds
        under their old names); in a cluster, whose uploads are shared
        (`tierfs.shared_uploads`), every step made here and every one with a file in RAM here,
        whoever made it."""

    def listed_manifests(self) -> list[mf.StepManifest]:
        """Every committed step listed here, wherever its files are."""

    def held_manifests(self) -> list[mf.StepManifest]:
        """Committed steps with files in this node's RAM, whoever wrote them (the steps whose
        copies this node may have to send)."""

    def owned_manifests(self) -> list[mf.StepManifest]:
        """Committed steps this node made and holds (not replicas it holds for others)."""

    def not_in_store(self) -> list[mf.StepManifest]:
        """Every committed step listed here whose version the persistent tier does not hold
        (nor retired from it): in a cluster, what `tierfs flush` on any node waits for,
        whichever nodes upload it."""

    def in_store(self, relpath: str) -> bool:
        """Whether the persistent tier holds the step's committed version."""

    def single_writer(self, manifest: mf.StepManifest) -> bool:
        """Whether the step's files were all written on one node, as far as this node knows (a
        multi-node step's records name several writers)."""

    def tracked_step(self, manifest: mf.StepManifest, content: bytes | None = None
                     ) -> TrackedStep | None:
        """If this version is a tracker, the step it names (the uploader holds its upload until
        that step is in the store); None if it is no tracker. `content`: the tracker's bytes
        (an older version's, or the store's), else those of this version in RAM."""

    def copy_sources(self, key: str) -> list[tuple[str, str]]:
        """Objects in the store that may hold the bytes of the object `key` of a step being
        uploaded, as (a step path whose manifest says so, the object): the old names of a file
        not in RAM here, then those of renames not finished in the store."""

    def may_copy(self, manifest: mf.StepManifest, peer: str, wanted: int,
                 is_up: Callable[[str], bool]) -> bool:
        """Whether `peer` may get a copy of this version now: not a tracker whose step is
        neither in the store, nor held whole by `peer`, nor at `wanted` verified copies of
        every file on live nodes (`is_up`; this node's counts)."""

    def named_step(self, manifest: mf.StepManifest) -> mf.StepManifest | None:
        """The committed version of the step a tracker names, as this node lists it; None if
        `manifest` is no tracker or that step is not committed here."""

    def short_of_copies(self, manifest: mf.StepManifest, replicas: int, is_up: Callable[[str],
                        bool]) -> bool:
        """Whether a file of this version here has fewer than `replicas` verified copies on
        live peers while the store does not hold it (status, flush and metrics: replication
        still due)."""

    def doubtful_steps(self, may_be_up: Callable[[str], bool]) -> list[mf.StepManifest]:
        """Committed steps, not persisted, with a file not in RAM here whose holders as known
        here are none that `may_be_up`, or are known only for the whole step (a node that holds
        no file of a step knows who holds *some* file of it) with one of them not up, and those
        `want_recheck` named: their records are read again (`note_placements`) before the step
        is called incomplete, or whole again."""

    def move_done(self, tomb: Tombstone, wanted: Callable[[mf.StepManifest], bool] | None) -> bool:
        """Whether a renamed step's old name may leave the tiers: every step at its new name is
        committed there and, with a store, in the store if due there; a rename of the new name
        that its own new name still reads through this one comes first."""

    def mark_persisted(self, manifest: mf.StepManifest) -> None:
        """The uploader put this version in the store. Its mark is written first; if the RAM
        dir's file system has no room for it, the version counts as persisted all the same (the
        store holds it: it is not uploaded again), stays in RAM until the mark is written
        (`write_owed_marks`), and the log says so once."""

    def write_owed_marks(self) -> None:
        """Write the persisted marks the RAM dir had no room for (`mark_persisted`); a step
        whose mark is written may leave RAM now. Called every half second."""

    def mark_retired(self, relpath: str) -> None:
        """Retention removed the step from the persistent tier: never upload it again."""

    def adopt_persisted(self, manifest: mf.StepManifest) -> bool:
        """Show a step found in the persistent tier (a fresh node, or one that left RAM)."""

    def store_state(self, relpath: str, version: int, state: str) -> None:
        """The cluster's records say what the persistent tier holds of the step's `version`
        (whichever node wrote it there): PERSISTED, or RETIRED by --keep-persist."""

    def mark_held(self, manifest: mf.StepManifest, peer: str, names: list[str]) -> None:
        """`peer` verified copies of these files of this version."""

    async def hold_files(self, path: str, version: int, names: list[str], sender: str
                         ) -> list[str] | None:
        """A peer sent verified copies of these files of the step's committed `version` (their
        objects are here): this node holds them now, in its copy of that version (listed from
        etcd first if this node does not know that version yet). The names now held, or None if
        this node cannot hold that version (another version is here, the name is in use, or the
        cluster does not know the step at that version)."""

    def note_placements(self, manifest: mf.StepManifest, holders: dict[str, set[str]],
                        writers: dict[str, str]) -> None:
        """Who holds and who wrote each file of this version, from the cluster's records
        (eviction judges each file by its writer: `Eviction.file_leaves`)."""

    def learn(self, manifest: mf.StepManifest, holders: list[str]) -> None:
        """A peer holds this committed step: list it here, readable from those holders."""

    def unlisted(self, path: str) -> None:
        """The cluster's commit record of the step left etcd (a delete, or no node held it any
        more): a step listed here only from it (no file in RAM here, not in the store, not
        being written) is no longer listed."""

    def delete_from_peer(self, path: str, version: int, committed_ns: int, sender: str) -> None:
        """A peer deleted this step: drop this node's copy of it (if not newer), remember the
        delete, and remove it from the persistent tier too (an upload from here may be late)."""

    def publish_later(self, manifest: mf.StepManifest) -> None:
        """A step committed here whose commit record etcd lacks: written by `publish_pending`.
        The copies this node's marks name for it are forgotten (`StepVersions.forget_holders`:
        no copy is made before its commit record, so they belong to records that are gone); the
        record written names this node, and the copies are made anew."""

    async def publish_pending(self) -> None:
        """Commit records that etcd could not take before (it was down): try again."""

    def want_recheck(self, paths: list[str] | None = None) -> None:
        """Have the file records of these steps (None: every committed step not wholly in RAM
        here) read again before they are judged (`doubtful_steps`)."""


class ReadGate(Protocol):
    """Called before a resident file is opened for reading; may take it out of service (then
    it is non-resident and its reads go to the other tiers)."""

    async def before_read_open(self, node: Node) -> None: ...


class StepWatch(Protocol):
    """Follows the steps being written (see `fs.lifecycle.quiet_watch`)."""

    def touch(self, step_node: Node, *, settled: bool = False) -> None: ...

    def step_started(self, step_node: Node) -> None: ...


class DeleteLog(Protocol):
    """The durable record of deleted steps (see `fs.lifecycle.deletes`)."""

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

    def record_unfinished(self, path: str) -> None:
        """A step removed while being saved here, none of it committed here: in a cluster,
        deleted up to now (another node may have committed it); as `record`."""
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


class RoomInRam(Protocol):
    """Room in the RAM tier, made by evicting what other tiers hold."""

    async def make_room(self, needed: int, sparing: Node | None = None) -> None:
        """`needed` bytes free in the RAM tier (evicting what other tiers hold), `sparing`'s
        step kept; `RamFull` if they cannot be."""
        ...


class BringBack(Protocol):
    """Files of other tiers brought back into the RAM tier."""

    async def make_resident(self, node: Node, *, empty: bool) -> None:
        """A file whose bytes are in another tier brought into RAM (or made empty there),
        each chunk checked, then the whole; FsError(EIO) if no tier gives it."""
        ...


class LatePublication(Protocol):
    """Commit records etcd could not take when their step committed, written later."""

    def publish_later(self, manifest: mf.StepManifest) -> None: ...

    async def publish_pending(self) -> None: ...


class CommitTiers(Protocol):
    """What a commit asks of the cluster (see `fs.lifecycle.commits`): the files of a step
    that other nodes hold (a DCP step's shards, the files of a save on several nodes), and the
    records of its sealed files and of the commit."""

    async def locate_files(self, step_node: Node, deadline: float) -> bool: ...

    async def missing_dcp_files(self, step_node: Node) -> set[str]: ...

    def held_elsewhere(self, step_node: Node) -> set[str]: ...

    def note_sealed(self, node: Node) -> None: ...

    async def publish(self, step_node: Node, manifest: mf.StepManifest,
                      deadline: float | None) -> bool: ...

    def awaits_publication(self, manifest: mf.StepManifest) -> bool: ...


class OwedMarks(Protocol):
    """Persisted marks the RAM dir had no room for, written once it has (`StepCopies`'s
    `mark_persisted`)."""

    def write_owed_marks(self) -> None: ...


class Announcer(Protocol):
    """Reports a committed version as a commit does: the cluster's record, the event."""

    async def announce(self, step_node: Node, manifest: mf.StepManifest, started: float,
                       deadline: float | None = None) -> None: ...


class StoreLoss(Protocol):
    """Takes note that the persistent tier lacks files of a step it held."""

    def set_store_lost(self, step_node: Node, lacking: list[str]) -> None: ...


class KeepRam(Protocol):
    """Keeps the RAM tier to --keep-ram steps of each run directory (those other tiers hold)."""

    def enforce_keep_ram(self) -> None: ...


class Repairs(Protocol):
    """What checks of copies (`fs.lifecycle.verify`) report when they find a copy bad or
    missing (a good copy comes back through `BringBack`)."""

    replicas: int  # the peer copies each file should have (--replicas)

    def store_lacks(self, step_node: Node, lacking: list[str], seen: str) -> None: ...

    def copies_lost(self, manifest: mf.StepManifest, names: list[str]) -> None: ...


class ManifestReader(Protocol):
    """Reads the committed manifest a step directory holds (None: none, or a damaged one)."""

    def read_manifest(self, dir_path: bytes) -> mf.StepManifest | None: ...
