"""What the persistent tier holds of a step version now, seen in one listing of its objects
(sizes, not bytes): whether its manifest is there, and which of its files have their objects
at their sizes. tierfs asks this whenever it would act on its own belief that the store holds a
step: before the last copy of a file leaves RAM, before an upload skips a file the stored
manifest already names, and at mount for the steps the RAM dir records as persisted. A mark
written earlier says what the store held then; a bucket deleted and made again, or a prefix
emptied, holds nothing of it now.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierfs import layout
from tierfs import manifest as mf
from tierfs.s3tier.interface import Backend, ObjectInfo


@dataclass(frozen=True)
class Held:
    """A step version as its objects in the store show it."""

    manifest: bool  # the step's manifest object is there (without it the step is incomplete)
    files: frozenset[str]  # the files whose objects are there at their sizes

    def whole(self, manifest: mf.StepManifest) -> bool:
        return self.manifest and all(e.name in self.files for e in manifest.files)

    def lacking(self, manifest: mf.StepManifest) -> list[str]:
        """The files the store does not hold (all of them when its manifest is missing: a
        step without one is never served, and its objects are removed at the next mount)."""
        return [e.name for e in manifest.files if not self.manifest or e.name not in self.files]


def held_in(manifest: mf.StepManifest, objects: list[ObjectInfo]) -> Held:
    """What `objects` (a listing of the store that covers the step's objects) hold of it."""
    sizes = {o.key: o.size for o in objects}
    data_dir = layout.data_dir(manifest.path, manifest.single_file)
    files = set()
    for entry in manifest.files:
        key = layout.object_key(data_dir, entry.name)
        pieces = zip(layout.piece_keys(key, entry.segments), entry.pieces(), strict=True)
        # A base object may be longer than its piece: the whole file, uploaded again.
        if all(sizes.get(piece) == length or (piece == key and entry.segments
                                              and sizes.get(piece, -1) >= length)
               for piece, (_offset, length) in pieces):
            files.add(entry.name)
    return Held(layout.manifest_key(manifest.path, manifest.single_file) in sizes,
                frozenset(files))


def held_now(backend: Backend, manifest: mf.StepManifest) -> Held:
    """Ask the store what it holds of the step now (blocking; BackendError if it cannot
    answer): a step directory's objects in one listing of it; a single file's object by its
    size (S3 HEAD: a listing of its name would walk its whole directory in a file:// store),
    its manifest and segments in a listing of its records directory."""
    if not manifest.single_file:
        return held_in(manifest, list(backend.list(f"{manifest.path}/")))
    objects = list(backend.list(f"{layout.records_dir(manifest.path, True)}/"))
    size = backend.size(manifest.path)
    if size is not None:
        objects.append(ObjectInfo(manifest.path, size))
    return held_in(manifest, objects)
