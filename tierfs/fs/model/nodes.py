"""The namespace's building blocks: inodes (Node), open files (Handle), what a step directory
knows beyond its files (StepState), seals, and the names and errors the namespace uses."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.step_names import (  # noqa: F401 - re-exported
    DEFAULT_FILE_STEP_PATTERN,
    DEFAULT_STEP_PATTERN,
    some_names,
)

if TYPE_CHECKING:
    from tierfs.fs.model.latest_pins import Pin
    from tierfs.fs.model.pending_commits import PendingRecord
    from tierfs.fs.store.fetch import Fetch, RemoteFile

ROOT_INODE = 1
LATEST = b"latest"
METADATA = b".metadata"
MANIFEST = mf.MANIFEST_NAME.encode()
PERSISTED_MARK = reserved.PERSISTED.encode()
REPLICAS_MARK = reserved.REPLICAS.encode()
PEERS_MARK = reserved.PEERS.encode()
OWN_LATEST_MARK = reserved.OWN_LATEST.encode()
NAME_MAX = 255
RENAME_NOREPLACE = 1
ENOATTR = errno.ENODATA

XATTR_STATE = b"user.tierfs.state"
XATTR_TIERS = b"user.tierfs.tiers"
XATTR_XXH3 = b"user.tierfs.xxh3"
XATTR_NAMESPACE = b"user."  # the only attributes tierfs keeps: users' own, and its own below
XATTR_RESERVED = b"user.tierfs."  # tierfs's own attributes: read-only for users


class FsError(Exception):
    """A refusal with a POSIX errno; translated to FUSEError at the Operations boundary."""

    def __init__(self, errno_: int, message: str = "") -> None:
        super().__init__(message or os.strerror(errno_))
        self.errno = errno_


def size_in_blocks(size: int) -> int:
    """`st_blocks` of a regular file: its size in 512-byte blocks, rounded up, whichever tier
    holds its bytes (as mountpoint-s3 reports it), so that `du` says how much a step holds
    whether it is in RAM, evicted, or only on a peer or in the store."""
    return -(-size // 512)


@dataclass(frozen=True)
class RemoteAttrs:
    """Attributes of a file whose bytes are not in RAM (from its manifest entry)."""

    st_mode: int
    st_nlink: int
    st_uid: int
    st_gid: int
    st_size: int
    st_blocks: int
    st_atime_ns: int
    st_mtime_ns: int
    st_ctime_ns: int


@dataclass(frozen=True)
class Seal:
    """A file's hash and the backing file it describes.

    `mtime_ns` is the backing file's mtime when it was hashed (-1 when the seal comes from a
    manifest: committed objects are immutable). With passthrough the kernel writes files without
    telling the daemon, so a seal counts only while inode, size and mtime are still these."""

    digest: mf.Digest
    backing_ino: int
    mtime_ns: int = -1
    # The file's manifest entry (named as it was then), made once it had no writer left
    # (`Tree.file_settled`): a commit of 10,000 files makes and stats none of them.
    settled: mf.FileEntry | None = None

    def describes(self, st: os.stat_result) -> bool:
        return (st.st_ino == self.backing_ino and st.st_size == self.digest.size
                and self.mtime_ns in (-1, st.st_mtime_ns))

    def restamped(self, st: os.stat_result, name: str | None = None) -> Seal:
        """The same bytes after a change of metadata only (chmod, utime), or settled (no
        writer left) as `name`: `st`'s mtime, and its manifest entry if settled before."""
        if name is None and self.settled is not None:
            name = self.settled.name
        settled = None
        if name is not None:
            settled = mf.entry_from_stat(name, self.digest, st)
            settled.encoded  # noqa: B018 -- packed now, off its commit's path
        return Seal(self.digest, self.backing_ino, st.st_mtime_ns, settled)

    def entry(self, name: str) -> mf.FileEntry:
        """The manifest entry of a settled file, as `name`."""
        assert self.settled is not None
        return self.settled if self.settled.name == name else dataclasses.replace(
            self.settled, name=name)


