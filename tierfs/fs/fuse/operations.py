"""The pyfuse3 Operations of tierfs: thin handlers over the Namespace.

Each handler looks up its arguments, calls one Namespace method and builds the reply. Errors
are translated in one place (`_boundary`): domain refusals become their errno, a full RAM tier
ENOSPC, and anything unexpected is logged with its traceback and answered with EIO, because any
other exception escaping a handler would stop the filesystem.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import pyfuse3
from pyfuse3 import EntryAttributes, FileInfo, FUSEError, StatvfsData

from tierfs.fs.model.nodes import (
    NAME_MAX,
    ROOT_INODE,
    XATTR_NAMESPACE,
    XATTR_RESERVED,
    FsError,
    Handle,
    Node,
    size_in_blocks,
)
from tierfs.fs.store.ram_store import RamFull
from tierfs.fs.tree.kernel_cache import timeout_for

if TYPE_CHECKING:
    from tierfs.fs.fuse.fuse_wire import FallocateIn, SetattrIn
    from tierfs.fs.fuse.passthrough import PassthroughDevice
    from tierfs.fs.namespace import Namespace

log = logging.getLogger(__name__)

XATTR_CONTROL = b"user.tierfs.control"
BLOCK = 4096

T = TypeVar("T")


def _boundary(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(handler)
    async def wrapper(self: Operations, *args: Any) -> T:
        self.ns.foreground.request()  # background work waits while users' requests come
        try:
            return await handler(self, *args)
        except FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes an errno (_errno_of)
            raise FUSEError(_errno_of(self, exc, handler.__name__, args)) from None

    return wrapper


def _answer_now(handler: Callable[..., T]) -> Callable[..., T | int]:
    """`_boundary` for the handlers the relay calls on its own turn of the loop, with no await
    (`fs.fuse.passthrough`): what the handler returns, or the errno its exception answers."""
    @functools.wraps(handler)
    def wrapper(self: Operations, *args: Any) -> T | int:
        self.ns.foreground.request()  # background work waits while users' requests come
        try:
            return handler(self, *args)
        except Exception as exc:  # noqa: BLE001 - every error becomes an errno (_errno_of)
            return _errno_of(self, exc, handler.__name__, args)

    return wrapper


def _errno_of(self: Operations, exc: Exception, handler: str, args: tuple[Any, ...]) -> int:
    """The errno a handler's exception answers the kernel with (see the module docstring)."""
    if isinstance(exc, FsError):
        if exc.errno == errno.ENOSPC:  # a commit the saver's call waited for had no room
            self.ns.events.write_refused()
        return exc.errno
    if isinstance(exc, RamFull):
        self.ns.events.write_refused()
        return errno.ENOSPC
    if isinstance(exc, OSError):
        return exc.errno or errno.EIO
    log.error("internal error in %s%r", handler, args[:2], exc_info=exc)
    return errno.EIO


