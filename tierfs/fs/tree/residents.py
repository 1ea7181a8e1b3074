"""The tree's changes to where a committed file's bytes are: coming back from another tier (a
fetch started, adopted or dropped), leaving RAM (evicted, quarantined), arrived from a replica
(filled from the objects it sent), or only elsewhere (remote files added), with the RAM store's
references of a step's resident files. Part of the tree's core (see `fs.tree.tree`): it changes
nodes and step state only through `Tree`'s primitives and by the same rules; each change is one
synchronous method. `fs.lifecycle.fetch_back` and
`fs.lifecycle.eviction` decide when."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection
from typing import TYPE_CHECKING

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import FsError, Node, Seal, StepState
from tierfs.fs.store.committed_files import apply_attributes, make_from_object
from tierfs.fs.store.fetch import Fetch, RemoteFile
from tierfs.fs.tree.dir_attributes import times_kept

if TYPE_CHECKING:
    from tierfs.fs.model.ports import DeleteLog
    from tierfs.fs.store.ram_store import RamStore
    from tierfs.fs.tree.copy_on_write import CopyOnWrite
    from tierfs.fs.tree.dir_attributes import DirAttributes
    from tierfs.fs.tree.tree_primitives import TreePrimitives


class Residents:
    """Where the bytes of one mount's committed files are (see the module docstring)."""

    def __init__(self, tree: TreePrimitives, deletes: DeleteLog,
                 copy_on_write: CopyOnWrite, *, dir_attributes: DirAttributes,
                 store: RamStore) -> None:
        self.tree = tree
        self._dir_attributes = dir_attributes
        self._store = store
        self._copy_on_write = copy_on_write
        self._deletes = deletes
        self.fetching: set[Node] = set()  # nodes with a partial fetch (fs.lifecycle.fetch_back)

    def start_fetch(self, node: Node, fetch: Fetch) -> Fetch:
        node.fetch = fetch
        self.fetching.add(node)
        return fetch

    def drop_fetch(self, node: Node) -> None:
        if node.fetch is not None:
            node.fetch.discard()
            self._unset_fetch(node)

    def _unset_fetch(self, node: Node) -> None:
        node.fetch = None
        self.fetching.discard(node)

    def adopt_fetch(self, node: Node, fetch: Fetch, good: bool) -> bool:
        """A complete fetch, checked against its xxh3-128 (`good`), becomes the file's committed
        object. False if the node moved on meanwhile (unlinked or evicted)."""
        if node.fetch is not fetch or node.remote is None:
            return False
        self._unset_fetch(node)
        if not good:
            fetch.discard()
            raise FsError(errno.EIO)
        path = self.tree.backing(node)
        tmp = self._store.tmp_path(os.path.dirname(path))
        with times_kept(os.path.dirname(path)):  # back in RAM: no change of the directory
            os.link(fetch.path, tmp)
            os.rename(tmp, path)
        fetch.adopted()
        os.unlink(fetch.path)
        entry = node.remote.entry
        node.remote = None
        node.seal = Seal(mf.Digest.of(entry), fetch.backing_ino)
        step = tree_walk.committed_step_holding(node)
        if step is not None and entry.name not in step.resident:
            self._store.add_ref(entry.xxh3, path)
            step.resident.add(entry.name)
        return True

    def make_empty_resident(self, node: Node) -> None:
        """A non-resident file truncated to nothing: an empty file in RAM, as committed."""
        path = self.tree.backing(node)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            apply_attributes(fd, node.remote.entry)  # its owner and mode, not the daemon's
        finally:
            os.close(fd)
        self.drop_fetch(node)
        node.remote = None
        self.tree.mark_dirty(node)

    def evict_file(self, step: StepState, entry: mf.FileEntry, node: Node) -> int | None:
        """One file of a committed step leaves RAM unless it is in use; the bytes freed, or
        None if it stays or had nothing in RAM."""
        if node.handles or (node.fetch is not None and node.fetch.busy):
            return None  # open, or bytes on their way in: it stays (a later eviction takes it)
        in_ram = node.fetch is not None or node.remote is None
        freed = 0
        if node.fetch is not None:
            freed += node.fetch.stored_bytes
            self.drop_fetch(node)  # ranges read on demand leave with the step
        if node.remote is None:
            path = self.tree.backing(node)
            with times_kept(os.path.dirname(path)):  # out of RAM: no change of the directory
                self.tree.unlink_backing(path, node)
            node.remote = RemoteFile(self.tree.data_dir(step), entry, step.persisted)
            node.seal = None
            freed += entry.size
        if entry.name in step.resident:
            step.resident.discard(entry.name)
            self._store.drop_ref(entry.xxh3)
        return freed if in_ram else None

    def quarantine(self, ino: int, digest: str) -> list[tuple[mf.StepManifest, str]]:
        """Every committed file on the bad inode `ino` becomes non-resident (readers go through
        the other tiers from now on); the object goes (its bytes are kept aside by the caller).
        The files that did: (their step's manifest, name)."""
        gone: list[tuple[mf.StepManifest, str]] = []
        for step_node in list(self.tree.steps()):
            step = step_node.step
            if not step.committed:
                continue
            for rel, node in list(tree_walk.files_under(step_node)):
                entry = step.manifest.entry(rel)
                if (entry is None or node.remote is not None or rel not in step.resident
                        or node.seal is None or node.seal.backing_ino != ino):
                    continue
                for handle in node.handles:
                    if handle.fd >= 0 and not handle.writable:
                        os.close(handle.fd)
                        handle.fd = -1
                        handle.backing_ino = 0
                path = self.tree.backing(node)
                with times_kept(os.path.dirname(path)):  # out of service: no change of the job's
                    self.tree.unlink_backing(path, node)
                node.remote = RemoteFile(self.tree.data_dir(step), entry, step.persisted)
                node.seal = None
                step.resident.discard(entry.name)
                self._store.drop_ref(entry.xxh3)
                gone.append((step.manifest, entry.name))
        obj = self._store.object_path(digest)
        try:
            st = os.lstat(obj)
        except FileNotFoundError:
            return gone
        if st.st_ino == ino:  # still named by a step being re-saved: the bytes are bad anyway
            os.unlink(obj)
            if st.st_nlink == 1:
                self._store.forget_inode(ino)
        return gone

    def add_remote_files(self, step_node: Node, entries: list[mf.FileEntry],
                         step_path: str | None = None, *, in_store: bool = False) -> None:
        """Nodes for committed files whose bytes are in another tier (with their directories);
        `step_path` is the data dir (`layout.data_dir`) if the step's manifest is not yet its;
        `in_store`: the persistent tier holds them."""
        data_dir = step_path or self.tree.data_dir(step_node.step)
        for entry in entries:
            parent, name = self._entry_parent(step_node, entry.name)
            node = parent.children.get(name)
            if node is None:
                node = self.tree.attach(parent, name, stat.S_IFREG)
            elif node.remote is None or node.remote.entry != entry:
                self.tree.attrs_changed(node)  # the name stands for this version's file now
            # A file renamed before its new name reached the store: its old name holds it.
            moved = not in_store and bool(self._deletes.old_keys(
                layout.object_key(data_dir, entry.name)))
            node.remote = RemoteFile(data_dir, entry, in_store or moved)

    def _entry_parent(self, step_node: Node, relative: str) -> tuple[Node, bytes]:
        """The directory node (made if missing) and the name of a manifest entry."""
        if step_node.is_file:
            return step_node.parent, step_node.name
        *dirs, name = relative.split("/")
        parent = step_node
        for part in map(os.fsencode, dirs):
            child = parent.children.get(part)
            if child is None:
                os.makedirs(os.path.join(self.tree.backing(parent), part), 0o755, exist_ok=True)
                child = self.tree.attach(parent, part, stat.S_IFDIR)
                self._dir_attributes.made(child)  # as its step's manifest records it
            parent = child
        return parent, os.fsencode(name)

    def fill_from_objects(self, step_node: Node, names: Collection[str]) -> None:
        """These files of this step, not resident but whose objects are here, become resident
        (a replica sent them). Only those named: a step of 20,000 files is held 1,000 at a
        time, and looking at every file of it each time cost a third of a second per 1,000."""
        step = step_node.step
        for name in names:
            node = tree_walk.entry_node(step_node, name)
            if node is None or node.remote is None or node.fetch is not None:
                continue
            entry = node.remote.entry
            obj = self._store.object_path(entry.xxh3)
            if not obj.exists():
                continue
            path = self.tree.backing(node)
            tmp = self._store.tmp_path(os.path.dirname(path))
            with times_kept(os.path.dirname(path)):
                make_from_object(obj, path, tmp, entry)
            self._store.account_path(path)  # (a copy of its own where the object is shared)
            node.remote = None
            node.seal = Seal(mf.Digest.of(entry),
                             os.lstat(path).st_ino)
            if entry.name not in step.resident:
                self._store.add_ref(entry.xxh3, path)
                step.resident.add(entry.name)

    def drop_resident_refs(self, step: StepState) -> None:
        if step.manifest is not None:
            for name in step.resident:
                self._store.drop_ref(step.manifest.entry(name).xxh3)
        step.resident = set()


    def has_partial_fetches(self, step_node: Node) -> bool:
        return any(tree_walk.holds(step_node, n) for n in self.fetching)

    def written_in_save(self, step: StepState, rel: str, node: Node) -> bool:
        """Whether a file of a step is one this node wrote for the save under way (sealed or
        not): in the tree here, not a copy of the committed version as it was, not a file
        only other nodes hold."""
        return node.remote is None and not self.unchanged_since_commit(step, rel, node)

    def unchanged_since_commit(self, step: StepState, rel: str, node: Node) -> bool:
        """Whether a file of a step being saved again is still exactly what its committed
        version holds: in RAM, sealed with that version's content, and still the committed
        object itself (its inode shared with it: a write would have made it private)."""
        entry = step.manifest.entry(rel) if step.manifest is not None else None
        if (entry is None or node.remote is not None or rel not in step.resident
                or node.seal is None or node.seal.digest.xxh3 != entry.xxh3):
            return False
        try:
            return self._copy_on_write.shared_backing(node) is not None
        except (FsError, OSError):
            return False
