"""The RAM tier's on-disk layout, its ownership lock, capacity accounting and committed objects.

Everything the namespace needs survives a crash of the daemon because it lives in files under
`--ram-dir` (a tmpfs), laid out as:

    lock                    flock held by the owning daemon; holds its pid
    tree/<path>             the user's namespace as real directories and files (working copies)
    tree/<step>/.tierfs-manifest   a step's committed manifest, hidden from the mount
    objects/<xxh3-128>      committed file content, hard links shared with tree files

A committed object is immutable: a tree file whose inode has more than one link is shared with
`objects/` and is copied before anyone may write it (copy on write). So re-saving a step never
touches the bytes of the committed version, and a restart can put every committed step back
exactly as its manifest says.

Capacity is accounted per backing inode in allocated bytes (`st_blocks * 512`, hard links
counted once), so that a sparse file costs only what tmpfs stores, and `--ram-limit` can refuse a
write with ENOSPC before tmpfs itself runs out.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import itertools
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import trio

from tierfs import reserved

log = logging.getLogger(__name__)

TMP_PREFIX = reserved.TMP
# In objects/: removed by collect_garbage if left by a crash.
TRASH_PREFIX = reserved.TRASH
# Unlinking a tmpfs file frees its pages there and then: about 0.2 s per GiB. Files bigger than
# this are renamed away at once and unlinked in a worker thread, so that no handler waits.
BIG_UNLINK = 16 << 20
_unique = itertools.count()
# Seconds between two looks for objects linked early whose tree file went (`room_for`).
EARLY_SWEEP_EVERY = 1.0
RESERVED_PREFIX = reserved.PREFIX.encode()


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of `data` into a RAM store file at `offset`: a short write (the file system
    holding the RAM dir, a /dev/shm other processes use too, is nearly full) is continued, and
    one that writes nothing is ENOSPC; bytes fetched or received are never kept in part."""
    data = memoryview(data)
    while data:
        written = os.pwrite(fd, data, offset)
        if not written:
            raise OSError(errno.ENOSPC, "no room in the RAM dir's file system")
        data, offset = data[written:], offset + written


class RamDirBusy(Exception):
    """Another live daemon owns this RAM dir."""


class RamFull(Exception):
    """A write would take the RAM tier past --ram-limit."""


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with its mode (Python's `os` has only posix_fallocate, mode 0)."""
    if _fallocate()(fd, mode, offset, length) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int]:
    call = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).fallocate
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    return call  # type: ignore[no-any-return]


def allocated(st: os.stat_result) -> int:
    """The bytes a file really takes (tmpfs stores no holes): what the RAM tier accounts."""
    return st.st_blocks * 512


def is_reserved(name: bytes) -> bool:
    """Names tierfs keeps for itself inside the tree; never visible or creatable by users."""
    return name.startswith(RESERVED_PREFIX)


