"""Opening the persistent tier by URL, and its local-directory (file://) backend.

The interface both backends implement is in `tierfs.s3tier.interface` (re-exported here); the
S3 backend in `tierfs.s3tier.s3_backend`, imported only when an s3:// URL is opened (boto3 is
slow to import). Both store plain objects with the same bytes as under the mount, so standard
tools read them without tierfs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

from tierfs import reserved
from tierfs.s3tier.interface import (
    MANIFEST_KEY,
    Backend,
    BackendError,
    NotFound,
    ObjectInfo,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

__all__ = ["MANIFEST_KEY", "Backend", "BackendError", "FileBackend", "NotFound", "ObjectInfo",
           "StoreUnavailable", "open_backend"]


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
    """A directory with the same layout as the bucket; writes are atomic (temp, fsync, rename).

    What it creates is never writable by group or others (directories 0755, as in a bucket only
    the owner writes; the daemon's umask is 0), and an object is readable by its owner only
    (0600) until `restrict` gives it the read bits and group of the file it holds under the
    mount: no local user reads a checkpoint directly from the store that may not read it under
    the mount (tierfs's own records, packs among them, stay 0600). The root must be empty or
    already a
    store (marked by STORE_MARK), since the store's contents are listed and incomplete uploads
    removed: `file:///` or a home directory is refused rather than walked and pruned.

    The mark also tells the store from the directory it lives in: an NFS, Lustre or FSx volume
    that is not mounted (yet, or any more) leaves an empty directory, or none, where the store
    should be. Every request first finds the mark (`_require_store`; a read only once it found
    no object), so such a store is StoreUnavailable: nothing is written beside the volume, and
    no object is called missing while the whole store is.

    An object is written under a temporary name beside it, `.tierfs-upload-<host>-<pid>-<n>`
    (short, whatever the length of the name it becomes), then renamed. One that cannot be
    removed when its write fails (the store moved away or made read-only meanwhile) is
    noted and removed at the next request, once the store is back (`_remove_noted`); those a
    killed daemon left are removed at start (`remove_leftovers`). The listing skips such
    names, so nothing else would ever remove them."""

    TMP_PREFIX = reserved.UPLOAD + "-"
    # `<name>.<pid>.tierfs-upload`, left by older versions
    OLD_TMP_SUFFIX = reserved.UPLOAD
    STORE_MARK = reserved.STORE
    DIR_MODE, FILE_MODE, OBJECT_MODE = 0o755, 0o644, 0o600
    restricts = True
    LEGACY_SCAN = 4, 2000  # depth and entries searched for the manifests of an older store
    # A temporary object of another host is removed at start only once unchanged this long
    # (seconds): that host's upload may still be writing it (a shared NFS or Lustre store).
    FOREIGN_LEFTOVER_AGE = 24 * 3600

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"
        self._unique = itertools.count()
        self._host = socket.gethostname()[:64].replace("/", "_")
        self._noted: set[str] = set()  # temporary objects a failed write could not remove
        self._writing: set[str] = set()  # temporary objects being written now (any thread)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise BackendError(f"unsafe key {key!r}", temporary=False)
        return self.root / key

    def check(self) -> bool:
        if not self.root.is_dir():
            raise BackendError(f"{self.root} does not exist or is not a directory",
                               temporary=False)
        if not os.access(self.root, os.W_OK):
            raise BackendError(f"{self.root} is not writable", temporary=False)
        if (self.root / self.STORE_MARK).exists():
            return False
        if not any(self.root.iterdir()):
            return True
        if self._holds_manifests():
            return False  # a store made before STORE_MARK existed
        raise BackendError(f"{self.root} is not empty and is not a tierfs store: give an "
                           "empty directory (tierfs lists and prunes what the store holds)",
                           temporary=False)

    def claim(self) -> None:
        mark = self.root / self.STORE_MARK
        try:
            os.close(os.open(mark, os.O_WRONLY | os.O_CREAT, self.FILE_MODE))
        except OSError as exc:
            raise BackendError(f"{mark}: {exc.strerror}", temporary=False) from exc

    def _require_store(self) -> None:
        """Raise StoreUnavailable unless the root is here with its mark (see the class)."""
        try:
            os.stat(self.root / self.STORE_MARK)
        except (FileNotFoundError, NotADirectoryError):
            why = (f"{self.root} has no {self.STORE_MARK} (is the store's volume mounted?)"
                   if self.root.is_dir() else f"{self.root} is missing")
            raise StoreUnavailable(self.url, why) from None
        except OSError as exc:  # a volume gone bad: EIO, ESTALE, ENOTCONN
            raise StoreUnavailable(self.url, f"{self.root}: {exc.strerror}") from None

    def _holds_manifests(self) -> bool:
        """Whether the root is a store made before STORE_MARK existed: a manifest near the top
        (a bounded search, on the root's own file system)."""
        max_depth, budget = self.LEGACY_SCAN
        device = os.stat(self.root).st_dev
        level = [str(self.root)]
        for _depth in range(max_depth):
            deeper = []
            for directory in level:
                if os.path.isfile(os.path.join(directory, MANIFEST_KEY)):
                    return True  # looked up by name: a step of many files costs no budget
                try:
                    with os.scandir(directory) as entries:
                        for entry in entries:
                            budget -= 1
                            if entry.is_dir(follow_symlinks=False) and \
                                    entry.stat(follow_symlinks=False).st_dev == device:
                                deeper.append(entry.path)
                            if budget <= 0:
                                return False
                except OSError:
                    continue
            level = deeper
        return False

    def _make_dirs(self, directory: Path) -> None:
        """Create `directory` and its missing parents with DIR_MODE (os.makedirs would leave
        the intermediate ones to the umask)."""
        missing = []
        while not directory.is_dir() and directory != self.root:
            missing.append(directory)
            directory = directory.parent
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made meanwhile by another upload
                path.mkdir(self.DIR_MODE)

    def _write_atomically(self, key: str, writer) -> None:  # type: ignore[no-untyped-def]
        def write(tmp: Path) -> None:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.OBJECT_MODE),
                      "wb") as f:
                writer(f)
                f.flush()
                os.fsync(f.fileno())

        self._place(key, write)

    def _place(self, key: str, make: Callable[[Path], None]) -> None:
        """The object `key` appears whole or not at all: `make` makes it under a temporary
        name beside it, which is then renamed over it (and removed if anything fails)."""
        target = self._path(key)
        self._require_store()
        self._remove_noted()
        tmp = None
        try:
            self._make_dirs(target.parent)
            tmp = target.parent / (f"{self.TMP_PREFIX}{self._host}-{os.getpid()}-"
                                   f"{next(self._unique)}")
            self._writing.add(str(tmp))
            make(tmp)
            os.rename(tmp, target)
        except OSError as exc:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:  # read-only, or moved away with the store (or never made)
                    self._noted.add(os.path.relpath(tmp, self.root))
            self._require_store()  # the volume went away during the write
            raise BackendError(f"{target}: {exc.strerror}", temporary=False) from exc
        finally:
            if tmp is not None:
                self._writing.discard(str(tmp))

    def _remove_noted(self) -> None:
        """Remove the temporary objects failed writes could not (the store is here again)."""
        for rel in list(self._noted):
            try:
                os.unlink(self.root / rel)
            except FileNotFoundError:
                pass
            except OSError:
                continue  # still read-only: the next request tries again
            self._noted.discard(rel)

    def remove_leftovers(self) -> int:
        """At start: remove the temporary objects that uploads cut short left in the store
        (this host's whose process is gone; another host's unchanged for
        FOREIGN_LEFTOVER_AGE), and the empty directories they leave. The number removed."""
        self._require_store()
        removed = 0
        now = time.time()
        for dirpath, _dirs, files in os.walk(self.root, topdown=False):
            here = 0
            for name in files:
                path = os.path.join(dirpath, name)
                if not self._is_tmp(name) or path in self._writing:
                    continue
                try:
                    if self._abandoned(name, now - os.lstat(path).st_mtime):
                        os.unlink(path)
                        here += 1
                except OSError:
                    continue  # renamed by its upload meanwhile, or the store is read-only
            if here and dirpath != str(self.root):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)  # only if empty: an upload cut short made it
            removed += here
        if removed:
            log.info("removed %d temporary objects of uploads cut short from %s", removed,
                     self.url)
        return removed

    def _is_tmp(self, name: str) -> bool:
        return name.startswith(self.TMP_PREFIX) or name.endswith(self.OLD_TMP_SUFFIX)

    def _abandoned(self, name: str, age: float) -> bool:
        """Whether the temporary object `name`, unchanged for `age` seconds, belongs to no
        upload under way: its process is gone (or is this one, which starts now), or it is
        another host's and old."""
        if name.endswith(self.OLD_TMP_SUFFIX):  # `<name>.<pid>.tierfs-upload`
            host = self._host
            pid_text = name[:-len(self.OLD_TMP_SUFFIX)].rstrip(".").rpartition(".")[2]
        else:
            parts = name[len(self.TMP_PREFIX):].rsplit("-", 2)
            # `<host>-<pid>-<n>`; `<pid>-<n>` from before the host was in the name
            host, pid_text = (parts[0], parts[1]) if len(parts) == 3 else (self._host, parts[0])
        if host != self._host:
            return age > self.FOREIGN_LEFTOVER_AGE
        try:
            pid = int(pid_text)
        except ValueError:
            return age > self.FOREIGN_LEFTOVER_AGE
        return pid == os.getpid() or not _process_alive(pid)

    def put_file(self, key: str, path: str | bytes | os.PathLike[str]) -> None:
        def copy(dst) -> None:  # type: ignore[no-untyped-def]
            with open(path, "rb") as src:
                shutil.copyfileobj(src, dst, 8 << 20)

        self._write_atomically(key, copy)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write_atomically(key, lambda f: f.write(data))

    def put_range(self, key: str, path: str | bytes | os.PathLike[str], offset: int,
                  length: int) -> None:
        """Streamed, in bounded memory: a segment of a file:// store may be of any size."""
        def copy(dst) -> None:  # type: ignore[no-untyped-def]
            with open(path, "rb") as src:
                src.seek(offset)
                left = length
                while left and (piece := src.read(min(left, 8 << 20))):
                    dst.write(piece)
                    left -= len(piece)

        self._write_atomically(key, copy)

    def copy(self, source: str, key: str) -> None:
        """A hard link: objects are never written in place (every write is a rename), so the
        two names may share an inode."""
        origin = self._path(source)
        try:
            self._place(key, lambda tmp: os.link(origin, tmp))
        except StoreUnavailable:
            raise
        except BackendError:
            if not origin.is_file():
                raise NotFound(source) from None
            raise

    def restrict(self, objects: list[tuple[str, int, int]]) -> None:
        """Read bits for group and others as each file has them, its group (as root), never
        more: the owner stays the daemon's user, the only one that writes."""
        as_root = os.geteuid() == 0
        for key, mode, gid in objects:
            path = self._path(key)
            try:
                if gid >= 0 and as_root:
                    os.chown(path, -1, gid)
                os.chmod(path, self.OBJECT_MODE | (mode & 0o044))
            except FileNotFoundError:
                raise NotFound(key) from None
            except OSError as exc:
                self._require_store()
                raise BackendError(f"{key}: {exc.strerror}", temporary=False) from exc

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                return f.read() if length < 0 else f.read(length)
        except (FileNotFoundError, NotADirectoryError):  # a/b where a is an object: no a/b
            self._require_store()
            raise NotFound(key) from None
        except OSError as exc:
            self._require_store()
            raise BackendError(f"{key}: {exc.strerror}", temporary=False) from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._require_store()  # an absent store is not an empty one
        # Only the directory the prefix lies in: a step's listing must not walk the store.
        top = self._path(prefix.rpartition("/")[0]) if "/" in prefix else self.root
        for dirpath, _dirs, files in os.walk(top):
            for name in sorted(files):
                if name.startswith(self.TMP_PREFIX) or name.endswith(self.OLD_TMP_SUFFIX) or \
                        (name == self.STORE_MARK and dirpath == str(self.root)):
                    continue
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    yield ObjectInfo(key, os.lstat(full).st_size)

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            self._require_store()  # an absent store is not a missing object
            return None
        except OSError as exc:
            self._require_store()
            raise BackendError(f"{key}: {exc.strerror}", temporary=False) from exc
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._require_store()  # else the delete "succeeds", and the step comes back
            self._remove_noted()  # a step's directory goes with its last object
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                continue
            parent = path.parent
            while parent != self.root:  # leave no empty step directories behind
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True