@dataclass
class Pending:
    """A step's commit made before its files' hashes were in (`fs.model.pending_commits`): its
    record, and for each file the node and its generation at the commit (its seal is joined
    while it is still those bytes)."""

    record: PendingRecord
    nodes: dict[str, tuple[Node, int]] = field(default_factory=dict)
    superseded: bool = False  # the step was changed since: a new version is being written
    # Finishes that failed for want of room for the manifest (the RAM dir's file system
    # full): the daemon tries again from `retry_at` (trio time; with a growing pause, since a
    # file changed since the commit is hashed again each time), not only at the step's next
    # commit (`Commits.retry_pending_commits`).
    failures: int = 0
    retry_at: float | None = None


class StepState:
    """What tierfs knows about one step beyond its files: a step directory, or a single file
    (a file step, or a loose file: `number` None, never counted by retention nor `latest`)."""

    def __init__(self, number: int | None, manifest: mf.StepManifest | None = None) -> None:
        self.number = number
        self.manifest = manifest
        self.dirty = manifest is None
        # A step directory never committed that went quiet holding no file (a `mkdir` whose
        # saver wrote nothing, `cp -al` of a run, whose hard links are refused): nothing to
        # commit, and nothing only in RAM; it shows `empty` until something changes in it.
        self.empty = False
        self.commit_pending = False
        self.waiting_for: str | None = None  # why a commit is pending (status shows it)
        # Commits of it that failed in a row for want of the cluster (etcd, a node that
        # writes it): the next retry waits until `retry_commit_at` (trio time), a pause that
        # grows with them (`Commits.retry_pending_commits`).
        self.coordination_failures = 0
        self.retry_commit_at = 0.0
        # The files its DCP .metadata names, and which .metadata (inode, size, mtime) said so.
        self.dcp_files: tuple[tuple[int, int, int], set[str]] | None = None
        self.lock = trio.Lock()
        self.persisted_version = 0
        self.retired_version = 0
        # The files of the committed version the store was seen to lack, though it was
        # believed to hold it (`StepVersions.set_store_lost`): the others it still holds.
        self.store_lacking: frozenset[str] = frozenset()
        # Persisted, but the mark could not be written yet (the RAM dir's file system full):
        # nothing leaves RAM for the store until it is (`OtherTiers.write_owed_marks`).
        self.persist_mark_owed = False
        # chmod, chown or utime of a file since the last commit: a version of new attributes
        # (a file written again with the same bytes is no new version, whatever its mtime)
        self.attributes_changed = False
        # Manifest entries whose committed object is in RAM (and counted in the store's refs).
        self.resident: set[str] = {f.name for f in manifest.files} if manifest else set()
        self.replicas: set[str] = set()  # peers that acknowledged this version
        self.holders: set[str] = set()  # peers holding some file of this version (etcd)
        # Per file of this version: the peers holding a verified copy, as the cluster's file
        # records say (a file missing here: only the step-level sets above are known).
        self.file_holders: dict[str, set[str]] = {}
        # Per file of this version: the node that wrote it, as the cluster's file records say
        # (a file missing here has no known writer; `fs.tree.recoverable` names it in a loss).
        self.file_writers: dict[str, str] = {}
        # A version committed whose files' hashes are not in yet (fs.model.pending_commits): no
        # manifest of it yet, so everything that needs one sees the step as being written.
        self.pending: Pending | None = None

    @property
    def committed(self) -> bool:
        """A committed version, its manifest in force and nothing changed since."""
        return self.manifest is not None and not self.dirty

    @property
    def base(self) -> int:
        """The version of its manifest (0: none): the committed version a save of it is
        over, which its seal and writer records name."""
        return self.manifest.version if self.manifest is not None else 0

    @property
    def shown_committed(self) -> bool:
        """Committed as the user sees it (state, `latest`): also a version whose hashes are
        still being computed, until the step changes again."""
        return self.committed or (self.pending is not None and not self.pending.superseded)

    @property
    def state(self) -> str:
        if self.shown_committed:
            return "committed"
        return "empty" if self.empty else "writing"

    @property
    def persisted(self) -> bool:
        return self.committed and self.persisted_version == self.manifest.version

    @property
    def persisted_on_record(self) -> bool:
        """Persisted, and its mark on disk: copies may leave RAM for the store (a restart
        that found no mark would take a step whose files are not here for a damaged one)."""
        return self.persisted and not self.persist_mark_owed

    @property
    def in_ram(self) -> bool:
        return self.manifest is None or len(self.resident) == len(self.manifest.files)


