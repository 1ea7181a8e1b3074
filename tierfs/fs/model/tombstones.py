"""A tombstone: the record of a deleted (or renamed) committed step that makes the delete
stick on every tier (`fs.lifecycle.deletes` keeps them and carries them out). Plain data, with
its codec: the ports that clean a tier take one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tierfs import manifest as mf


@dataclass
class Tombstone:
    """A deleted step: every version of `path` committed at or before `committed_ns`."""

    path: str
    version: int
    committed_ns: int
    pending: set[str] = field(default_factory=set)  # tiers still to clean
    moved_to: str | None = None  # a rename: where the step's data went

    def old_key(self, key: str) -> str | None:
        """For a rename: the object of the old name that `key` of the new one was."""
        if self.moved_to is None:
            return None
        if key == self.moved_to:
            return self.path
        if key.startswith(self.moved_to + "/"):
            return self.path + key[len(self.moved_to):]
        return None

    def covers(self, manifest: mf.StepManifest) -> bool:
        return manifest.path == self.path and manifest.committed_ns <= self.committed_ns

    def encode(self) -> bytes:
        return json.dumps({"path": self.path, "version": self.version,
                           "committed_ns": self.committed_ns,
                           "pending": sorted(self.pending),
                           **({"moved_to": self.moved_to} if self.moved_to else {})}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Tombstone:
        raw = json.loads(data)
        moved_to = raw.get("moved_to")
        return cls(mf.check_relative_path(raw["path"]), int(raw["version"]),
                   int(raw["committed_ns"]), {str(t) for t in raw["pending"]},
                   None if moved_to is None else mf.check_relative_path(moved_to))
