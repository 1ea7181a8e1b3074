"""The persistent tier's one interface: what a backend (S3, file://) provides, and the errors
it raises.

Keys are relative to the URL's prefix and '/'-separated: `run1/step_100/__0_0.distcp`.
Methods block (network or disk): call them from a worker thread.

Failures are BackendError; `temporary` says whether retrying a request at once can help
(connection refused or reset, timeouts, 5xx, SlowDown) or not (missing bucket, wrong
credentials). A missing object is the subclass NotFound, which callers catch by type (never by
the message); a store that is not there as a whole (a file:// volume not mounted) is
StoreUnavailable, never NotFound: its objects are not missing, the store is.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tierfs import reserved
from tierfs.fs.model.ports import ObjectMissing, TierError

MANIFEST_KEY = reserved.MANIFEST
# A file no larger than this goes up as one short request, whose cost is its round trip to the
# store rather than its bytes: the uploader sends such files SMALL_IN_FLIGHT at a time (a step
# of many small files to a store tens of ms away took 5 ms a file at 4), and the S3 backend
# runs them in a pool of that many threads beside the one for parts.
SMALL_FILE = 1 << 20
SMALL_IN_FLIGHT = 32


class BackendError(TierError):
    """A request the store failed (to the file system's ports: a TierError)."""

    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


class NotFound(BackendError, ObjectMissing):
    """No object under the key (S3's NoSuchKey or 404, a missing file): final, and to the
    file system's read path the ObjectMissing of its read-source contract."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object {key}", temporary=False)


class StoreUnavailable(BackendError):
    """The store as a whole cannot be reached: a file:// root that is missing, or that lost its
    marker (an empty directory where the store's volume should be mounted). Not temporary in
    the sense of a request worth repeating at once (a read fails now, EIO, rather than wait
    for an operator); the uploader retries its steps until the store is back."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"the store {url} is unavailable: {why}", temporary=False)


class UploadGone(BackendError):
    """An upload in parts the store no longer knows (S3's NoSuchUpload: aborted, expired, or
    completed by a request whose reply was lost): final for the part or the completion, and
    the whole file is sent again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, temporary=False)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class Backend(ABC):
    url: str
    # Files larger than this can go up in parts (`start_parts`, `put_part` for each of
    # `parts(size)`, `finish_parts`), each part a request of its own that can be retried
    # alone; None: the backend has no parts, and `put_file` takes any size.
    part_size: int | None = None
    # Whether `restrict` does anything (the uploader calls it only then).
    restricts = False

    @abstractmethod
    def check(self) -> bool:
        """Raise BackendError unless the store exists and accepts our credentials; return
        whether it is new: never used by tierfs (nothing in it, no marker). Changes nothing:
        the mount may still refuse it (`claim` follows if it does not)."""

    @abstractmethod
    def claim(self) -> None:
        """Mark the store as used by tierfs, once a mount accepted it."""

    @abstractmethod
    def put_file(self, key: str, path: str | bytes | os.PathLike[str]) -> None:
        """Store a file's bytes under `key`, replacing any object there, in bounded memory."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    def put_range(self, key: str, path: str | bytes | os.PathLike[str], offset: int,
                  length: int) -> None:
        """Store `length` bytes of the file at `path` from `offset` under `key` (a segment of
        an appended file). Read into memory here: callers send ranges larger than
        `part_size` in parts."""
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise BackendError(f"{os.fsdecode(path)} is shorter than {offset + length} bytes",
                               temporary=False)
        self.put_bytes(key, data)

    def parts(self, size: int) -> list[tuple[int, int, int]]:
        """(number, offset, length) of each part of a file of `size` bytes, numbered from 1."""
        assert self.part_size is not None, "a backend without parts"
        return [(number, offset, min(self.part_size, size - offset))
                for number, offset in enumerate(range(0, size, self.part_size), 1)]

    def start_parts(self, key: str) -> str:
        """Begin an upload in parts of the object `key`; returns the upload's id."""
        raise NotImplementedError

    def put_part(self, key: str, upload_id: str, number: int,
                 path: str | bytes | os.PathLike[str], offset: int, length: int) -> object:
        """Send `length` bytes of `path` from `offset` as part `number`; returns the receipt
        that `finish_parts` needs. UploadGone if the store no longer knows the upload."""
        raise NotImplementedError

    def finish_parts(self, key: str, upload_id: str, receipts: Sequence[object]) -> None:
        """Make the object from the parts (receipts in part order). UploadGone if the store
        no longer knows the upload, even if it was completed by an earlier request."""
        raise NotImplementedError

    def abandon_parts(self, key: str, upload_id: str) -> None:
        """Drop an upload in parts and the parts it holds."""
        raise NotImplementedError

    @abstractmethod
    def copy(self, source: str, key: str) -> None:
        """Store the bytes of the object `source` under `key` too, inside the store (S3
        CopyObject, UploadPartCopy for objects beyond one copy request; file:// a hard link):
        a rename in the store moves no byte through this node. NotFound if `source` is not
        there."""

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`."""

    def size(self, key: str) -> int | None:
        """The size of the object `key` now (S3 HEAD), None if there is none."""
        return next((o.size for o in self.list(key) if o.key == key), None)

    def remove_leftovers(self) -> int:
        """At start: remove what uploads cut short left in the store that its listing does
        not show (a file:// store's temporary objects); the number removed. S3 has nothing
        of the kind: a multipart upload given up is aborted by the uploader."""
        return 0

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete these objects; missing ones are not an error."""

    def get_bytes(self, key: str) -> bytes:
        return self.get_range(key, 0, -1)

    def restrict(self, objects: list[tuple[str, int, int]]) -> None:
        """Each (key, mode, gid): the object holds a file whose mode and group under the mount
        are these; let no more users read it directly in the store than may read the file
        there. (A bucket's objects are read with the store's own credentials: nothing to
        do.)"""
        return None
