"""The commit's one change to the tree: a step's manifest written (temp, fsync, objects linked,
rename), its files' objects referenced in the RAM store and its state committed, all in one
synchronous call (see `fs.tree`: no await may come between the commit's last check and this);
and the step state a commit waits in (pending, what for, the files a DCP `.metadata` names).
Part of the tree's core; `fs.commits` decides when.

* `write_manifest` runs without any `await` from the moment the commit re-checks the step (no
  active writer, every file sealed, same set of files) until the manifest is renamed into place
  and the in-memory state updated: a concurrent handler sees either the old state or the new
  one, never a manifest that disagrees with the tree.
* Order on disk: write the manifest's temp file, fsync, link the objects, rename. A crash before
  the rename leaves only unreferenced objects, which start-up removes; the step stays
  `writing`. A full RAM dir fails the first of these, before anything changed."""

from __future__ import annotations

import dataclasses
import os
import time

from tierfs import manifest as mf
from tierfs.fs import append_layout
from tierfs.fs.nodes import Node, StepState
from tierfs.fs.residents import Residents
from tierfs.fs.tree_primitives import TreePrimitives


class StepManifests:
    """The commits of one mount's tree (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, residents: Residents) -> None:
        self.tree = tree
        self._residents = residents

    def write_manifest(self, step_node: Node, files: list[tuple[str, Node]],
                       copies: dict[Node, bytes]) -> mf.StepManifest:
        """The commit's change (see the module docstring: no await may come before it once
        the step is checked): the manifest on disk, the objects' references, the step state.
        Returns the old manifest if nothing changed since it. The private copies it makes
        committed objects leave `copies`; the caller removes the rest."""
        step = step_node.step
        old = step.manifest
        step_path = self.tree.relpath(step_node)
        number = mf.NO_STEP if step.number is None else step.number
        entries = []
        paths: list[bytes | None] = []  # each file's backing path, made once (10,000 files)
        for rel, node in files:
            if node.remote is not None:  # held by other nodes (a multi-node step's shards)
                entries.append(dataclasses.replace(node.remote.entry, name=rel))
                paths.append(None)
                continue
            paths.append(path := self.tree.backing(node))
            entries.append(mf.entry_from_stat(rel, node.seal.digest, os.lstat(path)))
        if step.number is None and step_node.is_file and files and files[0][1].remote is None:
            node = files[0][1]  # a loose file: appended, only its new bytes go (fs.append_layout)
            entries = [append_layout.lay_out(old, step_path, entries[0],
                                       copies.get(node) or self.tree.backing(node))]
        if (old is not None and old.path == step_path and old.step == number
                and (old.same_entries(entries) if step.attributes_changed else
                     old.same_content(mf.StepManifest(step_path, 0, 1, "", 0, tuple(entries))))):
            step.attributes_changed = False
            step.dirty = False
            step.commit_pending = False
            return old
        manifest = mf.StepManifest(
            path=step_path, step=number, version=old.version + 1 if old else 1,
            node_id=self.tree.node_id, committed_ns=time.time_ns(), files=tuple(entries),
            single_file=step_node.is_file,
        )
        manifest_path = os.path.join(self.tree.records_path(step_node), mf.MANIFEST_NAME.encode())
        tmp = self.tree.records.write_temp(manifest_path, mf.encode(manifest))  # may fail: ENOSPC
        for (_rel, node), entry, path in zip(files, entries, paths, strict=True):
            if path is not None:
                self.tree.store.add_ref(entry.xxh3, path, copies.get(node))
                copies.pop(node, None)  # the object now, or removed by add_ref
        os.rename(tmp, manifest_path)
        self._residents.drop_resident_refs(step)
        step.manifest = manifest
        step.resident = {rel for rel, node in files if node.remote is None}
        step.attributes_changed = False
        step.dirty = False
        step.commit_pending = False
        return manifest

    @staticmethod
    def leave_pending(step: StepState, reason: str | None) -> None:
        """The commit waits (`reason`, shown by status; None keeps the reason known)."""
        step.commit_pending = True
        if reason is not None:
            step.waiting_for = reason

    @staticmethod
    def note_waiting(step: StepState, reason: str | None) -> None:
        step.waiting_for = reason

    @staticmethod
    def note_dcp_files(step: StepState, key: tuple[int, int, int], names: set[str]) -> None:
        """The files a DCP `.metadata` (inode, size, mtime) names: pending commits ask again."""
        step.dcp_files = (key, names)
