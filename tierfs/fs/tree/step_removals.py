"""A step leaving its name: the delete of its committed version from every tier recorded (an
`rm -r`'s rmdir, an unlink, a rename over it), and tierfs's own entries of it removed (its
manifest, a single file's records, its references to committed objects). Part of the tree's
core (see `fs.tree.tree`): it changes nodes and step state only through `Tree`'s primitives and
by the same rules; each change is one synchronous method."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from tierfs import layout
from tierfs.fs.store.ram_store import is_reserved
from tierfs.fs.tree.dir_attributes import times_kept

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import Node, StepState
    from tierfs.fs.model.ports import DeleteLog, ManifestReader
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.tree_primitives import TreePrimitives


class StepRemovals:
    """What a step leaving its name removes and records (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, deletes: DeleteLog, *, residents: Residents,
                 records: ManifestReader, store: RamStore) -> None:
        self.tree = tree
        self._deletes = deletes
        self._residents = residents
        self._records = records
        self._store = store

    def directory_removed(self, node: Node, path: bytes) -> None:
        """An empty directory at `path` is about to go (rmdir): a step's save left unfinished,
        or its committed version's delete from every tier, recorded; tierfs's entries go."""
        if node.step is not None and node.step.manifest is None:
            self._deletes.record_unfinished(self.tree.relpath(node))
        elif node.step is not None:
            self._step_removed(node.step)
        self.remove_hidden(node, path)

    def single_file_removed(self, node: Node, *, recorded: bool = False,
                            keep_store: bool = False) -> None:
        """A single-file step leaves its name (unlink, rename, replaced by a rename): its
        committed version is deleted from every tier (unless the caller `recorded` that), its
        records go."""
        if node.step is None or node.is_dir:
            return
        if not recorded:
            self._step_removed(node.step, keep_store=keep_store)
        self.no_longer_step(node)

    def no_longer_step(self, node: Node) -> None:
        """`node` holds no step from now on (its name went, or it moved where it is no step,
        or into one): tierfs's own entries of it go; its files, resident, stay."""
        self.remove_hidden(node, self.tree.backing(node))
        node.step = None

    def joins_step(self, node: Node) -> None:
        """A single-file step becomes a file of the directory it is in, which became a step
        (a directory a tracker named, `fs.tree.step_identity`): a committed version of it is
        deleted from the peers and the cluster's records; in the store its object is the
        step's file at the same key, and its records there go with the step's upload."""
        self.single_file_removed(node, keep_store=True)

    def _step_removed(self, step: StepState, *, keep_store: bool = False) -> None:
        """A step leaves the tree. If it held a committed version (even one being re-saved),
        that version is deleted from every tier, and never listed again
        (fs.lifecycle.deletes)."""
        if step.manifest is not None:
            self._deletes.record(step.manifest.path, step.manifest.version,
                                 step.manifest.committed_ns, keep_store=keep_store)

    def clear_replaced(self, target: Node, path: bytes) -> None:
        """A rename is about to put another entry in place of `target` (at `path`): it leaves
        its name as rmdir or unlink would have it (its committed version's delete from every
        tier is recorded by the rename already, with the moves it makes: `fs.tree.renames`;
        tierfs's own entries gone, its space forgotten with its bytes' last link). The rename
        replaces its backing file; `detach` follows."""
        if target.is_dir:
            self.remove_hidden(target, path)
        else:
            self.single_file_removed(target, recorded=True)
            if target.remote is None:
                self.tree.forget_backing_if_last(path, target)

    def remove_hidden(self, dir_node: Node, path: bytes) -> None:
        """Remove tierfs's own entries of an otherwise empty directory (a deleted step), or
        the records directory of a single-file step (`path`: the file)."""
        step = dir_node.step
        if step is not None:
            self._residents.drop_resident_refs(step)
            step.manifest = None
        elif dir_node.is_dir:  # a committed step renamed to a name that is not a step name
            manifest = self._records.read_manifest(path)
            for entry in manifest.files if manifest else ():
                if os.path.exists(os.path.join(path, os.fsencode(entry.name))):
                    self._store.drop_ref(entry.xxh3)
        if not dir_node.is_dir:
            with times_kept(os.path.dirname(path)):  # tierfs's own entries: no change of the job's
                shutil.rmtree(os.path.join(os.path.dirname(path), layout.records_name(
                    os.path.basename(path))), ignore_errors=True)
            return
        # the directory may stay (a step's committed version deleted on a peer while it is
        # written again here): tierfs's own entries leaving it are no change of the job's
        with times_kept(path):
            for name in os.listdir(path):
                if is_reserved(name):
                    hidden = os.path.join(path, name)
                    if os.path.isdir(hidden) and not os.path.islink(hidden):
                        shutil.rmtree(hidden)  # a single-file step's records
                    else:
                        os.unlink(hidden)
