"""Appended loose files: a log or a TensorBoard event file under a run directory that grows for
as long as the job runs.

Two things would otherwise go wrong with such a file. Appended more often than `--commit-idle`
it never falls quiet, so it never commits and lives only in this node's RAM (lost with the
node); appended more slowly, every append commits a new version and the store would get the
whole file again each time. So:

* `AppendSnapshots` commits a loose file that has been written for `--append-every` seconds
  without committing, while it is still being written: a private copy of its bytes so far
  (the writer goes on undisturbed), sealed, becomes its next version, provided that copy
  extends the version before it (bytes are only added: a file rewritten in place waits to be
  quiet, as before, since a copy of it could be half written). A name with a checkpoint
  extension (`last.ckpt`) or a tracker (`latest`) is never committed this way: a copy of one
  being written would be a partial checkpoint.
* `lay_out` decides, at every commit of a loose file, how the persistent tier holds the new
  version (`FileEntry.segments`): a version that extends the one before it keeps that one's
  objects and adds one segment object with the new bytes (`layout.segment_key`), so only the
  appended bytes travel. A reader concatenates the file's object and its segments, in order;
  the manifest says where each starts. Once the segments together hold as much as the base,
  or there are MAX_SEGMENTS of them, the next version is one whole object again, so that
  bytes sent per byte appended stay bounded and a read needs few requests.

Whether a version extends another is decided from the chunk hashes both entries carry, plus a
hash of the new bytes of the older file's last partial chunk (at most CHUNK_SIZE read): no
whole file is read again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from typing import TYPE_CHECKING

import trio
import xxhash

from tierfs import manifest as mf
from tierfs.fs.ports import CoordinationUnavailable
from tierfs.step_names import CHECKPOINT_EXTENSIONS
from tierfs.trackers import is_tracker_name

if TYPE_CHECKING:
    from tierfs.fs.commits import Commits
    from tierfs.fs.nodes import Node
    from tierfs.fs.quiet_commits import QuietWatch
    from tierfs.fs.residency import Residency
    from tierfs.fs.tree import Tree

log = logging.getLogger(__name__)

MAX_SEGMENTS = 256  # then the next version is one whole object again
_CHECKPOINT = re.compile(CHECKPOINT_EXTENSIONS)


def extends(old: mf.FileEntry, new: mf.FileEntry, new_bytes: bytes | str) -> bool:
    """Whether the file `new` (its bytes at `new_bytes`) starts with exactly the bytes of `old`
    (blocking: reads at most one chunk)."""
    if not 0 < old.size <= new.size:
        return False
    whole, tail = divmod(old.size, mf.CHUNK_SIZE)
    if old.chunks[:whole] != new.chunks[:whole]:
        return False
    if not tail:
        return True
    with open(new_bytes, "rb") as f:
        f.seek(whole * mf.CHUNK_SIZE)
        piece = f.read(tail)
    return len(piece) == tail and xxhash.xxh3_64_hexdigest(piece) == old.chunks[whole]


def appended_to(path: bytes | str, entry: mf.FileEntry) -> bool:
    """Whether the file at `path` holds `entry`'s bytes and more after them (blocking: reads
    the entry's bytes once). At start-up: a loose file appended after its last commit keeps
    what was appended, instead of being put back as that commit."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size <= entry.size:
                return False
            hasher = xxhash.xxh3_128()
            left = entry.size
            while left and (piece := f.read(min(left, mf.CHUNK_SIZE))):
                hasher.update(piece)
                left -= len(piece)
    except FileNotFoundError:
        return False
    return not left and hasher.hexdigest() == entry.xxh3


def lay_out(old: mf.StepManifest | None, path: str, entry: mf.FileEntry,
            new_bytes: bytes | str) -> mf.FileEntry:
    """`entry`, the new version of the loose file at `path`, with the segments it is stored
    in (see the module docstring; blocking, reads at most one chunk)."""
    before = old.files[0] if old is not None and old.path == path and old.files else None
    if before is None:
        return entry
    if before.size == entry.size and before.xxh3 == entry.xxh3:
        return dataclasses.replace(entry, segments=before.segments)  # attributes only
    if not extends(before, entry, new_bytes):
        return entry  # rewritten, not appended: one whole object
    segments = (*before.segments, before.size)
    base = segments[0]
    if entry.size - base >= base or len(segments) > MAX_SEGMENTS:
        return entry
    return dataclasses.replace(entry, segments=segments)


def never_snapshot(name: bytes) -> bool:
    """A file whose copy while it is written would be a partial checkpoint or tracker."""
    text = os.fsdecode(name)
    return bool(_CHECKPOINT.search(text)) or is_tracker_name(text)


