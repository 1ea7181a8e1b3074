"""Residency: committed files whose bytes live in another tier, brought back on demand
(verified) or on request (prefetch), and steps leaving RAM once they are safe elsewhere: under
--keep-ram, and under RAM pressure before any write is refused. A mixin of Namespace."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator

import trio

from tierfs import manifest as mf
from tierfs.fs.fetch import Fetch, FetchError, RemoteFile, apply_attributes
from tierfs.fs.nodes import (
    FsError,
    Node,
    Seal,
    StepState,
)

log = logging.getLogger(__name__)

# Eviction works in slices of EVICT_SLICE seconds, each followed by a pause as long: the
# FUSE loop answers in between, and the threads that relay requests to it get the GIL. The
# first slice of a background eviction is longer, so that most steps leave RAM at once.
EVICT_SLICE = 0.002
FIRST_SLICE = 0.02


class Residency:
    """Files whose bytes are in another tier: fetched back, prefetched, evicted.

    Its state, set up by Namespace: `_evictions` (steps leaving RAM now, each with an event
    set when done), `_fetching` (nodes with a partial fetch), `_pressure_relief` (whether a
    background relief runs)."""

    _evictions: dict[StepState, trio.Event]
    _fetching: set[Node]
    _pressure_relief: bool

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
            self._fetching.add(node)
        return node.fetch

    def _drop_fetch(self, node: Node) -> None:
        if node.fetch is not None:
            node.fetch.discard()
            self._unset_fetch(node)

    def _unset_fetch(self, node: Node) -> None:
        node.fetch = None
        self._fetching.discard(node)

    async def _make_resident(self, node: Node, *, empty: bool) -> None:
        """Bring a non-resident file into RAM before it changes: whole, or as an empty file."""
        if node.remote is None:
            return
        if empty:
            path = self.backing(node)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                apply_attributes(fd, node.remote.entry)  # its owner and mode, not the daemon's
            finally:
                os.close(fd)
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
        self._unset_fetch(node)
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

    # -- leaving RAM ---------------------------------------------------------------------
    #
    # A step leaves RAM file by file: the tree file first, then the committed object once no
    # other step names it (a crash in between leaves an object that start-up links back, or
    # none: the file is read from another tier). Files that are open, or whose bytes are on
    # their way in, stay. The work runs in slices of EVICT_SLICE seconds with a checkpoint in
    # between, so that evicting a step of 50,000 files never holds the FUSE loop; each file is
    # checked and changed with no await in between, so handlers see it either in RAM or not.

    def enforce_keep_ram(self) -> None:
        """Evict steps beyond the newest `keep_ram` of each run directory that are safe
        elsewhere: persisted, or (for the node that wrote them) held by `replicas` peers. A
        replica this node holds for another leaves only once persisted: so the last copy in
        the cluster never leaves RAM unless it is persisted. The first slice of the work is
        done at once; what remains continues in the background."""
        for step_node in self._eviction_candidates(pressure=False):
            self._evict_soon(step_node)

    async def make_room(self, needed: int, sparing: Node | None = None) -> None:
        """Before a write that needs `needed` more bytes is refused: committed copies that are
        safe elsewhere leave RAM, read-back copies and steps beyond --keep-ram first, then the
        newer ones (--keep-ram yields to a write), oldest first. `sparing`'s step stays. Raises
        RamFull, with a log line naming what holds the RAM, if that is not enough."""
        if not await self._free_safe_copies(needed, sparing):
            self.store.check_room(needed, self._ram_holders())

    async def _free_safe_copies(self, needed: int, sparing: Node | None = None) -> bool:
        """Evict safe copies (see `make_room`) until `needed` more bytes fit; whether they do."""
        tried: set[StepState] = set()  # a step with files in use keeps them: once is enough
        while not self.store.room_for(needed) and needed <= self.store.limit_bytes:
            running = self._evictions
            candidates = [node for node in self._eviction_candidates(pressure=True)
                          if node.step not in running and node.step not in tried
                          and not self._holds(node, sparing)]
            if candidates:
                tried.add(candidates[0].step)
                await self._evict(candidates[0])
            elif running:
                await next(iter(running.values())).wait()
            else:
                break
        return self.store.room_for(needed)

    def relieve_pressure(self) -> None:
        """The tier is over its limit (passthrough writers add bytes the daemon does not see
        one by one): safe copies leave RAM in the background until it is back under."""
        if self.store.room_for(0) or self._pressure_relief:
            return
        self._pressure_relief = True

        async def relieve() -> None:
            try:
                await self._free_safe_copies(0)  # what stays is not safe elsewhere
            finally:
                self._pressure_relief = False

        self._spawn(relieve)

    def _eviction_candidates(self, *, pressure: bool) -> list[Node]:
        """Committed steps with bytes in RAM that are safe elsewhere, in the order they leave:
        beyond --keep-ram of their run directory first, then (under pressure) the others,
        each group by step number, oldest first."""
        by_run: dict[int, list[Node]] = {}
        for node in self.steps():
            if node.step.committed:
                by_run.setdefault(node.parent.ino, []).append(node)
        beyond: list[Node] = []
        within: list[Node] = []
        for step_nodes in by_run.values():
            step_nodes.sort(key=lambda n: n.step.number, reverse=True)
            for rank, node in enumerate(step_nodes):
                if self._safe_elsewhere(node.step) and (
                        node.step.resident or self._has_partial_fetches(node)):
                    (within if rank < self.keep_ram else beyond).append(node)
        oldest_first = lambda n: n.step.number  # noqa: E731
        return sorted(beyond, key=oldest_first) + (
            sorted(within, key=oldest_first) if pressure else [])

    def _safe_elsewhere(self, step: StepState) -> bool:
        if step.persisted:
            return True
        owned = step.manifest.node_id == self.node_id
        return owned and self.replicas > 0 and len(step.replicas) >= self.replicas

    def _busy(self, step_node: Node) -> bool:
        return any(n.handles or (n.fetch and n.fetch.busy)
                   for _rel, n in self._files_under(step_node))

    @staticmethod
    def _holds(step_node: Node, node: Node | None) -> bool:
        while node is not None:
            if node is step_node:
                return True
            node = node.parent
        return False

    def _ram_holders(self) -> str:
        """What the RAM tier holds that cannot leave it now, for the log line of a refusal."""
        writing, unsafe = [], []
        for node in self.steps():
            step = node.step
            if not step.committed:
                writing.append(self.relpath(node))
            elif step.resident and not self._safe_elsewhere(step):
                unsafe.append(self.relpath(node))
        parts = []
        if writing:
            parts.append("steps being written (or left half-written by a failed save; "
                         "remove or save them again to free their space): "
                         + ", ".join(sorted(writing)[:5]) + (" ..." if len(writing) > 5 else ""))
        if unsafe:
            parts.append(f"{len(unsafe)} committed steps not yet persisted or replicated")
        return "; ".join(parts)

    def _evict_soon(self, step_node: Node) -> None:
        """Evict a step: the first slice now, the rest in the background."""
        step = step_node.step
        if step in self._evictions:
            return
        work = self._eviction_work(step_node, FIRST_SLICE)
        try:
            next(work)
        except StopIteration:
            return
        self._evictions[step] = trio.Event()
        self._spawn(lambda: self._finish_eviction(step, work))

    async def _evict(self, step_node: Node) -> None:
        """Evict a step, a slice at a time, in this task."""
        self._evictions[step_node.step] = trio.Event()
        await self._finish_eviction(step_node.step, self._eviction_work(step_node))

    async def _finish_eviction(self, step: StepState, work: Iterator[None]) -> None:
        try:
            for _slice in work:
                await trio.sleep(EVICT_SLICE)
        finally:
            self._evictions.pop(step).set()

    def _eviction_work(self, step_node: Node, first_slice: float = EVICT_SLICE
                       ) -> Iterator[None]:
        """Drop a safe step's bytes from RAM, file by file; it stays listed and readable.
        Yields whenever a slice of work is done and a checkpoint is due."""
        step = step_node.step
        manifest = step.manifest
        freed = evicted = 0
        deadline = time.monotonic() + first_slice
        for entry in manifest.files:
            if step_node.step is not step or step.manifest is not manifest \
                    or not step.committed:
                break  # re-saved, superseded or removed meanwhile: it is no longer ours to evict
            node = self._entry_node(step_node, entry.name)
            size = None if node is None else self._evict_file(step, entry, node)
            if size is not None:
                freed += size
                evicted += 1
            if time.monotonic() > deadline:
                yield
                deadline = time.monotonic() + EVICT_SLICE
        if not evicted:
            return  # nothing was in RAM but files in use
        log.info("evicted %s v%d from RAM (%d files, %d bytes); it stays readable from %s",
                 manifest.path, manifest.version, evicted, freed,
                 "the persistent tier" if step.persisted else
                 "peers " + ", ".join(sorted(step.replicas)))

    def _evict_file(self, step: StepState, entry: mf.FileEntry, node: Node) -> int | None:
        """One file of a committed step leaves RAM unless it is in use; the bytes freed, or
        None if it stays or had nothing in RAM."""
        if node.handles or (node.fetch is not None and node.fetch.busy):
            return None  # open, or bytes on their way in: it stays (a later eviction takes it)
        in_ram = node.fetch is not None or node.remote is None
        freed = 0
        if node.fetch is not None:
            freed += sum(node.fetch.present) * mf.CHUNK_SIZE
            self._drop_fetch(node)  # ranges read on demand leave with the step
        if node.remote is None:
            self._unlink_backing(self.backing(node), node)
            node.remote = RemoteFile(step.manifest.path, entry)
            node.seal = None
            freed += entry.size
        if entry.name in step.resident:
            step.resident.discard(entry.name)
            self.store.drop_ref(entry.xxh3)
        return freed if in_ram else None

    @staticmethod
    def _entry_node(step_node: Node, name: str) -> Node | None:
        """The file node of a manifest entry, if it is in the tree."""
        node = step_node
        for part in name.split("/"):
            if node.children is None:
                return None
            node = node.children.get(os.fsencode(part))
            if node is None:
                return None
        return node if node.is_file else None

    def _spawn(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run `work` in the background; a failure is logged, never fatal to the mount."""

        async def guarded() -> None:
            try:
                await work()
            except Exception:
                log.exception("eviction from RAM failed")

        trio.lowlevel.spawn_system_task(guarded)

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
        return any(self._holds(step_node, n) for n in self._fetching)

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
            apply_attributes(tmp, entry)
            os.rename(tmp, path)
            node.remote = None
            node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks),
                             os.lstat(path).st_ino)
            if entry.name not in step.resident:
                self.store.add_ref(entry.xxh3, path)
                step.resident.add(entry.name)