class RamStore:
    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root = root
        self.tree = root / "tree"
        self.objects = root / "objects"
        self._objects_path = os.fsencode(self.objects)
        self.limit_bytes = limit_bytes
        self._sizes: dict[int, int] = {}
        self.used_bytes = 0
        self._refs: Counter[str] = Counter()
        # Objects linked before any commit counted them (`link_early`): digest -> inode, and
        # back.
        self._early: dict[str, int] = {}
        self._early_inodes: dict[int, str] = {}
        self._early_swept_at = -EARLY_SWEEP_EVERY
        self._lock_fd: int | None = None
        self._last_full_log = 0.0

    # -- ownership -------------------------------------------------------------------------

    def acquire(self) -> None:
        """Create the layout (private to its owner) and take the lock, or raise RamDirBusy."""
        # Explicit modes: the daemon's umask is 0. tree/ is the mount's root (0755 by default,
        # a later chmod of the root stays); objects/ is tierfs's own.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.tree.mkdir(mode=0o755, exist_ok=True)
        self.objects.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.objects, 0o700)
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RamDirBusy(f"RAM dir {self.root} is in use by tierfs pid {holder}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # no room for the pid (the RAM dir's file system full): not ours
            os.close(fd)
            raise
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- capacity --------------------------------------------------------------------------

    def scan_usage(self) -> None:
        """Recount usage from the files on disk (at start, after recovery)."""
        self._sizes.clear()
        for top in (self.tree, self.objects):
            # fwalk: by directory descriptors, for trees deeper than PATH_MAX.
            for _dirpath, _dirs, files, dir_fd in os.fwalk(top):
                for name in files:
                    if name.startswith(RESERVED_PREFIX.decode()):
                        continue  # tierfs's own small files are not the user's data
                    st = os.lstat(name, dir_fd=dir_fd)
                    self._sizes[st.st_ino] = allocated(st)
        self.used_bytes = sum(self._sizes.values())

    def room_for(self, extra_bytes: int) -> bool:
        if (self.used_bytes + extra_bytes > self.limit_bytes and self._early_inodes
                and time.monotonic() - self._early_swept_at >= EARLY_SWEEP_EVERY):
            self._drop_lone_early()  # RAM that nothing uses, before anything is refused
        return self.used_bytes + extra_bytes <= self.limit_bytes

    def grow(self, backing_ino: int, new_end: int) -> None:
        """Account a sequential writer that now ends at `new_end` (it stores everything up to
        there); raise RamFull if that would pass the limit."""
        self.grow_by(backing_ino, new_end - self._sizes.get(backing_ino, 0))

    def grow_by(self, backing_ino: int, delta: int) -> None:
        """Account `delta` more bytes stored in a file; raise RamFull if they do not fit."""
        if delta <= 0:
            return
        self.check_room(delta)
        self._sizes[backing_ino] = self._sizes.get(backing_ino, 0) + delta
        self.used_bytes += delta

    def give_back(self, backing_ino: int, delta: int) -> None:
        """Un-account `delta` bytes charged by `grow_by` that were not kept after all (a
        fetched range that failed its check). Nothing once the inode is forgotten: its
        charges went with it."""
        if delta > 0 and backing_ino in self._sizes:
            delta = min(delta, self._sizes[backing_ino])
            self._sizes[backing_ino] -= delta
            self.used_bytes -= delta

    def account_fd(self, fd: int) -> int:
        """Account what the open file `fd` stores now (after a write or a truncate, or a copy
        whose room was checked before it was made); returns its inode."""
        st = os.fstat(fd)
        self.account(st.st_ino, allocated(st))
        return st.st_ino

    def account_path(self, path: bytes | str) -> int:
        """`account_fd` for a file named by its path in the RAM store."""
        st = os.lstat(path)
        self.account(st.st_ino, allocated(st))
        return st.st_ino

    def forget_inode(self, backing_ino: int) -> None:
        """The last link of a backing inode is gone."""
        self.used_bytes -= self._sizes.pop(backing_ino, 0)

    def _log_full(self, delta: int, holders: str) -> None:
        now = time.monotonic()
        if now - self._last_full_log > 5:
            self._last_full_log = now
            log.warning(
                "RAM tier full: %d of %d bytes used (%.1f%%), refused a write of %d bytes%s",
                self.used_bytes, self.limit_bytes,
                100 * self.used_bytes / max(self.limit_bytes, 1), delta,
                f"; {holders}" if holders else "",
            )

    # -- committed objects -----------------------------------------------------------------

    def object_path(self, digest: str) -> Path:
        return self.objects / digest

    def add_ref(self, digest: str, tree_file: bytes | Callable[[], bytes],
                copy: bytes | None = None) -> None:
        """Make `tree_file` (sealed with `digest`; or a function giving its path, called only
        if the path is needed) a committed object, or count another use.

        The object is the tree file's own inode (a hard link), or `copy` when given: a private
        copy is used when the tree file is open for writing, so that no open handle can ever
        write into a committed object."""
        refs = self._refs.get(digest, 0)  # (not Counter's __missing__: 10,000 per commit)
        if refs == 0 and not self._take_early(digest):
            # The object may exist all the same (found at start). A bytes path and no stat
            # first: a commit of a step of 10,000 files makes 10,000 of these, with no await,
            # while every FUSE request waits (issue 25).
            target = os.path.join(self._objects_path, digest.encode())
            if copy is not None:
                if not os.path.lexists(target):
                    os.rename(copy, target)
                    copy = None
            else:
                with contextlib.suppress(FileExistsError):
                    os.link(tree_file if isinstance(tree_file, bytes) else tree_file(), target)
        if copy is not None:
            self.discard(copy)
        self._refs[digest] = refs + 1

    def link_early(self, digest: str, tree_file: bytes, ino: int) -> None:
        """Make a tree file (inode `ino`, sealed with `digest`, no writer left) its committed
        object now, before a commit counts it: the commit of a step of 10,000 small files then
        links none of them, with no await while every FUSE request waits (issue 25). Copy on
        write protects it as any object. Until a commit counts it (`add_ref`), it goes when
        the tree file stops sharing its inode (`drop_early`) or when room is wanted
        (`room_for`); start-up keeps those a tree file still shares (`collect_garbage`)."""
        if self._refs[digest] or digest in self._early:
            return
        try:
            os.link(tree_file, os.path.join(self._objects_path, digest.encode()))
        except FileExistsError:
            return
        self._note_early(digest, ino)

    def _note_early(self, digest: str, ino: int) -> None:
        self._early[digest] = ino
        self._early_inodes[ino] = digest

    def drop_early(self, ino: int) -> bool:
        """The tree file linked early as inode `ino` no longer shares it (removed, replaced by
        a copy on write): its object goes too. Whether there was one."""
        digest = self._early_inodes.pop(ino, None)
        if digest is None:
            return False
        del self._early[digest]
        self._unlink_object(digest)
        return True

    def _take_early(self, digest: str) -> bool:
        """A commit counts the object linked early for `digest`, if any: it stays."""
        ino = self._early.pop(digest, None)
        if ino is None:
            return False
        del self._early_inodes[ino]
        return True

    def _drop_lone_early(self) -> None:
        """Remove the objects linked early whose tree file went without `drop_early` (a step
        directory removed whole): they hold RAM that nothing uses. A stat per object linked
        early: at most every EARLY_SWEEP_EVERY seconds, however often room is wanted."""
        self._early_swept_at = time.monotonic()
        for ino, digest in list(self._early_inodes.items()):
            try:
                alone = os.lstat(self.object_path(digest)).st_nlink == 1
            except FileNotFoundError:
                alone = True
            if alone:
                self.drop_early(ino)

    def snapshot_path(self, key: str) -> bytes:
        """Where a pending commit keeps a file until its hash names it
        (fs.model.pending_commits)."""
        return os.path.join(self._objects_path, (reserved.SNAPSHOT + key).encode())

    def adopt_snapshot(self, digest: str, snapshot: bytes) -> None:
        """A pending commit's snapshot, now hashed, is linked as the committed object `digest`
        (unless that object is here already), counted as one more use. The snapshot stays
        until the manifest naming the object is in place (the caller drops it then): a crash
        in between finds the pending commit whole."""
        if not (self._take_early(digest)
                or os.path.lexists(os.path.join(self._objects_path, digest.encode()))):
            os.link(snapshot, os.path.join(self._objects_path, digest.encode()))
        self._refs[digest] += 1

    def drop_snapshot(self, snapshot: bytes) -> None:
        """Remove a snapshot no commit takes; a private copy's bytes leave the accounting
        (a hard link's stay: they are the tree file's)."""
        try:
            st = os.lstat(snapshot)
        except FileNotFoundError:
            return
        self.remove(snapshot, st)
        if st.st_nlink == 1:
            self.forget_inode(st.st_ino)

    def count_ref(self, digest: str) -> None:
        """Count a use found while loading manifests at start."""
        self._refs[digest] += 1

    def drop_ref(self, digest: str) -> None:
        self._refs[digest] -= 1
        if self._refs[digest] <= 0:
            del self._refs[digest]
            self._unlink_object(digest)

    def _unlink_object(self, digest: str) -> None:
        """Remove an object no one counts; its bytes leave the accounting with its last link."""
        path = self.object_path(digest)
        try:
            st = os.lstat(path)
            self.remove(path, st)
        except FileNotFoundError:
            return
        if st.st_nlink == 1:
            self.forget_inode(st.st_ino)

    def remove(self, path: bytes | str | Path, st: os.stat_result | None = None, *,
               in_background: bool = True) -> None:
        """Unlink `path` (no accounting); a big file's last link is renamed into the trash at
        once and its pages freed in a worker thread, off the trio loop. Not `in_background`
        for a file still open: its pages go at its last close, and that close must see that
        it was unlinked."""
        st = st or os.lstat(path)
        if st.st_nlink > 1 or allocated(st) < BIG_UNLINK or not in_background:
            os.unlink(path)
            return
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # not in the daemon's loop (start-up, tools): just unlink
            os.unlink(path)
            return
        trash = self.objects / f"{TRASH_PREFIX}{os.getpid()}-{next(_unique)}"
        os.rename(path, trash)
        trio.lowlevel.spawn_system_task(_unlink_in_thread, trash)

    def collect_garbage(self) -> int:
        """At start, once every manifest is counted: remove tierfs's own leftovers in objects/
        (snapshots, incoming copies, trash) and the objects no manifest names; the count
        removed. An object a tree file still shares stays, as one linked early
        (`link_early`, or by a commit a crash cut short): it holds no RAM of its own and is the
        object that file's commit makes, and it is no lost copy (a node that counted it as
        one dropped itself from the holders of its own unsaved shards: their step, committed
        elsewhere, could then never be whole)."""
        with os.scandir(self.objects) as entries:
            unnamed = sorted((entry.name for entry in entries if entry.name not in self._refs),
                             key=lambda name: not name.startswith(reserved.PREFIX))
        removed = 0
        for name in unnamed:  # the leftovers first: a snapshot may share an object's inode
            path = os.path.join(self._objects_path, name.encode())
            st = os.lstat(path)
            if st.st_nlink > 1 and not name.startswith(reserved.PREFIX):
                self._note_early(name, st.st_ino)
                continue
            os.unlink(path)
            removed += 1
        return removed

    # -- copy on write ---------------------------------------------------------------------

    def tmp_path(self, directory: bytes | Path) -> bytes:
        name = f"{TMP_PREFIX}{os.getpid()}-{time.monotonic_ns()}-{next(_unique)}"
        directory = os.fsencode(directory)
        return os.path.join(directory, name.encode())

    def check_room(self, extra_bytes: int, holders: str = "") -> None:
        """Raise RamFull (and log why, naming `holders` if given) unless `extra_bytes` fit."""
        if not self.room_for(extra_bytes):
            self._log_full(extra_bytes, holders)
            raise RamFull

    def account(self, backing_ino: int, stored: int) -> None:
        """Record the bytes an inode stores now (see `allocated`)."""
        self.used_bytes += stored - self._sizes.get(backing_ino, 0)
        self._sizes[backing_ino] = stored

    def discard(self, path: bytes) -> None:
        """Remove a file made by `copy` and accounted, that is no longer wanted."""
        st = os.lstat(path)
        self.forget_inode(st.st_ino)
        self.remove(path, st)

    def copy(self, path: bytes, directory: bytes, keep_bytes: int) -> bytes:
        """A temporary copy of `path`'s first `keep_bytes` bytes, mode, owner, times and user
        xattrs, in `directory` (blocking and free of accounting: it runs in a worker thread)."""
        st = os.lstat(path)
        tmp = self.tmp_path(directory)
        try:
            with open(tmp, "xb") as dst:
                if keep_bytes:
                    with open(path, "rb") as src:
                        shutil.copyfileobj(src, dst, 4 << 20)
                    dst.truncate(keep_bytes)
            os.chmod(tmp, st.st_mode & 0o7777)
            os.chown(tmp, st.st_uid, st.st_gid)
            os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
            for name in os.listxattr(path):  # the user's own xattrs go with the copy
                if name.startswith("user."):
                    os.setxattr(tmp, name, os.getxattr(path, name))
        except BaseException:  # `path` went away meanwhile, or no room: no half copy stays
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return tmp

    def remove_tmp_files(self) -> int:
        removed = 0
        for dirpath, dirs, files, dir_fd in os.fwalk(self.tree):
            for name in [d for d in dirs if d.startswith(TMP_PREFIX)]:
                # A step directory set aside to be removed (Tree.forget_step) when a crash
                # cut its removal short.
                dirs.remove(name)
                shutil.rmtree(os.path.join(dirpath, name))
                removed += 1
            for name in files:
                if name.startswith(TMP_PREFIX) or (name.startswith(reserved.PREFIX)
                                                   and name.endswith(reserved.TEMP_SUFFIX)):
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
        return removed


async def _unlink_in_thread(path: Path) -> None:
    try:
        await trio.to_thread.run_sync(os.unlink, path)
    except OSError as exc:  # left for collect_garbage at the next start
        log.warning("could not remove %s: %s", path, exc)