class AppendSnapshots:
    """Commits loose files still being written every `append_every` seconds (see the module
    docstring). Works on the steps the quiet watch holds: those being written."""

    def __init__(self, tree: Tree, watch: QuietWatch, commits: Commits, residency: Residency,
                 append_every: float) -> None:
        self.tree = tree
        self.watch = watch
        self.commits = commits
        self.residency = residency
        self.append_every = append_every
        self._since: dict[Node, float] = {}  # file -> when its current stretch of writes began

    def _candidate(self, node: Node) -> bool:
        step = node.step
        return (node.is_file and step is not None and step.number is None
                and node.parent is not None and node.remote is None and not step.committed
                and not never_snapshot(node.name) and self.tree.has_backing(node))

    async def run(self) -> None:
        """The daemon's background task (only with a positive `append_every`)."""
        tick = max(0.05, self.append_every / 4)
        while True:
            await trio.sleep(tick)
            now = time.monotonic()
            for node in list(self.watch.due):
                if not self._candidate(node):
                    self._since.pop(node, None)
                    continue
                since = self._since.setdefault(node, now)
                if now - since >= self.append_every:
                    self._since[node] = now
                    await self.snapshot(node)
            for node in [n for n in self._since if n not in self.watch.due]:
                del self._since[node]  # committed, removed or renamed: a new stretch later

    async def snapshot(self, node: Node) -> mf.StepManifest | None:
        """Commit what `node` holds now as its next version if that extends its last one;
        the file goes on being written. Returns the new manifest, or None."""
        try:
            return await self._snapshot(node)
        except CoordinationUnavailable as exc:
            log.info("append snapshot of %s waits for etcd: %s", self.tree.relpath(node), exc)
        except (OSError, mf.ManifestError) as exc:
            log.warning("append snapshot of %s failed: %s", self.tree.relpath(node), exc)
        except Exception:  # a bug must not take the file system down with it
            log.exception("append snapshot of %s failed", self.tree.relpath(node))
        return None

    async def _snapshot(self, node: Node) -> mf.StepManifest | None:
        tree, store = self.tree, self.tree.store
        step = node.step
        assert step is not None
        started = time.monotonic()
        async with step.lock:
            if not self._candidate(node) or node.step is not step:
                return None
            path = tree.relpath(node)
            old = step.manifest
            size = os.lstat(tree.backing(node)).st_size
            if old is not None and old.path == path and size <= old.files[0].size:
                return None  # nothing new (or shorter: not an append)
            await self.residency.make_room(size)
            if not self._candidate(node) or node.step is not step or step.manifest is not old:
                return None
            copy = await trio.to_thread.run_sync(store.copy, tree.backing(node),
                                                 os.fsencode(store.objects), size)
            store.account_path(copy)
            try:
                digest = await trio.to_thread.run_sync(mf.hash_file, copy)
                if node.step is not step or node.parent is None or step.manifest is not old:
                    return None  # removed, renamed or committed meanwhile
                manifest = self._install(node, path, old, digest, copy)
                copy = None
            finally:
                if copy is not None:
                    with contextlib.suppress(FileNotFoundError):  # or made the object
                        store.discard(copy)
        if manifest is not None:
            log.info("%s v%d: %d bytes committed while it is being appended", path,
                     manifest.version, digest.size)
            await self.commits.announce(node, manifest, started)
        return manifest

    def _install(self, node: Node, path: str, old: mf.StepManifest | None, digest: mf.Digest,
                 copy: bytes) -> mf.StepManifest | None:
        """The snapshot's commit (no await): its manifest on disk, the copy its object, the
        step's new version. The step stays `writing`: the file is still being written, and
        commits again (by this or once quiet) with what is added. None if the copy does not
        extend the last version (the copy is then removed)."""
        tree, store = self.tree, self.tree.store
        step = node.step
        entry = mf.entry_from_stat(os.fsdecode(node.name), digest, os.lstat(copy))
        if old is not None and old.path == path:
            if not extends(old.files[0], entry, copy):
                store.discard(copy)
                return None
            entry = lay_out(old, path, entry, copy)
        manifest = mf.StepManifest(
            path=path, step=mf.NO_STEP, version=old.version + 1 if old else 1,
            node_id=tree.node_id, committed_ns=time.time_ns(), files=(entry,),
            single_file=True)
        manifest_path = os.path.join(tree.records_path(node), mf.MANIFEST_NAME.encode())
        tmp = tree.records.write_temp(manifest_path, mf.encode(manifest))
        store.add_ref(entry.xxh3, tree.backing(node), copy)
        os.rename(tmp, manifest_path)
        tree.drop_resident_refs(step)
        step.manifest = manifest
        step.resident = {entry.name}
        step.commit_pending = False
        return manifest
