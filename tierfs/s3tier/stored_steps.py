"""What the store holds of the mount's steps, and taking a step out of it.

The uploader puts steps in (`tierfs.s3tier.uploader`); this module reads what is there and
removes it: a step's stored manifest and file entries (what an upload compares against), the
steps of a run directory and the one its stored tracker names (what retention keeps), the whole
listing read at mount (the complete steps a fresh node adopts, the symbolic links kept beside
them, the leftovers of uploads cut short), and a step's removal, manifest first so that the
step is never seen half gone. Every method that says "blocking" runs in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import Protocol

import trio

from tierfs import layout, trackers
from tierfs import manifest as mf
from tierfs.fs.model import links as symlinks
from tierfs.s3tier.interface import MANIFEST_KEY, Backend, BackendError, NotFound, ObjectInfo
from tierfs.trackers import MAX_BYTES

log = logging.getLogger(__name__)


class StepNames(Protocol):
    """The mount's step patterns: the step number a name gives (None: not a step)."""

    def step_number(self, name: str) -> int | None: ...

    def file_step_number(self, name: str) -> int | None: ...


class StoredSteps:
    """The steps in `backend`, named by `names`. `shared`: the store is a cluster's, whose
    other nodes may be sending their shares of a step whose manifest is not up yet; `pending`:
    the steps queued for upload here (live)."""

    def __init__(self, backend: Backend, names: StepNames, *, shared: bool,
                 pending: Container[str]) -> None:
        self.backend = backend
        self._names = names
        self._shared = shared
        self._pending = pending

    def entries(self, path: str, single_file: bool) -> dict[str, mf.FileEntry]:
        """Name -> entry of the files of the version of `path` in the store (blocking; empty
        if none or unreadable)."""
        try:
            stored = mf.decode(self.backend.get_bytes(layout.manifest_key(path, single_file)))
        except (NotFound, mf.ManifestError):
            return {}
        if stored.path != path:
            return {}
        return {f.name: f for f in stored.files}

    def manifest(self, path: str) -> tuple[bool, bytes | None]:
        """Whether the step at `path` is stored as a single file, and its manifest (None if
        there is none: then it is taken for a directory). Blocking."""
        for single_file in (True, False):
            try:
                return single_file, self.backend.get_bytes(layout.manifest_key(path, single_file))
            except NotFound:
                continue
        return False, None

    def tracker(self, path: str) -> bytes | None:
        """The bytes of the tracker the store holds at `path` (blocking; None: none)."""
        try:
            data = self.backend.get_bytes(path)
        except NotFound:
            return None
        return data if len(data) <= MAX_BYTES else None

    def remove(self, path: str, single_file: bool | None = None) -> list[ObjectInfo]:
        """Remove the step at `path` from the store: its manifest first, so it is never seen
        half gone, then its data (blocking). A single file's object is `path` itself."""
        if single_file is None:
            single_file = self.manifest(path)[0]
        self.backend.delete([layout.manifest_key(path, single_file)])
        if single_file:
            objects = [o for o in self.backend.list(path) if o.key == path]
            objects += list(self.backend.list(layout.records_dir(path, True) + "/"))
        else:
            objects = list(self.backend.list(f"{path}/"))
        self.backend.delete([o.key for o in objects])
        return objects

    async def steps_in(self, run_dir: str) -> tuple[dict[str, int], list[str]]:
        """The steps of `run_dir` with a manifest in the store (path -> number), and its
        trackers there."""
        prefix = f"{run_dir}/" if run_dir else ""
        objects = await trio.to_thread.run_sync(lambda: list(self.backend.list(prefix)))
        steps, tracker_paths = {}, []
        for obj in objects:
            head, _, name = obj.key.rpartition("/")
            path, single_file = layout.step_of_records_dir(head)
            parent, _, base = path.rpartition("/")
            if name == MANIFEST_KEY and parent == run_dir:
                if single_file and base in trackers.TRACKER_NAMES:
                    tracker_paths.append(path)
                number = (self._names.file_step_number if single_file
                          else self._names.step_number)(base)
                if number is None and not single_file:  # a step with no step name, named
                    number = await trio.to_thread.run_sync(self._stored_number, obj.key)
                if number is not None:
                    steps[path] = number
        return steps, tracker_paths

    def named_by_tracker(self, tracker: str, steps: dict[str, int]) -> set[str]:
        """The steps of `steps` that the store's tracker at `tracker` names (blocking)."""
        named = trackers.named_step(self.tracker(tracker) or b"")
        run_dir = tracker.rpartition("/")[0]
        if isinstance(named, str):
            path = layout.join(run_dir, named)
            return {path} if path in steps else set()
        return {path for path, number in steps.items() if number == named}

    def _stored_number(self, manifest_key: str) -> int | None:
        """The step number the stored manifest at `manifest_key` gives (blocking)."""
        try:
            number = mf.decode(self.backend.get_bytes(manifest_key)).step
        except (NotFound, mf.ManifestError):
            return None
        return None if number == mf.NO_STEP else number

    # -- read once at mount ---------------------------------------------------------------

    async def listing(self) -> list[ObjectInfo]:
        """Every object in the store (for `complete_steps` and `links`)."""
        return await trio.to_thread.run_sync(lambda: list(self.backend.list("")))

    async def complete_steps(self, objects: list[ObjectInfo]) -> list[mf.StepManifest]:
        """Every complete step among the store's `objects`; leftovers of interrupted uploads
        are removed (not in a shared store: there, other nodes may be sending their shares of
        a step whose manifest is not up yet; a retried upload replaces such objects, and the
        manifest's writer removes those its version does not name)."""
        manifests, step_dirs = [], {}
        for obj in objects:
            head, _, name = obj.key.rpartition("/")
            if name == MANIFEST_KEY:
                try:
                    data = await trio.to_thread.run_sync(self.backend.get_bytes, obj.key)
                    manifest = mf.decode(data)
                except (BackendError, mf.ManifestError) as exc:
                    log.error("skipping unreadable manifest %s: %s", obj.key, exc)
                    continue
                if layout.records_dir(manifest.path, manifest.single_file) != head:
                    log.error("skipping manifest %s: it names step %s", obj.key, manifest.path)
                    continue
                manifests.append(manifest)
            step_dir = self._enclosing_step_dir(obj.key)
            if step_dir is not None:
                step_dirs.setdefault(step_dir, []).append(obj.key)
        complete = {m.path for m in manifests}
        for step_dir, keys in () if self._shared else step_dirs.items():
            if step_dir not in complete and step_dir not in self._pending:
                log.info("removing %d objects of the incomplete upload %s", len(keys), step_dir)
                await trio.to_thread.run_sync(self.backend.delete, keys)
        return sorted(manifests, key=lambda m: (m.step, m.path))

    def _enclosing_step_dir(self, key: str) -> str | None:
        parts = key.split("/")[:-1]
        for depth in range(1, len(parts) + 1):  # the outermost: nothing inside a step is one
            if self._names.step_number(parts[depth - 1]) is not None:
                return "/".join(parts[:depth])
        return None

    async def links(self, objects: list[ObjectInfo]) -> dict[str, dict[str, str]]:
        """Directory -> its symbolic links (`fs.model.links`), for every directory whose links
        object is among the store's `objects`."""
        found = {}
        for obj in objects:
            directory, _, name = obj.key.rpartition("/")
            if name != symlinks.LINKS_OBJECT:
                continue
            try:
                data = await trio.to_thread.run_sync(self.backend.get_bytes, obj.key)
                found[directory] = symlinks.decode(directory, data)
            except (BackendError, ValueError) as exc:
                log.error("skipping the links in %s: %s", obj.key, exc)
        return found
