"""Residency: committed files whose bytes live in another tier, brought back on demand
(verified) or on request (prefetch), and steps leaving RAM under --keep-ram once they are safe
elsewhere. A mixin of Namespace."""

from __future__ import annotations

import errno
import logging
import os
import stat

from tierfs import manifest as mf
from tierfs.fs.fetch import Fetch, FetchError, RemoteFile
from tierfs.fs.nodes import (
    FsError,
    Node,
    Seal,
    StepState,
)

log = logging.getLogger(__name__)


class Residency:
    """Files whose bytes are in another tier: fetched back, prefetched, evicted."""

    async def _read_remote(self, node: Node, offset: int, size: int) -> bytes:
        fetch = self._fetch_of(node)
        try:
            data = await fetch.read(self.read_sources, offset, size)
        except FetchError as exc:
            log.error("read of %s failed: %s", self.relpath(node), exc)
            raise FsError(errno.EIO) from None
        if fetch.complete and node.fetch is fetch:
            await self._adopt(node, fetch)
        return data

    def _fetch_of(self, node: Node) -> Fetch:
        if node.fetch is None:
            node.fetch = Fetch(self.store, node.remote)
        return node.fetch

    def _drop_fetch(self, node: Node) -> None:
        if node.fetch is not None:
            node.fetch.discard()
            node.fetch = None

    async def _make_resident(self, node: Node, *, empty: bool) -> None:
        """Bring a non-resident file into RAM before it changes: whole, or as an empty file."""
        if node.remote is None:
            return
        if empty:
            path = self.backing(node)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             node.remote.entry.mode))
            self._drop_fetch(node)
            node.remote = None
            self._mark_dirty(node.parent)
            return
        fetch = self._fetch_of(node)
        try:
            await fetch.fill(self.read_sources)
        except FetchError as exc:
            log.error("fetch of %s failed: %s", self.relpath(node), exc)
            raise FsError(errno.EIO) from None
        if node.fetch is fetch:
            await self._adopt(node, fetch)
        if node.remote is not None:
            raise FsError(errno.EIO)

    async def _adopt(self, node: Node, fetch: Fetch) -> None:
        """A complete fetch that matches its xxh3-128 becomes the file's committed object."""
        good = await fetch.verify()
        if node.fetch is not fetch or node.remote is None:
            return  # unlinked or evicted meanwhile
        node.fetch = None
        if not good:
            fetch.discard()
            raise FsError(errno.EIO)
        path = self.backing(node)
        tmp = self.store.tmp_path(os.path.dirname(path))
        os.link(fetch.path, tmp)
        os.rename(tmp, path)
        os.close(fetch.fd)
        os.unlink(fetch.path)
        entry = node.remote.entry
        node.remote = None
        node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks), fetch.backing_ino)
        step = self._committed_step_holding(node)
        if step is not None and entry.name not in step.resident:
            self.store.add_ref(entry.xxh3, path)
            step.resident.add(entry.name)
        log.info("%s is back in RAM (%d bytes, verified)", self.relpath(node), entry.size)

    def enforce_keep_ram(self) -> None:
        """Evict steps beyond the newest `keep_ram` of each run directory that are safe
        elsewhere: persisted, or (for the node that wrote them) held by `replicas` peers. A
        replica this node holds for another leaves only once persisted: so the last copy in
        the cluster never leaves RAM unless it is persisted."""
        by_run: dict[int, list[Node]] = {}
        for node in self.steps():
            by_run.setdefault(node.parent.ino, []).append(node)
        for step_nodes in by_run.values():
            committed = sorted((n for n in step_nodes if n.step.committed),
                               key=lambda n: n.step.number, reverse=True)
            for node in committed[self.keep_ram:]:
                if self._safe_elsewhere(node.step) and not self._busy(node) and (
                        node.step.resident or self._has_partial_fetches(node)):
                    self._evict(node)

    def _safe_elsewhere(self, step: StepState) -> bool:
        if step.persisted:
            return True
        owned = step.manifest.node_id == self.node_id
        return owned and self.replicas > 0 and len(step.replicas) >= self.replicas

    def _busy(self, step_node: Node) -> bool:
        return any(n.handles or (n.fetch and n.fetch.busy)
                   for _rel, n in self._files_under(step_node))

    def _evict(self, step_node: Node) -> None:
        """Drop a persisted step's bytes from RAM; it stays listed and readable.

        Tree files go first, objects second: a crash in between leaves objects that start-up
        links back (resident), or none (the step is read from the persistent tier)."""
        step = step_node.step
        manifest = step.manifest
        freed = 0
        for rel, node in self._files_under(step_node):
            if node.fetch is not None:
                freed += sum(node.fetch.present) * mf.CHUNK_SIZE
                self._drop_fetch(node)  # ranges read on demand leave with the step
            entry = manifest.entry(rel)
            if entry is not None and node.remote is None:
                self._unlink_backing(self.backing(node), node)
                node.remote = RemoteFile(manifest.path, entry)
                node.seal = None
                freed += entry.size
        self._drop_resident_refs(step)
        log.info("evicted %s v%d from RAM (%d bytes); it stays readable from %s",
                 self.relpath(step_node), manifest.version, freed,
                 "the persistent tier" if step.persisted else
                 "peers " + ", ".join(sorted(step.replicas)))

    async def prefetch(self, relpath: str) -> int:
        """`tierfs prefetch`: bring every file of a committed step into RAM; bytes fetched."""
        step_node = self.find_step(relpath)
        if step_node is None or not step_node.step.committed:
            raise FsError(errno.EINVAL, f"{relpath} is not a committed step")
        fetched = 0
        for _rel, node in list(self._files_under(step_node)):
            if node.remote is not None:
                size = node.remote.entry.size
                await self._make_resident(node, empty=False)
                fetched += size
        return fetched

    def _has_partial_fetches(self, step_node: Node) -> bool:
        return any(n.fetch is not None for _rel, n in self._files_under(step_node))

    def _drop_resident_refs(self, step: StepState) -> None:
        if step.manifest is not None:
            for name in step.resident:
                self.store.drop_ref(step.manifest.entry(name).xxh3)
        step.resident = set()

    def _add_remote_files(self, step_node: Node, entries: list[mf.FileEntry],
                          step_path: str | None = None) -> None:
        """Nodes for committed files whose bytes are in another tier (with their directories)."""
        manifest_path = step_path or step_node.step.manifest.path
        for entry in entries:
            parent, name = self._entry_parent(step_node, entry.name)
            node = parent.children.get(name)
            if node is None:
                node = self._attach(parent, name, stat.S_IFREG)
            node.remote = RemoteFile(manifest_path, entry)

    def _entry_parent(self, step_node: Node, relative: str) -> tuple[Node, bytes]:
        """The directory node (made if missing) and the name of a manifest entry."""
        *dirs, name = relative.split("/")
        parent = step_node
        for part in map(os.fsencode, dirs):
            child = parent.children.get(part)
            if child is None:
                os.makedirs(os.path.join(self.backing(parent), part), 0o755, exist_ok=True)
                child = self._attach(parent, part, stat.S_IFDIR)
            parent = child
        return parent, os.fsencode(name)

    def _fill_from_objects(self, step_node: Node) -> None:
        """Files of this step that are not resident but whose objects are here become
        resident (a replica sent them)."""
        step = step_node.step
        for _rel, node in self._files_under(step_node):
            if node.remote is None or node.fetch is not None:
                continue
            entry = node.remote.entry
            obj = self.store.object_path(entry.xxh3)
            if not obj.exists():
                continue
            path = self.backing(node)
            tmp = self.store.tmp_path(os.path.dirname(path))
            os.link(obj, tmp)
            os.rename(tmp, path)
            node.remote = None
            node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks),
                             os.lstat(path).st_ino)
            if entry.name not in step.resident:
                self.store.add_ref(entry.xxh3, path)
                step.resident.add(entry.name)
