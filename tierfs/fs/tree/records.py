"""The small records a step directory keeps in the RAM store beside its files: the committed
manifest, the persistent tier's state (`persisted`/`retired`), the peers holding a replica and
the peers a step was learned from. Written atomically (temp file, fsync, rename); read back at
start-up by `fs.lifecycle.recovery`.

Paths only, no nodes: the `Tree` decides when a record changes and keeps its `StepState` in
step with it. During start-up the tree may be deeper than PATH_MAX: `long_paths()` switches
`reach` to a `PathReach` until the tree is built.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

from tierfs import manifest as mf
from tierfs import reserved
from tierfs.fs.model.nodes import MANIFEST, PERSISTED_MARK
from tierfs.fs.store.long_paths import PathReach
from tierfs.fs.tree.dir_attributes import times_kept

log = logging.getLogger(__name__)


def _direct(path: bytes) -> bytes:
    return path


class StepRecords:
    """Reads and writes the records of step directories, given their paths in the store."""

    def __init__(self) -> None:
        # Paths come from `Tree.backing()`, which keeps them short, except during start-up.
        self.reach: Callable[[bytes], bytes] = _direct

    @contextlib.contextmanager
    def long_paths(self) -> Iterator[None]:
        """Reach paths of any length (start-up walks the store by path; nothing moves)."""
        reach = PathReach()
        self.reach = reach
        try:
            yield
        finally:
            reach.close()
            self.reach = _direct

    def walk(self, top: bytes) -> Iterator[tuple[bytes, list[bytes], list[bytes]]]:
        """`os.walk` (top down; prune by editing the directory list) for trees deeper than
        PATH_MAX; an unreadable directory is skipped, as os.walk does."""
        stack = [top]
        while stack:
            path = stack.pop()
            dirs, files = [], []
            try:
                with os.scandir(self.reach(path)) as entries:
                    for entry in entries:
                        (dirs if entry.is_dir(follow_symlinks=False) else files).append(
                            entry.name)
            except OSError:
                continue
            yield path, dirs, files
            stack.extend(os.path.join(path, d) for d in reversed(dirs))

    # -- writing -----------------------------------------------------------------------------

    def write_atomically(self, path: bytes, data: bytes) -> None:
        """`path` replaced by `data` as a whole; its directory's times stay as they were (a
        step's records are not the job's change: `fs.tree.dir_attributes`)."""
        with times_kept(self.reach(os.path.dirname(path))):
            os.rename(self.reach(self.write_temp(path, data)), self.reach(path))

    def write_temp(self, path: bytes, data: bytes) -> bytes:
        """`data` written and synced beside `path`, for a rename into place; nothing is left
        behind when that fails (a full RAM dir)."""
        tmp = path + reserved.TEMP_SUFFIX.encode()
        try:
            with open(os.open(self.reach(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                      "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.reach(tmp))
            raise
        return tmp

    def write_manifest(self, dir_path: bytes, manifest: mf.StepManifest) -> None:
        self.write_atomically(os.path.join(dir_path, MANIFEST), mf.encode(manifest))

    def write_persist_mark(self, dir_path: bytes, version: int, state: str) -> None:
        self.write_atomically(os.path.join(dir_path, PERSISTED_MARK),
                              f"{version} {state}\n".encode())

    def write_node_list(self, dir_path: bytes, mark: bytes, version: int,
                        nodes: set[str]) -> None:
        line = " ".join([str(version), *sorted(nodes)])
        self.write_atomically(os.path.join(dir_path, mark), line.encode())

    # -- reading -----------------------------------------------------------------------------

    def persist_mark(self, dir_path: bytes) -> tuple[int, str] | None:
        try:
            with open(self.reach(os.path.join(dir_path, PERSISTED_MARK))) as f:
                version_text, state = f.read().split()
            return int(version_text), state
        except (FileNotFoundError, ValueError):
            return None

    def read_node_list(self, dir_path: bytes, mark: bytes, version: int) -> set[str] | None:
        """The node ids a mark file records for `version`, or None if it records none."""
        try:
            with open(self.reach(os.path.join(dir_path, mark))) as f:
                recorded, *nodes = f.read().split()
        except (FileNotFoundError, ValueError):
            return None
        return set(nodes) if recorded == str(version) else None

    def read_manifest(self, dir_path: bytes) -> mf.StepManifest | None:
        """The committed manifest of a step directory; a damaged one is set aside."""
        path = os.path.join(dir_path, MANIFEST)
        try:
            with open(self.reach(path), "rb") as f:
                return mf.decode(f.read())
        except FileNotFoundError:
            return None
        except mf.ManifestError as exc:
            log.error("unreadable manifest %s set aside: %s", os.fsdecode(path), exc)
            os.rename(self.reach(path), self.reach(path + b".damaged"))
            return None

    def set_aside(self, dir_path: bytes) -> None:
        manifest_path = os.path.join(dir_path, MANIFEST)
        os.rename(self.reach(manifest_path), self.reach(manifest_path + b".damaged"))