class Node:
    __slots__ = ("ino", "kind", "name", "parent", "children", "lookups", "handles",
                 "active_writers", "gen", "seal", "step", "virtual", "remote", "fetch",
                 "anchor_fd", "own_latest", "written_whole", "dir_attrs", "__weakref__")

    def __init__(self, ino: int, kind: int, name: bytes, parent: Node | None) -> None:
        self.ino = ino
        self.kind = kind
        self.name = name
        self.parent = parent
        self.children: dict[bytes, Node] | None = {} if kind == stat.S_IFDIR else None
        self.lookups = 0
        self.handles: list[Handle] = []
        self.active_writers = 0
        self.gen = 0
        self.seal: Seal | None = None
        self.step: StepState | None = None
        self.virtual = False
        # A committed file whose bytes are not in RAM: where they are, and the partial copy.
        self.remote: RemoteFile | None = None
        self.fetch: Fetch | None = None
        self.anchor_fd = -1  # a deep directory held open for long paths (fs.store.long_paths)
        # A directory whose `latest` is its own, never the virtual link (VirtualLatest.is_own).
        self.own_latest = False
        # A file whose writers' opens created or truncated it: what they wrote is all of it, so
        # a loose file commits a moment after their close (`Commits.commit_file_step`).
        self.written_whole = False
        # A directory's attributes as last read: what a descriptor held open on it answers
        # once it is removed (`Tree.stat`).
        self.dir_attrs: os.stat_result | None = None

    @property
    def is_dir(self) -> bool:
        return self.kind == stat.S_IFDIR

    @property
    def is_file(self) -> bool:
        return self.kind == stat.S_IFREG

    @property
    def open_fd(self) -> int:
        """A descriptor of the file held by one of its open handles (-1 if none has one: a
        handle opened before its bytes came back); what answers once its name is gone."""
        return next((h.fd for h in self.handles if h.fd >= 0), -1)

    @property
    def open_for_writing(self) -> bool:
        """Whether a handle could write the file (the kernel may, under passthrough, without
        the daemon seeing)."""
        return bool(self.handles) and any(h.writable for h in self.handles)


class Handle:
    """An open file: the backing fd and whether it has written since its last flush.

    A passthrough handle's reads and writes go from the kernel straight to its backing file."""

    __slots__ = ("fh", "node", "fd", "backing_ino", "writable", "active", "passthrough",
                 "flushes", "pin", "pid")

    def __init__(self, fh: int, node: Node, fd: int, writable: bool, pid: int = 0,
                 backing_ino: int | None = None) -> None:
        self.fh = fh
        self.node = node
        self.fd = fd  # -1 while the node's bytes are fetched from another tier
        # the fd's inode (given where the opener has fstat it already)
        if backing_ino is None:
            backing_ino = os.fstat(fd).st_ino if fd >= 0 else 0
        self.backing_ino = backing_ino
        self.writable = writable
        self.active = False
        self.passthrough = False
        self.flushes = 0  # FLUSHes seen: more than one means duplicated descriptors
        self.pin: Pin | None = None  # the `latest` target its process keeps while it is open
        self.pid = pid  # the thread that opened it (FUSE's request), 0 if not known