class Operations(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, namespace: Namespace, control_path: str = "",
                 passthrough: PassthroughDevice | None = None) -> None:
        super().__init__()
        self.ns = namespace
        self.passthrough = passthrough
        if passthrough is not None:
            passthrough.getattr_now = self.getattr_now
            passthrough.lookup_absent = self.lookup_absent
            passthrough.flush_now = self.flush_now
            passthrough.release_now = self.release_now
            passthrough.create_now = self.create_now
            passthrough.setattr_now = self.setattr_now
            passthrough.fallocate_now = self.fallocate_now
        self.control_path = control_path.encode()
        self._dirs: dict[int, tuple[Node, list[tuple[bytes, Node]] | None]] = {}
        self._next_dir_fh = 1

    # -- entries ---------------------------------------------------------------------------

    def _attrs(self, node: Node) -> EntryAttributes:
        attrs = EntryAttributes()
        attrs.st_ino = node.ino
        if node.virtual:
            parent = self.ns.stat(node.parent)
            target = self.ns.readlink(node)
            attrs.st_mode = stat.S_IFLNK | 0o777
            attrs.st_nlink = 1
            attrs.st_uid, attrs.st_gid = parent.st_uid, parent.st_gid
            attrs.st_size = len(target)
            attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = parent.st_mtime_ns
            attrs.entry_timeout = attrs.attr_timeout = timeout_for(node)
            return attrs
        st = self.ns.stat(node)
        attrs.st_mode = st.st_mode
        # Tree files share their inode with committed objects: users see one link. A file or
        # directory whose name is gone (fstat of an open, unlinked file or removed
        # directory) has none.
        if node.parent is None and node.ino != ROOT_INODE:
            attrs.st_nlink = 0
        else:
            attrs.st_nlink = st.st_nlink if node.is_dir else 1
        attrs.st_uid = st.st_uid
        attrs.st_gid = st.st_gid
        attrs.st_size = st.st_size
        attrs.st_blksize = BLOCK
        # A file's size whichever tier holds it (a RAM file's own blocks would say 0 once it
        # left RAM, and less than its size while sparse): `du` answers "how much is there".
        attrs.st_blocks = size_in_blocks(st.st_size) if node.is_file else st.st_blocks
        attrs.st_atime_ns = st.st_atime_ns
        attrs.st_mtime_ns = st.st_mtime_ns
        attrs.st_ctime_ns = st.st_ctime_ns
        # How long the kernel may keep them (fs.tree.kernel_cache: the daemon tells it of the
        # changes it cannot see).
        attrs.entry_timeout = attrs.attr_timeout = timeout_for(node)
        return attrs

    def _entry(self, node: Node) -> EntryAttributes:
        attrs = self._attrs(node)
        self.ns.remember(node)
        return attrs

    @_boundary
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> EntryAttributes:
        parent = self.ns.get(parent_inode)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)  # the kernel leaves this check to us
        if name == b".":
            node = parent
        elif name == b"..":
            node = parent.parent or parent
        else:
            try:
                node = self.ns.child(parent, name)
            except FsError as exc:
                # A step being written here may have been committed by another node a moment
                # ago (a load right after the save's barrier): ask the cluster, then look again.
                if exc.errno != errno.ENOENT or not await self.ns.catch_up(parent, name):
                    raise
                node = self.ns.child(parent, name)
        return self._entry(node)

    @_answer_now
    def lookup_absent(self, parent_inode: int, name: bytes) -> None:
        """`lookup` with no await, for the relay to answer a LOOKUP on its own turn of the loop
        when it fails: the errno, or None when the name is there or the cluster may have to be
        asked first (then `lookup` answers)."""
        parent = self.ns.get(parent_inode)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if name in (b".", b".."):
            return
        try:
            self.ns.child(parent, name)
        except FsError as exc:
            if exc.errno != errno.ENOENT or not self.ns.may_catch_up(parent, name):
                raise

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            self.ns.forget(inode, count)

    @_boundary
    async def getattr(self, inode: int, ctx: Any) -> EntryAttributes:
        return self._attrs(self.ns.get(inode))

    @_answer_now
    def getattr_now(self, inode: int) -> EntryAttributes:
        """`getattr` with no await, for the relay to answer a GETATTR on its own turn of the
        loop: the attributes, or the errno that fails the request."""
        return self._attrs(self.ns.get(inode))

    @_boundary
    async def setattr(self, inode: int, attr: EntryAttributes, fields: Any, fh: int | None,
                      ctx: Any) -> EntryAttributes:
        node = self.ns.get(inode)
        await self.ns.setattr(
            node, self.ns.handle(fh) if fh is not None else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        if fields.update_size and not fields.update_mode:
            self._writer_opened(node, ctx.uid)  # a truncate writes too
        return self._attrs(node)

    @_answer_now
    def setattr_now(self, inode: int, change: SetattrIn) -> EntryAttributes | None:
        """`setattr` of anything but the size with no await, for the relay to answer a
        SETATTR on its own turn of the loop: the attributes, the errno that fails it, or None
        (then `setattr` does it)."""
        node = self.ns.get(inode)
        handle = self.ns.handle(change.fh) if change.fh is not None else None
        if not self.ns.setattr_now(node, handle, mode=change.mode, uid=change.uid,
                                   gid=change.gid, atime_ns=change.atime_ns,
                                   mtime_ns=change.mtime_ns):
            return None
        return self._attrs(node)

    @_boundary
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return self.ns.readlink(self.ns.get(inode), ctx.pid)

    @_boundary
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> EntryAttributes:
        node = self.ns.mkdir(self.ns.get(parent_inode), name, mode & ~ctx.umask, ctx.uid, ctx.gid)
        await self.ns.dir_made(node)
        return self._entry(node)

    @_boundary
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: Any) -> EntryAttributes:
        node = self.ns.mknod(self.ns.get(parent_inode), name, mode & ~ctx.umask, ctx.uid,
                             ctx.gid)
        return self._entry(node)

    @_boundary
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.ns.rmdir(self.ns.get(parent_inode), name)

    @_boundary
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.ns.unlink(self.ns.get(parent_inode), name)

    @_boundary
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: Any) -> EntryAttributes:
        node = self.ns.symlink(self.ns.get(parent_inode), name, target, ctx.uid, ctx.gid)
        return self._entry(node)

    @_boundary
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        old_parent = self.ns.get(parent_inode_old)
        new_parent = self.ns.get(parent_inode_new)
        self.ns.check_special_destination(self.ns.child(old_parent, name_old), new_parent)
        await self.ns.rename(old_parent, name_old, new_parent, name_new, flags)

    @_boundary
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: Any) -> EntryAttributes:
        raise FsError(errno.EPERM)  # hard links would defeat per-step copy on write

    # -- files -----------------------------------------------------------------------------

    @_boundary
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[FileInfo, EntryAttributes]:
        node, handle = self._create(parent_inode, name, mode & ~ctx.umask, flags, ctx.uid,
                                    ctx.gid, ctx.pid)
        return await self._file_info(handle), self._entry(node)

    @_answer_now
    def create_now(self, parent_inode: int, name: bytes, mode: int, flags: int, umask: int,
                   uid: int, gid: int, pid: int) -> tuple[int, EntryAttributes] | None:
        """`create` with no await, for the relay to answer a CREATE on its own turn of the
        loop: the new file's handle and entry, the errno that fails it, or None, having made
        nothing, when its open may wait for room in the RAM tier (`Namespace.creates_now`;
        then `create` answers)."""
        if not self.ns.creates_now():
            return None
        node, handle = self._create(parent_inode, name, mode & ~umask, flags, uid, gid, pid)
        try:
            if self.passthrough is not None and self.passthrough.choose(handle):
                self.ns.expect_direct_writes_now(handle)
        except BaseException:
            # Not for a new inode (`choose` refuses only an open of another backing file of
            # an inode open already), but the kernel would not release a failed open.
            if self.passthrough is not None:
                self.passthrough.withdraw(handle)
            self.ns.background.spawn(self.ns.release, handle)
            raise
        return handle.fh, self._entry(node)

    def _create(self, parent_inode: int, name: bytes, mode: int, flags: int, uid: int,
                gid: int, pid: int) -> tuple[Node, Handle]:
        """What `create` and `create_now` do before the open's reply (`mode` after the
        umask)."""
        node, handle = self.ns.create(self.ns.get(parent_inode), name, mode, flags, uid, gid,
                                      pid)
        self._writer_opened(node, uid)
        return node, handle

    @_boundary
    async def open(self, inode: int, flags: int, ctx: Any) -> FileInfo:
        node = self.ns.get(inode)
        self.ns.check_open(node, ctx.pid)
        # Asked now, right after its path walk through any `latest`: the process's pin holds
        # while the open waits (for the file from a peer or the store).
        pin = self.ns.opening(node, ctx.pid)
        try:
            if ((flags & os.O_ACCMODE) == os.O_RDONLY
                    and self.passthrough is not None and self.passthrough.enabled):
                # Reads of a file in another tier would each cross the daemon (the relay, a
                # FUSE request per 128 KiB, a copy): a small one, or one of a step being loaded
                # (its .metadata opened), comes whole now, answered with passthrough; another
                # large one is read range by range (FetchBack.fetch_whole).
                await self.ns.fetch_whole(node)
            handle = await self.ns.open(node, flags)
        except (FsError, OSError):
            self.ns.open_failed(pin)
            raise
        self.ns.note_opened(handle, ctx.pid, pin)
        if handle.writable:
            self._writer_opened(node, ctx.uid)
        return await self._file_info(handle)

    def _writer_opened(self, node: Node, uid: int) -> None:
        """Under the relay the daemon clears set-id bits itself (FUSE_HANDLE_KILLPRIV_V2), and
        with passthrough it sees no write: a writer that may not keep them (a user but root,
        who has CAP_FSETID) makes them go at its open (`Attributes.drop_setid`)."""
        if self.passthrough is not None and uid != 0:
            self.ns.drop_setid(node)

    async def _file_info(self, handle: Handle) -> FileInfo:
        """The reply to an open: passthrough to the backing file where the kernel allows it."""
        if self.passthrough is not None:
            try:
                if self.passthrough.choose(handle):
                    await self.ns.expect_direct_writes(handle)
            except BaseException:
                self.passthrough.withdraw(handle)
                await self.ns.release(handle)  # the kernel will not release a failed open
                raise
        return FileInfo(fh=handle.fh)

    @_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self.ns.read(self.ns.handle(fh), off, size)

    @_boundary
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.ns.write(self.ns.handle(fh), off, buf)

    @_boundary
    async def flush(self, fh: int) -> None:
        await self.ns.flush(self.ns.handle(fh))

    @_answer_now
    def flush_now(self, fh: int) -> int | None:
        """`flush` with no await, for the relay to answer a FLUSH on its own turn of the loop:
        0, the errno that fails it, or None when the close may commit a step (then `flush`
        does it)."""
        return 0 if self.ns.flush_now(self.ns.handle(fh)) else None

    @_answer_now
    def release_now(self, fh: int) -> int | None:
        """`release` with no await, as `flush_now`."""
        handle = self.ns.handle(fh)
        if not self.ns.releases_now(handle):
            return None
        if self.passthrough is not None:
            self.passthrough.withdraw(handle)
        self.ns.release_now(handle)
        return 0

    @_boundary
    async def release(self, fh: int) -> None:
        handle = self.ns.handle(fh)
        if self.passthrough is not None:
            self.passthrough.withdraw(handle)
        await self.ns.release(handle)

    @_answer_now
    def fallocate_now(self, request: FallocateIn) -> int:
        """fallocate(2) of an open file, for the relay (pyfuse3 has no handler for it)."""
        self.ns.fallocate(self.ns.handle(request.fh), request.mode, request.offset,
                          request.length)
        return 0

    @_boundary
    async def fsync(self, fh: int, datasync: bool) -> None:
        self.ns.fsync(self.ns.handle(fh))

    # -- directories -----------------------------------------------------------------------

    @_boundary
    async def opendir(self, inode: int, ctx: Any) -> int:
        node = self.ns.get(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        fh = self._next_dir_fh
        self._next_dir_fh += 1
        self._dirs[fh] = (node, None)
        return fh

    @_boundary
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        node, snapshot = self._dirs[fh]
        if snapshot is None or start_id == 0:
            # One snapshot per pass keeps offsets stable while the directory changes.
            snapshot = [(b".", node), (b"..", node.parent or node), *self.ns.list_dir(node)]
            self._dirs[fh] = (node, snapshot)
        for index in range(start_id, len(snapshot)):
            name, child = snapshot[index]
            try:
                attrs = self._attrs(child)
            except (FsError, OSError):
                continue  # removed since the snapshot
            if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                break
            if index >= 2:  # the kernel takes no reference for "." and ".."
                self.ns.remember(child)

    @_boundary
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_boundary
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # metadata changes are in the RAM store as soon as they are made

    @_boundary
    async def statfs(self, ctx: Any) -> StatvfsData:
        used, limit = self.ns.ram_bytes()
        stats = StatvfsData()
        stats.f_bsize = stats.f_frsize = BLOCK
        stats.f_blocks = limit // BLOCK
        stats.f_bfree = stats.f_bavail = max(0, limit - used) // BLOCK
        stats.f_files = 1 << 32
        stats.f_ffree = stats.f_favail = (1 << 32) - self.ns.inode_count
        stats.f_namemax = 255
        return stats

    # -- extended attributes ---------------------------------------------------------------

    @_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if name == XATTR_CONTROL and self.control_path:
            return self.control_path
        node = self.ns.get(inode)
        if _is_user_xattr(name):
            return self.ns.user_xattr(node, name)
        if not name.startswith(XATTR_NAMESPACE):
            raise FsError(errno.EOPNOTSUPP)  # as the relay answers (fs.fuse.fuse_wire.answer_here)
        return await self.ns.xattr(node, name)

    @_boundary
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        node = self.ns.get(inode)
        return self.ns.xattr_names(node) + self.ns.user_xattr_names(node)

    @_boundary
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        _check_user_xattr(name)
        await self.ns.set_user_xattr(self.ns.get(inode), name, value)

    @_boundary
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        node = self.ns.get(inode)
        if name.startswith(XATTR_RESERVED) and name in self.ns.xattr_names(node):
            # Derived, not stored (like `latest`): removing one succeeds and changes nothing,
            # so that `rsync -X` into the mount, which drops what its source lacks, works.
            return
        _check_user_xattr(name)
        self.ns.remove_user_xattr(node, name)


def _is_user_xattr(name: bytes) -> bool:
    """A user's own attribute (`user.*`), kept on the RAM tier's file; `user.tierfs.*` is ours."""
    return name.startswith(XATTR_NAMESPACE) and not name.startswith(XATTR_RESERVED)


def _check_user_xattr(name: bytes) -> None:
    """Only a user's own attributes change: tierfs's are read-only, other namespaces
    (trusted, security, system) are not supported."""
    if name.startswith(XATTR_RESERVED):
        raise FsError(errno.EROFS)
    if not _is_user_xattr(name):
        raise FsError(errno.ENOTSUP)
