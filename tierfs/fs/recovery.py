"""Start-up: rebuilding the namespace from the RAM store after a restart or a crash, and the
small records a step directory keeps on disk (manifest, persisted, replicas, peers) that
start-up reads back. A mixin of Namespace."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator

from tierfs import manifest as mf
from tierfs.fs.long_paths import PathReach
from tierfs.fs.nodes import (
    MANIFEST,
    METADATA,
    PEERS_MARK,
    PERSISTED_MARK,
    REPLICAS_MARK,
    Node,
    Seal,
    StepState,
)
from tierfs.fs.ram_store import is_reserved

log = logging.getLogger(__name__)


class Recovery:
    """Rebuilding the tree from the RAM store, and the records a step keeps on disk."""

    # Paths below come from `backing()`, which keeps them short, except during `load`, which
    # walks the store by path and reaches long ones through `PathReach`.
    _reach: Callable[[bytes], bytes] = staticmethod(lambda path: path)

    def _walk(self, top: bytes) -> Iterator[tuple[bytes, list[bytes], list[bytes]]]:
        """`os.walk` (top down; prune by editing the directory list) for trees deeper than
        PATH_MAX; an unreadable directory is skipped, as os.walk does."""
        stack = [top]
        while stack:
            path = stack.pop()
            dirs, files = [], []
            try:
                with os.scandir(self._reach(path)) as entries:
                    for entry in entries:
                        (dirs if entry.is_dir(follow_symlinks=False) else files).append(
                            entry.name)
            except OSError:
                continue
            yield path, dirs, files
            stack.extend(os.path.join(path, d) for d in reversed(dirs))

    def _write_persist_mark(self, node: Node, version: int, state: str) -> None:
        path = os.path.join(self.backing(node), PERSISTED_MARK)
        self._write_file_atomically(path, f"{version} {state}\n".encode())

    def _write_file_atomically(self, path: bytes, data: bytes) -> None:
        os.rename(self._reach(self._write_temp_file(path, data)), self._reach(path))

    def _write_temp_file(self, path: bytes, data: bytes) -> bytes:
        """`data` written and synced beside `path`, for a rename into place; nothing is left
        behind when that fails (a full RAM dir)."""
        tmp = path + b".tmp"
        try:
            with open(os.open(self._reach(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                      "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._reach(tmp))
            raise
        return tmp

    def _persist_mark(self, dir_path: bytes) -> tuple[int, str] | None:
        try:
            with open(self._reach(os.path.join(dir_path, PERSISTED_MARK))) as f:
                version_text, state = f.read().split()
            return int(version_text), state
        except (FileNotFoundError, ValueError):
            return None

    def _apply_persist_mark(self, step: StepState, dir_path: bytes) -> None:
        mark = self._persist_mark(dir_path)
        if step.manifest is None or mark is None or mark[0] != step.manifest.version:
            return
        if mark[1] == "persisted":
            step.persisted_version = mark[0]
        elif mark[1] == "retired":
            step.retired_version = mark[0]

    def _apply_node_marks(self, step: StepState, dir_path: bytes) -> None:
        if step.manifest is not None:
            version = step.manifest.version
            step.replicas = self._read_node_list(dir_path, REPLICAS_MARK, version) or set()
            step.holders = self._read_node_list(dir_path, PEERS_MARK, version) or set()

    def _read_node_list(self, dir_path: bytes, mark: bytes, version: int) -> set[str] | None:
        """The node ids a mark file records for `version`, or None if it records none."""
        try:
            with open(self._reach(os.path.join(dir_path, mark))) as f:
                recorded, *nodes = f.read().split()
        except (FileNotFoundError, ValueError):
            return None
        return set(nodes) if recorded == str(version) else None

    def _write_node_list(self, step_node: Node, mark: bytes, nodes: set[str]) -> None:
        line = " ".join([str(step_node.step.manifest.version), *sorted(nodes)])
        self._write_file_atomically(os.path.join(self.backing(step_node), mark), line.encode())

    def load(self) -> None:
        """Rebuild the namespace from the RAM store after a restart or a crash.

        Committed steps are put back exactly as their manifests say (uncommitted writes into a
        committed step are dropped); files of persisted steps that left RAM come back as
        non-resident; leftovers of interrupted saves, fetches and commits are removed.
        """
        started = time.monotonic()
        tmp_removed = self.store.remove_tmp_files()
        self._reach = PathReach()  # the tree stands still until the mount serves it
        try:
            recovered = self._recover_committed_steps()
            self._load_dir(self.root, self._tree, recovered)
        finally:
            self._reach.close()
            del self._reach
        # A step found `writing` may be a save a crash cut short: it does not commit by
        # itself (fs.quiet_commits), only once written again or by `tierfs commit`.
        self._quiet.clear()
        for manifest, resident in recovered.values():
            for entry in manifest.files:
                if entry.name in resident:
                    self.store.count_ref(entry.xxh3)
        garbage = self.store.collect_garbage()
        self.store.scan_usage()
        log.info("loaded RAM store %s: %d committed steps, %d bytes; removed %d temporary "
                 "files and %d unreferenced objects in %.2f s", self.store.root, len(recovered),
                 self.store.used_bytes, tmp_removed, garbage, time.monotonic() - started)

    def _recover_committed_steps(self) -> dict[bytes, tuple[mf.StepManifest, set[str]]]:
        recovered: dict[bytes, tuple[mf.StepManifest, set[str]]] = {}
        in_steps: set[bytes] = set()  # step directories and every directory inside one
        for dirpath, _dirs, files in self._walk(self._tree):
            if os.path.dirname(dirpath) in in_steps:
                in_steps.add(dirpath)
                is_step = False  # a directory inside a step is part of it
            else:
                is_step = (dirpath != self._tree
                           and self.step_number(os.path.basename(dirpath)) is not None)
                if is_step:
                    in_steps.add(dirpath)
            if MANIFEST not in files:
                continue
            if not is_step:
                # Not a step (any more): its files are plain files, its manifest is stale.
                os.unlink(self._reach(os.path.join(dirpath, MANIFEST)))
                continue
            manifest = self._read_manifest(dirpath)
            if manifest is None:
                continue
            held_elsewhere = (
                self._persist_mark(dirpath) == (manifest.version, "persisted")
                or self._read_node_list(dirpath, PEERS_MARK, manifest.version) is not None)
            try:
                resident = self._restore_step(dirpath, manifest, held_elsewhere)
            except OSError as exc:
                log.error("cannot restore step %s v%d (%s); its manifest is set aside",
                          manifest.path, manifest.version, exc)
                self._set_aside(dirpath)
                continue
            if resident is not None:
                recovered[dirpath] = (manifest, resident)
        return recovered

    def _set_aside(self, dir_path: bytes) -> None:
        manifest_path = os.path.join(dir_path, MANIFEST)
        os.rename(self._reach(manifest_path), self._reach(manifest_path + b".damaged"))

    def _read_manifest(self, dir_path: bytes) -> mf.StepManifest | None:
        path = os.path.join(dir_path, MANIFEST)
        try:
            with open(self._reach(path), "rb") as f:
                return mf.decode(f.read())
        except FileNotFoundError:
            return None
        except mf.ManifestError as exc:
            log.error("unreadable manifest %s set aside: %s", os.fsdecode(path), exc)
            os.rename(self._reach(path), self._reach(path + b".damaged"))
            return None

    def _restore_step(self, dir_path: bytes, manifest: mf.StepManifest,
                      persisted: bool) -> set[str] | None:
        """Put the tree of a committed step back as its manifest says; return the names whose
        objects are in RAM, or None if the step is damaged (a file neither here nor persisted).
        """
        resident = set()
        for entry in manifest.files:
            try:
                size = os.lstat(self.store.object_path(entry.xxh3)).st_size
            except FileNotFoundError:
                size = -1
            if size == entry.size:
                resident.add(entry.name)
            elif not persisted:
                log.error("committed step %s v%d is damaged: object of %s is missing or has "
                          "the wrong size; its manifest is set aside", manifest.path,
                          manifest.version, entry.name)
                self._set_aside(dir_path)
                return None
        restored = removed = 0
        wanted = {os.fsencode(name) for name in resident}
        for dirpath, _dirs, files in self._walk(dir_path):
            for name in files:
                full = os.path.join(dirpath, name)
                if (not is_reserved(name) and stat.S_ISREG(os.lstat(self._reach(full)).st_mode)
                        and os.path.relpath(full, dir_path) not in wanted):
                    os.unlink(self._reach(full))  # written after the commit: not in the step
                    removed += 1
        for entry in manifest.files:
            if entry.name not in resident:
                continue
            path = os.path.join(dir_path, os.fsencode(entry.name))
            obj = os.fsencode(self.store.object_path(entry.xxh3))
            try:
                if os.path.samefile(self._reach(path), obj):
                    continue
            except FileNotFoundError:
                pass
            self._clear_way(dir_path, os.fsencode(entry.name))
            tmp = self.store.tmp_path(os.path.dirname(path))
            os.link(obj, self._reach(tmp))
            os.rename(self._reach(tmp), self._reach(path))
            restored += 1
        if restored or removed:
            log.warning("step %s v%d put back as committed: %d files restored, %d uncommitted "
                        "files removed", manifest.path, manifest.version, restored, removed)
        return resident

    def _clear_way(self, dir_path: bytes, relative: bytes) -> None:
        """Make room for a committed file at `relative`: what was put in its place or in the
        place of one of its directories after the commit goes."""
        current = dir_path
        *parents, name = relative.split(b"/")
        for part in parents:
            current = os.path.join(current, part)
            reached = self._reach(current)
            if os.path.lexists(reached) and not os.path.isdir(reached):
                os.unlink(reached)
            os.makedirs(reached, 0o755, exist_ok=True)
        target = self._reach(os.path.join(current, name))
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)

    def _load_dir(self, dir_node: Node, path: bytes,
                  recovered: dict[bytes, tuple[mf.StepManifest, set[str]]],
                  in_step: bool = False) -> None:
        with os.scandir(self._reach(path)) as entries:
            for entry in entries:
                if is_reserved(entry.name):
                    continue
                st = entry.stat(follow_symlinks=False)
                kind = stat.S_IFMT(st.st_mode)
                if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK, stat.S_IFIFO,
                                stat.S_IFSOCK):
                    continue
                node = self._attach(dir_node, entry.name, kind)
                if kind == stat.S_IFDIR:
                    child_path = os.path.join(path, entry.name)
                    number = None if in_step else self.step_number(entry.name)
                    self._load_dir(node, child_path, recovered, in_step or number is not None)
                    if number is not None:
                        manifest, resident = recovered.get(child_path, (None, set()))
                        node.step = StepState(number, manifest)
                        node.step.resident = resident
                        # A DCP step whose .metadata came before its shards (a copy under
                        # way) commits when the last of them is closed, as before the restart.
                        node.step.commit_pending = manifest is None and METADATA in node.children
                        self._apply_persist_mark(node.step, child_path)
                        self._apply_node_marks(node.step, child_path)
                        self._seal_from_manifest(node)

    def _seal_from_manifest(self, step_node: Node) -> None:
        step = step_node.step
        if step.manifest is None:
            return
        for rel, node in self._files_under(step_node):
            entry = step.manifest.entry(rel)
            if entry is not None:
                ino = os.lstat(self.backing(node)).st_ino
                node.seal = Seal(mf.Digest(entry.xxh3, entry.size, entry.chunks), ino)
        self._add_remote_files(step_node, [e for e in step.manifest.files
                                           if e.name not in step.resident])
