"""The persistent tier's one interface: what a backend (S3, file://) provides, and the errors
it raises.

Keys are relative to the URL's prefix and '/'-separated: `run1/step_100/__0_0.distcp`.
Methods block (network or disk): call them from a worker thread.

Failures are BackendError; `temporary` says whether retrying can help (connection refused or
reset, timeouts, 5xx, SlowDown) or not (missing bucket, wrong credentials). A missing object
is the subclass NotFound, which callers catch by type (never by the message).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from tierfs import reserved
from tierfs.fs.fetch import ObjectMissing

MANIFEST_KEY = reserved.MANIFEST


class BackendError(Exception):
    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


class NotFound(BackendError, ObjectMissing):
    """No object under the key (S3's NoSuchKey or 404, a missing file): final, and to the
    file system's read path the ObjectMissing of its read-source contract."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object {key}", temporary=False)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class Backend(ABC):
    url: str

    @abstractmethod
    def check(self) -> None:
        """Raise BackendError unless the store exists and accepts our credentials."""

    @abstractmethod
    def put_file(self, key: str, path: str | bytes | os.PathLike[str]) -> None:
        """Store a file's bytes under `key`, replacing any object there, in bounded memory."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete these objects; missing ones are not an error."""

    def get_bytes(self, key: str) -> bytes:
        return self.get_range(key, 0, -1)
