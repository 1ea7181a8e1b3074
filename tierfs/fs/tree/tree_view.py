"""The tree read, never changed: what peers ask of this node (which versions and copies it
holds, where a sealed file's bytes are), a step's line of `tierfs status`, the `user.tierfs.*`
attributes, the symbolic links the store keeps and what a rename's upload needs. `TreeView`
holds the `Tree` and calls none of its mutations (a `user.tierfs.xxh3` asked of a file whose
seal is stale has it hashed again, which is no change of the tree's state)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tierfs import layout
from tierfs import manifest as mf
from tierfs.fs.model import links as symlinks
from tierfs.fs.model import tree_walk
from tierfs.fs.model.nodes import (
    ENOATTR,
    XATTR_STATE,
    XATTR_TIERS,
    XATTR_XXH3,
    FsError,
    Node,
    RemoteAttrs,
    StepState,
)
from tierfs.fs.model.ports import SaveHere

if TYPE_CHECKING:
    from tierfs.fs.tree.holders import Holdings
    from tierfs.fs.tree.recoverable import Loss, Recoverability
    from tierfs.fs.tree.residents import Residents
    from tierfs.fs.tree.sealing import Sealing
    from tierfs.fs.tree.step_identity import StepIdentity
    from tierfs.fs.tree.tree import Tree
    from tierfs.fs.tree.virtual_latest import VirtualLatest


class TreeView:
    """Read-only queries over one mount's tree (see the module docstring)."""

    def __init__(self, tree: Tree, *, holdings: Holdings, identity: StepIdentity,
                 latest: VirtualLatest, recoverable: Recoverability, residents: Residents,
                 sealing: Sealing) -> None:
        self.tree = tree
        self._holdings = holdings
        self._identity = identity
        self._latest = latest
        self._recoverable = recoverable
        self._residents = residents
        self._sealing = sealing

    # -- the steps, for status and the daemon's rounds -----------------------------------------

    def steps(self) -> list[Node]:
        """Every step, depth first (a list: the tree may change while the caller awaits)."""
        return list(self.tree.steps())

    def find_step(self, relpath: str) -> Node | None:
        """The step at this path, None if there is none."""
        return self.tree.find_step(relpath)

    def relpath(self, node: Node) -> str:
        return self.tree.relpath(node)

    def stat(self, node: Node) -> os.stat_result | RemoteAttrs:
        return self.tree.stat(node)

    # -- what the daemon asks of a step's copies ----------------------------------------------

    def step_number(self, name: str) -> int | None:
        """The step number a directory's name carries (--step-pattern), None if none."""
        return self._identity.step_number(name)

    def file_step_number(self, name: str) -> int | None:
        """The step number a single-file step's name carries (--file-step-pattern)."""
        identity = self._identity
        return identity.step_number(name, identity.file_pattern)

    def hashes_yielded(self) -> float:
        """Seconds the background hashes paused for a save in progress (`fs.tree.sealing`)."""
        return self._sealing.yielded

    def loss(self, step: StepState, *, fresh: bool = False) -> Loss | None:
        """Why the committed step cannot be read whole now (`Recoverability.loss`)."""
        return self._recoverable.loss(step, fresh=fresh)

    def copies(self, step: StepState, is_up: Callable[[str], bool]) -> int:
        """The fewest live copies of any file of the committed version (`Holdings.copies`)."""
        return self._holdings.copies(step, is_up)

    def file_peers(self, step: StepState, name: str) -> set[str]:
        """Other nodes holding this file of the committed version (`Holdings.file_peers`)."""
        return self._holdings.file_peers(step, name)

    # -- what peers ask ---------------------------------------------------------------------

    def committed_manifest(self, step_path: str, version: int) -> mf.StepManifest | None:
        """The manifest of the step's `version` if this node lists that version committed."""
        node = self.tree.find_step(step_path)
        if node is None or not node.step.committed or node.step.manifest.version != version:
            return None
        return node.step.manifest

    def holds_copy(self, step_path: str, name: str, xxh3: str) -> bool:
        """Whether this node holds the committed step's file `name`, with this content, in
        RAM: the step is listed here with that entry and the file is resident (not merely an
        object with the same content, which another step's file may be)."""
        node = self.tree.find_step(step_path)
        if node is None:
            return False
        if not node.step.committed:
            # still `writing` here (a multi-node step committed elsewhere while this node was
            # down): it joins that commit with its files sealed as the records say, once it
            # learns it; a file not sealed so (not yet hashed again after a restart) is not
            # counted: it may not be what was recorded
            return self._sealed_as(node, name, xxh3)
        entry = node.step.manifest.entry(name)
        return entry is not None and entry.xxh3 == xxh3 and name in node.step.resident

    def _sealed_as(self, step_node: Node, name: str, xxh3: str) -> bool:
        """Whether the step's file `name` is here, closed, and sealed with this content."""
        node: Node | None = step_node
        for part in name.split("/"):
            node = (node.children or {}).get(os.fsencode(part)) if node is not None else None
        return (node is not None and node.remote is None and node.seal is not None
                and node.seal.digest.xxh3 == xxh3 and node.active_writers == 0
                and self._sealing.describes_file(node))

    def files_written(self, step_path: str, names: list[str]) -> list[str]:
        """Which of `names` this node has in the step at `step_path` as files written here
        for the save under way (sealed or not): not a copy of its committed version as it
        was, not a file only other nodes hold (a `FILES` request from a committer)."""
        node = self.tree.find_step(step_path)
        if node is None or not node.is_dir:
            return []
        step = node.step
        if step.committed:
            return []
        written = self._residents.written_in_save
        return [name for name in names if (file_node := tree_walk.entry_node(node, name))
                is not None and written(step, name, file_node)]

    def files_being_saved(self, step_path: str) -> SaveHere:
        """The files this node writes of the save under way of the step directory at
        `step_path` (sealed or not; not copies of its committed version as they were, not
        files other nodes hold), the directories that hold them, and the version of the step
        committed here (a `WRITTEN` request from a committer of the step, which waits if this
        node committed the save it is about; `fs.model.ports.SaveHere`)."""
        node = self.tree.find_step(step_path)
        if node is None or not node.is_dir:
            return SaveHere([], set(), {}, 0)
        step = node.step
        if step.committed:
            return SaveHere([], set(), {}, step.base)
        names, still_open, holding = [], set(), {}
        for name, file_node in tree_walk.files_under(node):
            if not self._residents.written_in_save(step, name, file_node):
                continue
            names.append(name)
            if file_node.active_writers or file_node.open_for_writing:
                still_open.add(name)
            parent, rel = file_node.parent, name
            while parent is not None and parent is not node and parent not in holding:
                rel = rel.rsplit("/", 1)[0]  # the path of `parent` in the step
                holding[parent] = rel
                parent = parent.parent
        dirs = {}
        for dir_node, rel in holding.items():
            with contextlib.suppress(OSError):
                dirs[rel] = mf.dir_entry_from_stat(f"{step_path}/{rel}",
                                                   os.lstat(self.tree.backing(dir_node)))
        return SaveHere(sorted(names), still_open, dirs, step.base)

    def step_of_entry(self, data_dir: str, name: str | None) -> Node | None:
        """The step a manifest entry named `name` under `data_dir` (`layout.data_dir`)
        belongs to: the step at `data_dir`, or the single-file step `data_dir/name`."""
        node = self.tree.find_step(data_dir)
        if node is None and name is not None:
            node = self.tree.find_step(os.path.join(data_dir, name))
        return node

    def holders_of(self, step_path: str, name: str | None = None) -> list[str]:
        """Other nodes to read the step's file `name` from (its own holders once known).
        `step_path` is the data dir of the file's entry (`layout.data_dir`): for a single-file
        step, the directory the file is in."""
        node = self.step_of_entry(step_path, name)
        if node is None:
            return []
        step = node.step
        if name is not None and name in step.file_holders and step.committed:
            return sorted(self._holdings.file_peers(step, name))
        peers = step.holders | set(self._holdings.peer_holders(step))
        return sorted(peers - {self.tree.node_id})

    def sealed_path(self, data_dir: str, name: str, xxh3: str) -> bytes | None:
        """The RAM store path of a sealed file with exactly this content, if held here
        (`name` relative to `data_dir`, see `layout.data_dir`)."""
        node = self.tree.root
        try:
            for part in layout.object_key(data_dir, name).split("/"):
                node = self.tree.child(node, os.fsencode(part))
        except FsError:
            return None
        if (node.is_file and node.remote is None and node.seal is not None
                and node.seal.digest.xxh3 == xxh3 and node.active_writers == 0):
            return self.tree.backing(node)
        return None

    # -- status and xattrs -------------------------------------------------------------------

    def step_status(self, step_node: Node, dirs: dict[Node, dict[StepState, str]] | None = None,
                    *, replicas: bool = True) -> dict[str, object]:
        """One step's line of `tierfs status`: cheap whatever the step's size (no disk access
        for committed steps; a step being written costs one lstat per unsealed file).
        `dirs`: the unfinished steps of each directory, kept across the lines of one status
        (a directory of many steps is judged once, not once per step). `replicas` False: the
        caller has them from elsewhere (a cluster's records), so they are not judged here
        (file by file) to be replaced."""
        step = step_node.step
        if step.committed:
            manifest = step.manifest
            files, size = len(manifest.files), manifest.total_bytes
            ram_bytes = size if step.in_ram else sum(
                manifest.entry(name).size for name in step.resident)
        else:
            sizes = [self._status_size(n) for n in tree_walk.walk_files(step_node)]
            files, size = len(sizes), sum(sizes)
            ram_bytes = size
        loss = self._recoverable.loss(step)
        return {
            "path": self.tree.relpath(step_node), "step": step.number,
            "state": "incomplete" if loss is not None else step.state,
            "lost": loss.as_dict() if loss is not None else None,
            "kind": "dir" if step_node.is_dir else "file",
            "ram_bytes": ram_bytes,
            "version": (step.pending.record.version if _shown_pending(step)
                        else step.base),
            # committed, its files' hashes still to come (nothing of it has left the node)
            "hashing": _shown_pending(step),
            "files": files, "bytes": size, "ram": step.in_ram,
            "replicas": self._holdings.full_holders(step) if replicas else None,
            "persisted": step.persisted,
            "waiting_for": step.waiting_for if step.commit_pending or not step.committed else None,
            # committed without its saver's mark of a finished save (`fs.model.completion`)
            "unfinished": self.unfinished(step_node, {} if dirs is None else dirs),
        }

    def unfinished(self, step_node: Node, dirs: dict[Node, dict[StepState, str]]
                   ) -> str | None:
        """The saver's mark a committed step directory lacks while the steps before it carry
        it (`fs.model.completion`: `latest` skips it), else None."""
        parent = step_node.parent
        if not step_node.is_dir or parent is None or not step_node.step.committed:
            return None
        if parent not in dirs:
            dirs[parent] = self._latest.unfinished(parent)
        return dirs[parent].get(step_node.step)

    def _status_size(self, node: Node) -> int:
        if node.remote is not None:
            return node.remote.entry.size
        if node.seal is not None and not node.active_writers:
            return node.seal.digest.size
        try:
            return self.tree.stat(node).st_size
        except (FsError, FileNotFoundError):
            return 0  # removed meanwhile

    def state_of(self, step: StepState) -> str:
        """`writing`, `committed`, or `incomplete`: committed, but a file of it is reachable
        on no tier now (`fs.tree.recoverable`)."""
        return "incomplete" if self._recoverable.loss(step) is not None else step.state

    def xattr_names(self, node: Node) -> list[bytes]:
        if node.virtual:
            return []
        names = []
        if node.is_dir and node.step is not None:
            names += [XATTR_STATE, XATTR_TIERS]
        elif node.is_file:
            names.append(XATTR_TIERS)
            if node.seal is not None or node.active_writers == 0:
                names.append(XATTR_XXH3)
        return names

    async def xattr(self, node: Node, name: bytes) -> bytes:
        if name not in self.xattr_names(node):
            raise FsError(ENOATTR)
        if name == XATTR_STATE:
            return self.state_of(node.step).encode()
        if name == XATTR_TIERS:
            if node.is_dir:
                step = node.step
                return self._holdings.tiers(step, step.in_ram).encode()
            step = tree_walk.committed_step_holding(node)
            if step is None:
                return b"ram"
            name = self._entry_name(node)
            return self._holdings.tiers(step, node.remote is None, name).encode()
        if node.remote is not None:
            return node.remote.entry.xxh3.encode()
        if not self._sealing.describes_file(node):
            await self.tree.seal(node)  # sealed before a restart, or written behind its seal
        if node.seal is None:
            raise FsError(ENOATTR)
        return node.seal.digest.xxh3.encode()

    def _entry_name(self, node: Node) -> str | None:
        """The name of a file in its step's manifest (None if not found)."""
        step_node = next(tree_walk.enclosing_steps(node), None)
        if step_node is None:
            return None
        if step_node is node:
            return step_node.step.manifest.files[0].name
        try:
            return os.path.relpath(self.tree.relpath(node), self.tree.relpath(step_node))
        except FsError:
            return None

    def own_latest_dirs(self) -> list[str]:
        """The directories holding steps whose `latest` is their own (status), relative to the
        mount (`.` for the mount itself)."""
        parents = {node.parent for node in self.tree.steps()
                   if node.parent is not None and node.is_dir}
        return sorted(self.tree.relpath(p) or "." for p in parents if self._latest.is_own(p))

    # -- symbolic links the store keeps (fs.model.links)
    # ---------------------------------------------

    def links_of(self, directory: str) -> dict[str, str]:
        """The links of `directory` that the store keeps (fs.model.links): outside any step, with a
        relative target inside the mount."""
        node = tree_walk.node_at(self.tree.root, directory)
        if node is None or not node.is_dir or next(tree_walk.enclosing_steps(node), None):
            return {}
        found = {}
        for name, child in node.children.items():
            if child.kind == stat.S_IFLNK and not child.virtual:
                target = os.fsdecode(os.readlink(self.tree.backing(child)))
                link = layout.join(directory, os.fsdecode(name))
                if symlinks.stays_inside(link, target):
                    found[os.fsdecode(name)] = target
        return found

    def link_dirs(self) -> list[str]:
        """Every directory holding a link (what a restart has the store learn again)."""
        return sorted({self.tree.relpath(node.parent) for node in self._all_links()})

    def ram_only_links(self) -> list[str]:
        """Links that live in this RAM dir only (status): absolute, out of the mount, or in a
        step directory."""
        kept = {layout.join(d, name) for d in self.link_dirs() for name in self.links_of(d)}
        return sorted(p for p in map(self.tree.relpath, self._all_links()) if p not in kept)

    def _all_links(self) -> Iterator[Node]:
        links = tree_walk.walk_kind(self.tree.root, stat.S_IFLNK)
        return (link for link in links if not link.virtual)

    # -- what a rename's upload needs ---------------------------------------------------------

    def reads_from_store(self, path: str) -> bool:
        """Whether a file renamed here, not in RAM, has its bytes in the store at `path` or
        below (under its old name)."""
        for rel, node in tree_walk.files_under(self.tree.root):
            remote = node.remote
            if remote is not None and remote.in_store:
                key = layout.object_key(remote.step_path, remote.entry.name)
                if key != rel and (key == path or key.startswith(path + "/")):
                    return True
        return False

    def in_ram_or_store(self, step_node: Node) -> bool:
        """Whether every file of the step is in RAM or in the store (a renamed step's under
        its old name): what an upload needs, with copies inside the store."""
        return all(node.remote is None or node.remote.in_store
                   for node in tree_walk.walk_files(step_node))


def _shown_pending(step: StepState) -> bool:
    """A step shown committed by a version whose hashes are still to come."""
    return step.pending is not None and not step.pending.superseded
