"""Deletes that stick: a committed step removed under the mount leaves every tier.

A delete is first recorded durably in the RAM dir (`deleted/<xxh3-64 of the path>.json`): a
*tombstone* with the step's path, the version and commit time of what was deleted, and the tiers
still to clean (`persist`, `peer:<id>`). A worker cleans them in the background (the persistent
tier: manifest first, then data; a peer: it drops its copy and records the tombstone itself),
retrying with backoff until each is done; a restart picks the records up again.

A tombstone *covers* every version of its path committed no later than the one deleted (by
`committed_ns`): such a version, found in the persistent tier at start or offered by a peer
(its commit record or a replica), is never listed again, and the tier that offered it is
cleaned once more. A step saved again at that path after the delete is a new commit and is not
covered.
Tombstones stay once their work is done, so that a node back from a long absence cannot bring
the step back either; they are a few hundred bytes each.

A rename is a delete of the old name whose data moved (`moved_to`: the step's new path; its
object keys `<old>/<name>` are now `<new>/<name>`, a single file's key is its path). Until
the new name is in the store the old objects are its bytes there: the uploader copies them
inside the store (`Backend.copy`) instead of sending them, the reader falls back to them, and
the old name leaves the store only once nothing waits for it any more (`may_clean`). A crash
in between leaves the tombstone pending, so the old name still goes after the restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
import xxhash

from tierfs import manifest as mf
from tierfs.fs.model.ports import TierError
from tierfs.fs.model.tombstones import Tombstone

log = logging.getLogger(__name__)

DELETES_DIR = "deleted"
PERSIST = "persist"
PEER_PREFIX = "peer:"
CLUSTER_RECORDS = "etcd"  # the step's records in the cluster's etcd
FIRST_RETRY = 1.0
MAX_RETRY = 30.0

Cleaner = Callable[["Tombstone", str], Awaitable[None]]


class Deletes:
    """The tombstones of one RAM dir, on disk and in memory."""

    def __init__(self, directory: Path, targets: list[str] | None = None) -> None:
        self.directory = directory
        # What a delete made on this node must clean: `persist`, `peer:<id>` (from the config).
        self.targets: list[str] = list(targets or [])
        self.changed = trio.Event()
        self._tombs: dict[str, Tombstone] = {}
        self._unsaved: set[str] = set()  # paths whose record on disk is behind (no room)
        directory.mkdir(mode=0o700, exist_ok=True)
        for entry in os.scandir(directory):
            if not entry.name.endswith(".json"):
                continue  # a temporary file of an interrupted write
            try:
                with open(entry.path, "rb") as f:
                    tomb = Tombstone.decode(f.read())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("unreadable delete record %s ignored: %s", entry.path, exc)
                continue
            self._tombs[tomb.path] = tomb

    def covers(self, manifest: mf.StepManifest) -> bool:
        tomb = self._tombs.get(manifest.path)
        return tomb is not None and tomb.covers(manifest)

    def record(self, path: str, version: int, committed_ns: int,
               targets: list[str] | None = None, *, moved_to: str | None = None,
               keep_store: bool = False) -> None:
        """A committed step at `path` was deleted (or renamed: `moved_to`): remember it (on
        disk before this returns) and have `targets` (by default every tier this node knows)
        cleaned. Raises OSError (ENOSPC: the RAM dir's file system is full) with nothing
        remembered, on disk or here: the delete or rename is refused and nothing cleans the
        step from any tier. `keep_store`: every tier but the persistent one (a loose file
        that became part of a step directory at the same key, `fs.tree.step_identity`)."""
        if keep_store:
            targets = [t for t in (self.targets if targets is None else targets)
                       if t != PERSIST]
        self.record_all([(path, version, committed_ns, moved_to)], targets)

    def record_unfinished(self, path: str) -> None:
        """A step directory was removed while its save was under way here, with no version of
        it committed here. In a cluster another node may have committed that save with this
        node's files before this node learned of it: the delete covers every version of the
        step committed before now (by this node's clock) on every tier. A save committed
        after it is a new step. On a single node nothing else commits it: nothing to record.
        Raises OSError as `record` does."""
        if CLUSTER_RECORDS in self.targets:
            self.record(path, 0, time.time_ns())

    def record_all(self, deleted: list[tuple[str, int, int, str | None]],
                   targets: list[str] | None = None) -> None:
        """`record` for several steps (path, version, committed_ns, moved_to) at once: all of
        them are on disk when this returns, or none (a rename of a run directory moves each
        of its steps, or none of them)."""
        tombs = []
        back = self._renamed_back(deleted)
        for path, version, committed_ns, moved_to in deleted:
            tomb = self._tombs.get(path)
            if tomb is None:
                tomb = Tombstone(path, version, committed_ns, moved_to=moved_to)
            else:  # changed only once the record is on disk
                tomb = dataclasses.replace(tomb, pending=set(tomb.pending))
                if committed_ns > tomb.committed_ns:  # a later version at the same path
                    if moved_to is None and PERSIST in tomb.pending:
                        # a rename not carried out in the store yet: the old objects stay the
                        # new name's bytes there until it has its own (`may_clean`)
                        moved_to = tomb.moved_to
                    tomb.version, tomb.committed_ns, tomb.moved_to = (version, committed_ns,
                                                                      moved_to)
            tomb.pending |= set(self.targets if targets is None else targets)
            tombs.append(tomb)
        tombs += back
        written: list[tuple[Path, Path]] = []
        try:
            for tomb in tombs:  # every record written before any takes the place of the old
                written.append(self._write_temp(tomb))
        except OSError:
            for tmp, _path in written:
                tmp.unlink()
            raise
        for (tmp, path), tomb in zip(written, tombs, strict=True):
            os.rename(tmp, path)
            known = self._tombs.setdefault(tomb.path, tomb)
            if known is not tomb:  # in place: the delete worker may hold it as it cleans
                known.version, known.committed_ns, known.moved_to, known.pending = (
                    tomb.version, tomb.committed_ns, tomb.moved_to, tomb.pending)
            self._unsaved.discard(tomb.path)
            if not any(tomb is b for b in back):
                log.info("deleted %s v%d; removing it from %s", tomb.path, tomb.version,
                         ", ".join(sorted(tomb.pending)) or "this node only")
        self._changed()

    def _renamed_back(self, deleted: list[tuple[str, int, int, str | None]]
                      ) -> list[Tombstone]:
        """A rename onto a name whose own rename away has not left the store yet (`mv a b;
        mv b a`): that name is a step again, so its old objects must stay in the store (its
        next version replaces them, moving no byte that did not change). The tombstones of
        those earlier renames, changed to clean the store no more (their other tiers still
        drop the old version); each would otherwise wait for the other for ever (`may_clean`)
        and the middle name would stay in the store."""
        back = []
        for _path, _version, _committed_ns, moved_to in deleted:
            tomb = self._tombs.get(moved_to) if moved_to is not None else None
            if tomb is not None and tomb.moved_to is not None and PERSIST in tomb.pending:
                back.append(dataclasses.replace(tomb, pending=tomb.pending - {PERSIST}))
                log.info("%s is back before its rename to %s left the store: it stays there",
                         tomb.path, tomb.moved_to)
        return back

    def remind(self, manifest: mf.StepManifest, tiers: list[str]) -> None:
        """A tier offers a deleted version again (a peer back from an absence, an upload that
        landed late): clean it there once more."""
        tomb = self._tombs.get(manifest.path)
        if tomb is None or not tomb.covers(manifest) or set(tiers) <= tomb.pending:
            return
        tomb.pending |= set(tiers)
        self._save_later(tomb)  # if lost, the tier offers the version again after a restart
        self._changed()
        log.info("%s v%d was deleted here, but %s still holds it: removing it there",
                 manifest.path, manifest.version, ", ".join(sorted(tiers)))

    def done(self, tomb: Tombstone, target: str) -> None:
        if target in tomb.pending:
            tomb.pending.discard(target)
            # If lost, a restart cleans that tier once more, which finds nothing to remove.
            self._save_later(tomb)

    def save_unsaved(self) -> bool:
        """Write the records that changed while the RAM dir had no room for them; whether
        all are on disk now."""
        for path in sorted(self._unsaved):
            tomb = self._tombs[path]
            try:
                os.rename(*self._write_temp(tomb))
            except OSError as exc:
                log.warning("delete record of %s not written yet: %s", path, exc)
                return False
            self._unsaved.discard(path)
        return True

    def pending(self) -> list[Tombstone]:
        return [t for t in self._tombs.values() if t.pending]

    def moves_into(self, key: str) -> list[Tombstone]:
        """Renames not finished in the store whose data went to `key` (newest first)."""
        found = [t for t in self._tombs.values()
                 if PERSIST in t.pending and t.old_key(key) is not None]
        return sorted(found, key=lambda t: -t.committed_ns)

    def sources(self, key: str, depth: int = 8) -> list[tuple[str, str]]:
        """Where the bytes of `key`, a key renamed before its new name reached the store, may
        still be: (the old step's path, its object), through renames of renames."""
        found: list[tuple[str, str]] = []
        level = [key]
        for _ in range(depth):
            step = [(t.path, old) for k in level for t in self.moves_into(k)
                    if (old := t.old_key(k)) is not None and old not in level]
            if not step:
                break
            found.extend(step)
            level = [old for _path, old in step]
        return found

    def old_keys(self, key: str) -> list[str]:
        return [old for _path, old in self.sources(key)]

    def poke(self) -> None:
        """Something a pending rename waits for happened (its new name reached the store)."""
        self.changed.set()
        self.changed = trio.Event()

    def status(self) -> dict[str, int]:
        return {"recorded": len(self._tombs), "pending": len(self.pending())}

    def _save_later(self, tomb: Tombstone) -> None:
        """Write a change of `tomb` that is already made here; if the RAM dir has no room for
        it (a /dev/shm other processes filled), the delete worker writes it once it has."""
        self._unsaved.add(tomb.path)
        self.save_unsaved()

    def _write_temp(self, tomb: Tombstone) -> tuple[Path, Path]:
        """`tomb` written and synced beside its record, for a rename into place: (temporary
        file, record); nothing is left behind when that fails (no room)."""
        name = xxhash.xxh3_64_hexdigest(tomb.path.encode())
        path = self.directory / f"{name}.json"
        tmp = self.directory / f"{name}.tmp"
        try:
            # explicit mode: the daemon's umask is 0, a plain open() would make it 0666
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(tomb.encode())
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return tmp, path

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class DeleteWorker:
    """Cleans the tiers that tombstones name, until none is left; `cleaners` maps a target's
    kind (`persist`, `peer`) to what removes a step there (raises while it cannot)."""

    def __init__(self, deletes: Deletes, cleaners: dict[str, Cleaner],
                 may_clean: Callable[[Tombstone], bool] = lambda _tomb: True) -> None:
        self.deletes = deletes
        self.cleaners = cleaners
        self.may_clean = may_clean  # a rename's old name waits for its new one

    async def run(self) -> None:
        delay = FIRST_RETRY
        while True:
            changed = self.deletes.changed
            left = await self._clean_all()
            if not left:
                delay = FIRST_RETRY
                await changed.wait()
                continue
            with trio.move_on_after(delay):
                await changed.wait()
            delay = min(MAX_RETRY, delay * 2)

    async def _clean_all(self) -> bool:
        """One pass over every pending tier of every tombstone; whether work is left (also: a
        record the RAM dir had no room for, written again at the end of each pass)."""
        left = False
        for tomb in self.deletes.pending():
            if tomb.moved_to is not None and not self.may_clean(tomb):
                left = True  # poked (Deletes.poke) when the new name is there
                continue
            for target in sorted(tomb.pending):
                kind, _, where = target.partition(":")
                cleaner = self.cleaners.get(kind)
                if cleaner is None:
                    left = True  # e.g. mounted without --persist now: kept for a later mount
                    continue
                try:
                    await cleaner(tomb, where)
                except TierError as exc:  # unreachable, refused: tried again later
                    log.info("removing deleted %s from %s failed, will retry: %s", tomb.path,
                             target, exc or type(exc).__name__)
                    left = True
                    continue
                self.deletes.done(tomb, target)
                log.info("deleted %s is gone from %s", tomb.path, target)
        return left or not self.deletes.save_unsaved()


def peer_target(node_id: str) -> str:
    return PEER_PREFIX + node_id
