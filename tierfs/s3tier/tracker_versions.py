"""The versions of each tracker file (`tierfs.trackers`) that may still go to the store.

A saver rewrites its tracker at every save, often faster than its steps reach the store: the
version naming a step may be superseded before that step is in the store, by one naming a step
the store does not hold yet, or never will (`--persist-every` skips it). The store must still
get a tracker naming the newest step it holds that any version named. So the uploader keeps
each version that names a step the store may hold, with its few bytes, until a version naming
a newer step is in the store; whichever version names the newest step the store holds goes up,
the current one or an older one (`Uploader._upload_tracker`).

`TrackerGate` is the uploader's side of it: which tracker versions it queues, which it holds
back until the step they name is in the store, and which goes up when a step gets there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from tierfs import manifest as mf
from tierfs.trackers import MAX_BYTES, TrackedStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerVersion:
    """A committed version of a tracker, its bytes, and the number of the step they name."""

    manifest: mf.StepManifest
    content: bytes
    number: int


class TrackerVersions:
    """Per tracker path: its current version, the versions naming steps the store may hold
    (the newest version for each step number), and the step the store's tracker names as this
    node put it there."""

    def __init__(self) -> None:
        self._current: dict[str, mf.StepManifest] = {}
        self._named: dict[str, dict[int, TrackerVersion]] = {}
        self._stored: dict[str, int] = {}
        # an older version being uploaded now (it counts as current meanwhile)
        self.uploading: dict[str, mf.StepManifest] = {}

    def note(self, manifest: mf.StepManifest, version: TrackerVersion | None) -> None:
        """`manifest` is the tracker's current version; `version` (itself, with its bytes)
        names a step the store may hold (None: one it never will)."""
        current = self._current.get(manifest.path)
        if current is not None and current.version > manifest.version:
            return  # an older version's event, late
        self._current[manifest.path] = manifest
        if version is None or version.number <= self._stored.get(manifest.path, -1):
            return
        self._named.setdefault(manifest.path, {})[version.number] = version

    def current(self, path: str) -> mf.StepManifest | None:
        return self._current.get(path)

    def paths(self) -> list[str]:
        return list(self._current)

    def candidates(self, path: str) -> list[TrackerVersion]:
        """The versions naming a step newer than the one the store's tracker names, the
        newest step first."""
        return sorted(self._named.get(path, {}).values(), key=lambda v: -v.number)

    def stored(self, path: str, number: int) -> None:
        """The store's tracker names step `number` now: versions naming older ones are done."""
        self._stored[path] = max(number, self._stored.get(path, -1))
        named = self._named.get(path, {})
        for older in [n for n in named if n <= self._stored[path]]:
            del named[older]

    def forget(self, path: str) -> None:
        """The tracker is gone (removed, or no longer a tracker)."""
        for table in (self._current, self._named, self._stored, self.uploading):
            table.pop(path, None)


class TrackedSteps(Protocol):
    """What the gate asks of the file system (the part of `uploader.UploadedSteps` it uses)."""

    def object_path(self, xxh3: str) -> str: ...

    def is_current(self, manifest: mf.StepManifest) -> bool: ...

    def tracked_step(self, manifest: mf.StepManifest, content: bytes | None = None
                     ) -> TrackedStep | None: ...


