"""The versions of each tracker file (`tierfs.trackers`) that may still go to the store.

A saver rewrites its tracker at every save, often faster than its steps reach the store: the
version naming a step may be superseded before that step is in the store, by one naming a step
the store does not hold yet, or never will (`--persist-every` skips it). The store must still
get a tracker naming the newest step it holds that any version named. So the uploader keeps
each version that names a step the store may hold, with its few bytes, until a version naming
a newer step is in the store; whichever version names the newest step the store holds goes up,
the current one or an older one (`Uploader._upload_tracker`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierfs import manifest as mf


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
