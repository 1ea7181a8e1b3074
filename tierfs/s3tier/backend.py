"""The persistent tier's one interface, with an S3 (boto3) and a local-directory implementation.

Keys are relative to the URL's prefix and '/'-separated: `run1/step_100/__0_0.distcp`. Both
backends store plain objects with the same bytes as under the mount, so standard tools read
them without tierfs. Methods block (network or disk): call them from a worker thread.

Failures are BackendError; `temporary` says whether retrying can help (connection refused or
reset, timeouts, 5xx, SlowDown) or not (missing bucket, wrong credentials).
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

MANIFEST_KEY = ".tierfs-manifest"


class BackendError(Exception):
    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


class NotFound(BackendError):
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


def open_backend(url: str, endpoint: str | None = None) -> Backend:
    """`s3://bucket/prefix` or `file:///absolute/path`; ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc or not parsed.path.startswith("/"):
            raise ValueError(f"{url}: a file URL needs an absolute path, like file:///data/ckpt")
        return FileBackend(Path(parsed.path))
    if parsed.scheme == "s3":
        if not 3 <= len(parsed.netloc) <= 63:
            raise ValueError(f"{url}: bucket names have 3 to 63 characters")
        from tierfs.s3tier.s3_backend import S3Backend  # boto3 only when S3 is used

        return S3Backend(parsed.netloc, parsed.path.strip("/"), endpoint)
    raise ValueError(f"{url}: the persistent tier must be s3://bucket/prefix or file:///path")


class FileBackend(Backend):
    """A directory with the same layout as the bucket; writes are atomic (temp, fsync, rename)."""

    TMP_SUFFIX = ".tierfs-upload"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise BackendError(f"unsafe key {key!r}", temporary=False)
        return self.root / key

    def check(self) -> None:
        if not self.root.is_dir():
            raise BackendError(f"{self.root} does not exist or is not a directory",
                               temporary=False)
        if not os.access(self.root, os.W_OK):
            raise BackendError(f"{self.root} is not writable", temporary=False)

    def _write_atomically(self, key: str, writer) -> None:  # type: ignore[no-untyped-def]
        target = self._path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{os.getpid()}{self.TMP_SUFFIX}")
            with open(tmp, "wb") as f:
                writer(f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, target)
        except OSError as exc:
            raise BackendError(f"{target}: {exc.strerror}", temporary=False) from exc

    def put_file(self, key: str, path: str | bytes | os.PathLike[str]) -> None:
        def copy(dst) -> None:  # type: ignore[no-untyped-def]
            with open(path, "rb") as src:
                shutil.copyfileobj(src, dst, 8 << 20)

        self._write_atomically(key, copy)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write_atomically(key, lambda f: f.write(data))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                return f.read() if length < 0 else f.read(length)
        except FileNotFoundError:
            raise NotFound(key) from None
        except OSError as exc:
            raise BackendError(f"{key}: {exc.strerror}", temporary=False) from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Only the directory the prefix lies in: a step's listing must not walk the store.
        top = self._path(prefix.rpartition("/")[0]) if "/" in prefix else self.root
        for dirpath, _dirs, files in os.walk(top):
            for name in sorted(files):
                if name.endswith(self.TMP_SUFFIX):
                    continue
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    yield ObjectInfo(key, os.lstat(full).st_size)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            parent = path.parent
            while parent != self.root:  # leave no empty step directories behind
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent
