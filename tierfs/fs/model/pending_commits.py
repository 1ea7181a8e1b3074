"""Pending commits: a step committed before its files' hashes are in (issue 25).

A saver's call that commits (DCP's `.metadata`) does not wait for the xxh3-128 of the files
still being hashed. The commit then happens in two parts (`fs.lifecycle.commits`):

1. What the saver's call waits for, with no await between the commit's last check and it
   (`StepManifests.write_pending`): every file of the step gets a *snapshot* in `objects/`
   under a name of its own (`.tierfs-snapshot-<key>`): a hard link of its backing file, or the
   private copy made of a file a handle could still write into. A snapshot shares its inode
   with the tree file, so copy on write (`fs.tree.copy_on_write`) keeps the committed bytes from
   any later writer exactly as it keeps committed objects. Then the *pending record* (this
   module's `PendingRecord`: the version, and each file's name, size, mode, owner, mtime and
   snapshot) is written atomically into the step's records (`.tierfs-pending`, temp, fsync,
   rename): the commit point. The step is `committed` from here (`StepState.shown_committed`),
   `latest` may name it, and a crash brings it back committed.
2. In the background, under the step's lock (`Commits._finish_pending`): each snapshot's hash
   (the file's own seal when it is still those bytes: its background hash is joined, never
   repeated), then the manifest exactly as a commit that waited would have written it
   (`StepManifests.finish_pending`: snapshots linked as `objects/<xxh3>`, the manifest renamed
   into place, then the record removed and the snapshots: a crash at any point finds either
   the record with every snapshot or the manifest), and only then the cluster's record and
   the `CommitSink` (peers, store). Nothing of the step leaves the node before.

A step written again while its hashes run starts a new version (`nodes.Pending.superseded`, and its
state is `writing` again); that version's commit waits for the pending one to be finished
(the step's lock). A step removed or renamed away from a step name before its hashes are in
loses the pending version with it (it never left the node). Start-up (`fs.lifecycle.recovery`)
finishes a pending record it finds without a newer manifest: it hashes the snapshots and writes the
manifest before anything is served.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgpack

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.msgpack_map import decode_map

PENDING_NAME = reserved.PENDING.encode()  # in a step's records directory
SNAPSHOT_PREFIX = reserved.SNAPSHOT  # in objects/
FORMAT = 1
_KEY = re.compile(r"^[0-9a-f]{32}$")


class PendingError(ValueError):
    """A pending record that cannot be decoded."""


@dataclass(frozen=True)
class PendingFile:
    """One file of a pending commit, as it was committed (its hash is not known yet)."""

    name: str
    size: int
    mtime_ns: int
    mode: int
    uid: int
    gid: int
    snapshot: str  # the key of its snapshot in objects/ (`snapshot_name`)

    def entry(self, digest: mf.Digest) -> mf.FileEntry:
        """The manifest entry, once its hash is in."""
        return mf.FileEntry(self.name, self.size, digest.xxh3, self.mtime_ns, self.mode,
                            digest.chunks, self.uid, self.gid, blocks=digest.blocks)


@dataclass(frozen=True)
class PendingRecord:
    """What a pending commit recorded durably: the version it makes and its files."""

    version: int
    committed_ns: int
    files: tuple[PendingFile, ...]


def snapshot_name(key: str) -> str:
    return SNAPSHOT_PREFIX + key


def encode(record: PendingRecord) -> bytes:
    return msgpack.packb({
        "format": FORMAT, "version": record.version, "committed_ns": record.committed_ns,
        "files": [[f.name, f.size, f.mtime_ns, f.mode, f.uid, f.gid, f.snapshot]
                  for f in record.files]}, use_bin_type=True)


def decode(data: bytes) -> PendingRecord:
    """Decode and validate (PendingError if malformed: it came off the RAM dir)."""
    raw = decode_map(data, PendingError, "pending record", kind=FORMAT)
    try:
        files = []
        for name, size, mtime_ns, mode, uid, gid, key in raw["files"]:
            if not (isinstance(name, str) and isinstance(key, str) and _KEY.match(key)
                    and all(isinstance(v, int) and not isinstance(v, bool)
                            for v in (size, mtime_ns, mode, uid, gid))
                    and size >= 0 and 0 <= mode <= 0o7777):
                raise PendingError(f"bad pending file {name!r}")
            files.append(PendingFile(mf.check_relative_path(name), size, mtime_ns, mode, uid,
                                     gid, key))
        version, committed_ns = raw["version"], raw["committed_ns"]
        if not (isinstance(version, int) and version >= 1 and isinstance(committed_ns, int)):
            raise PendingError("bad pending version")
    except PendingError:
        raise
    except Exception as exc:  # msgpack and unpacking raise several unrelated types
        raise PendingError(f"not a pending record: {exc!r}") from None
    if len({f.name for f in files}) != len(files):
        raise PendingError("duplicate file names")
    return PendingRecord(version, committed_ns, tuple(files))