class TrackerGate:
    """The uploader's trackers: a version naming a step not in the store yet is held until
    that step is there (`holds_back`, `release`), and the version naming the newest step the
    store holds is the one to put there (`ready`). `queue` puts a version in the uploader's
    queue, `due` says whether a step number goes to the store (--persist-every)."""

    def __init__(self, steps: TrackedSteps, *, queue: Callable[[mf.StepManifest], None],
                 due: Callable[[int], bool], store_url: str) -> None:
        self._steps = steps
        self._queue = queue
        self._due = due
        self._store_url = store_url
        self._versions = TrackerVersions()
        self._held: dict[str, mf.StepManifest] = {}  # current versions waiting for their step

    def wanted(self, manifest: mf.StepManifest) -> bool:
        """Whether a loose file goes to the store: always (nothing else keeps it), but a
        tracker only with the step it names, so only once that step is in the store or on its
        way there from this node (not one naming a step that is nowhere)."""
        tracked = self._steps.tracked_step(manifest)
        return tracked is None or tracked.persisted or (
            tracked.made_here and self._due(tracked.number))

    def submitted(self, manifest: mf.StepManifest) -> bool:
        """A committed version of a loose file: whether it goes in the uploader's queue now
        (any file but a tracker naming a step the store may not get)."""
        self._held.pop(manifest.path, None)  # an older version: no longer current
        tracked = self._steps.tracked_step(manifest)
        if tracked is None:
            return True
        content = self._bytes(manifest)
        self._versions.note(manifest, TrackerVersion(manifest, content, tracked.number)
                           if content is not None and (tracked.persisted or
                                                       self._due(tracked.number)) else None)
        return self.wanted(manifest) or self.ready(manifest.path) is not None

    def _bytes(self, manifest: mf.StepManifest) -> bytes | None:
        """A tracker version's few bytes, from its committed object (None if gone already)."""
        entry = manifest.files[0]
        if entry.size > MAX_BYTES:
            return None
        try:
            with open(self._steps.object_path(entry.xxh3), "rb") as f:
                return f.read(MAX_BYTES + 1)
        except OSError:
            return None

    def stored(self, path: str, number: int) -> None:
        """The store's tracker names step `number` now: versions naming older ones are done."""
        self._versions.stored(path, number)

    @contextlib.contextmanager
    def uploading(self, version: TrackerVersion) -> Iterator[None]:
        """While an older version (`ready`) goes to the store: it counts as current
        (`worth_uploading`)."""
        path = version.manifest.path
        self._versions.uploading[path] = version.manifest
        try:
            yield
        finally:
            self._versions.uploading.pop(path, None)

    def ready(self, path: str) -> TrackerVersion | None:
        """The tracker version to put in the store now: the one naming the newest step that is
        in the store, newer than the step the store's tracker names; None if there is none."""
        for version in self._versions.candidates(path):
            tracked = self._steps.tracked_step(version.manifest, version.content)
            if tracked is not None and tracked.persisted and tracked.number == version.number:
                return version
        return None

    def worth_uploading(self, manifest: mf.StepManifest) -> bool:
        """Whether `manifest` is worth uploading: the step's current version, or an older
        version of a tracker that is still there, chosen to go up (`ready`)."""
        if self._steps.is_current(manifest):
            return True
        current = self._versions.current(manifest.path)
        return (self._versions.uploading.get(manifest.path) is manifest
                and current is not None and self._steps.is_current(current))

    def waits_for(self, manifest: mf.StepManifest) -> int | None:
        """The step a held tracker version waits for, None if it is not held."""
        if self._held.get(manifest.path) is not manifest:
            return None
        tracked = self._steps.tracked_step(manifest)
        return tracked.number if tracked is not None else None

    def holds_back(self, manifest: mf.StepManifest) -> bool:
        """A tracker whose step is not in the store yet waits (`release`)."""
        tracked = self._steps.tracked_step(manifest) if manifest.step == mf.NO_STEP else None
        if tracked is None or tracked.persisted:
            return False
        if manifest.path not in self._held:
            log.info("%s v%d waits for the step it names (%d) to be in %s", manifest.path,
                     manifest.version, tracked.number, self._store_url)
        self._held[manifest.path] = manifest
        return True

    def release(self) -> None:
        """A step reached the store: the trackers that named it go in the queue now (a
        version naming the newest step the store holds, if not the current one)."""
        for path, manifest in list(self._held.items()):
            if not self._steps.is_current(manifest):
                del self._held[path]
                continue
            tracked = self._steps.tracked_step(manifest)
            if tracked is None or tracked.persisted:
                del self._held[path]
                self._queue(manifest)
        for path in self._versions.paths():
            current = self._versions.current(path)
            if current is None or not self._steps.is_current(current):
                self._versions.forget(path)
            elif self.ready(path) is not None:
                self._held.pop(path, None)
                self._queue(current)
