"""FUSE passthrough: the kernel reads and writes an open file's backing file in the RAM store
directly, so file data never crosses the daemon.

Without it, every 1 MiB of a checkpoint is a FUSE request that Python receives, copies and
writes again; the daemon's one busy core caps a save at a fraction of tmpfs speed (see the
README's Performance section for the profile). Linux 6.9+ can instead serve an open file from a
backing file the daemon names. That takes three things from the daemon: the FUSE_PASSTHROUGH
flag in the INIT reply, a backing id registered with an ioctl on /dev/fuse, and that id with
FOPEN_PASSTHROUGH in the reply to OPEN or CREATE.

pyfuse3 sits on libfuse 3.14, which predates passthrough (3.16). So tierfs mounts /dev/fuse
itself and gives libfuse one end of a SOCK_SEQPACKET socket pair as "/dev/fd/N" (libfuse's way
of accepting a device that its caller mounted). Two relay threads move whole messages between
the device and libfuse, editing on the way the INIT request (no splice: a socket is not the
device), the INIT reply and the OPEN/CREATE replies of files offered for passthrough. Every
other message passes unchanged, so the handlers stay ordinary pyfuse3 code.

The kernel requires all concurrent opens of an inode to agree: once one is a passthrough open,
every other must pass through to the same backing file; once one is an ordinary (page-cached)
open, none may pass through. `PassthroughDevice.choose` keeps to that, from the handles the
daemon holds (which can only outlive the kernel's, the safe direction).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tierfs.fs.nodes import FsError, Handle

log = logging.getLogger(__name__)

# From <linux/fuse.h> (protocol 7.40+) and <linux/mount.h>.
FUSE_INIT, FUSE_OPEN, FUSE_CREATE = 26, 14, 35
FUSE_SPLICE_FLAGS = (1 << 7) | (1 << 8) | (1 << 9)  # SPLICE_WRITE, SPLICE_MOVE, SPLICE_READ
FUSE_WRITEBACK_CACHE = 1 << 16
FUSE_INIT_EXT = 1 << 30
FUSE_PASSTHROUGH_FLAGS2 = 1 << (37 - 32)
FOPEN_PASSTHROUGH = 1 << 7
# The only open flags the kernel accepts beside FOPEN_PASSTHROUGH (not KEEP_CACHE: no cache).
FOPEN_PASSTHROUGH_MASK = (1 << 0) | (1 << 5) | (1 << 6) | FOPEN_PASSTHROUGH
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
SO_SNDBUFFORCE = 32

IN_HEADER = struct.Struct("<IIQ")  # len, opcode, unique (then nodeid, uid, gid, pid, ...)
IN_HEADER_SIZE = 40
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
OUT_HEADER_SIZE = 16
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
ENTRY_OUT_SIZE = 128  # fuse_entry_out, before the fuse_open_out of a CREATE reply
# The largest request: a 1 MiB write (libfuse's max_write) with its headers.
MESSAGE_MAX = (1 << 20) + (8 << 10)
SOCKET_BUFFER = 4 << 20


@dataclass
class Backing:
    """A backing file registered with the kernel, shared by the passthrough opens of an inode."""

    backing_id: int
    backing_ino: int  # the RAM-store inode it was registered with
    users: int = 1


class PassthroughUnavailable(Exception):
    """This process cannot mount for passthrough; the ordinary pyfuse3 mount is used instead."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class PassthroughDevice:
    """The daemon's /dev/fuse, mounted at `mountpoint`, relayed to libfuse with passthrough."""

    def __init__(self, mountpoint: str, mount_options: list[str],
                 source: str = "tierfs") -> None:
        if os.geteuid() != 0:
            raise PassthroughUnavailable("registering backing files needs root")
        self.mountpoint = mountpoint
        self.source = source  # what /proc/self/mountinfo and df show as the mount's source
        self.enabled = False  # the kernel accepted passthrough in INIT
        self._offers: dict[int, int] = {}  # fh -> backing id, until the file is released
        self._backing: dict[int, Backing] = {}  # FUSE inode -> its registered backing file
        self._awaiting: dict[int, int] = {}  # unique -> opcode of requests whose reply we edit
        self._kernel_offers = False  # FUSE_PASSTHROUGH was in the kernel's INIT request
        self._threads: list[threading.Thread] = []
        self._on_unmount: Callable[[], None] = lambda: None
        try:
            self.dev_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise PassthroughUnavailable(f"/dev/fuse: {exc.strerror}") from None
        try:
            self._mount(mount_options)
        except BaseException:
            os.close(self.dev_fd)
            raise
        self._kernel_side, library_side = socket.socketpair(socket.AF_UNIX,
                                                            socket.SOCK_SEQPACKET)
        for sock in (self._kernel_side, library_side):
            try:  # room for a whole 1 MiB message (root may exceed the sysctl maximum)
                sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SOCKET_BUFFER)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        # libfuse owns this end from pyfuse3.init on and closes it in pyfuse3.close.
        self._library_fd = library_side.detach()

    @property
    def library_mountpoint(self) -> str:
        """What to give pyfuse3.init instead of the mount point."""
        return f"/dev/fd/{self._library_fd}"

    def _mount(self, options: list[str]) -> None:
        st = os.stat(self.mountpoint)
        data = ",".join([f"fd={self.dev_fd}", f"rootmode={st.st_mode & 0o170000:o}",
                         f"user_id={os.getuid()}", f"group_id={os.getgid()}", *options])
        libc = _libc()
        if libc.mount(os.fsencode(self.source), os.fsencode(self.mountpoint), b"fuse.tierfs",
                      MS_NOSUID | MS_NODEV, data.encode()) != 0:
            err = ctypes.get_errno()
            raise PassthroughUnavailable(f"mount(2) failed: {os.strerror(err)}")

    def start(self, on_unmount: Callable[[], None]) -> None:
        """Start relaying; `on_unmount` is called (from a thread) once the kernel unmounts."""
        self._on_unmount = on_unmount
        for target in (self._relay_requests, self._relay_replies):
            thread = threading.Thread(target=target, name=f"fuse-{target.__name__}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def unmount(self) -> None:
        """Lazy unmount; the relay threads end when the kernel drops the connection."""
        if _libc().umount2(os.fsencode(self.mountpoint), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOENT):  # already unmounted
                log.warning("unmounting %s: %s", self.mountpoint, os.strerror(err))

    def close(self) -> None:
        """After pyfuse3.close (which closed libfuse's end): stop the relays, free the fds."""
        self.unmount()
        with contextlib.suppress(OSError):
            self._kernel_side.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)
        self._kernel_side.close()
        os.close(self.dev_fd)

    # -- choosing and registering ---------------------------------------------------------

    def choose(self, handle: Handle) -> bool:
        """Offer `handle` for passthrough if the kernel's io-mode rules allow it.

        Concurrent passthrough opens of an inode must share one backing id, so ids are kept
        per inode and counted. Raises ETXTBSY for the one case with no good answer: the inode
        is open for passthrough to one backing file and this open needs another (a write into
        a committed file that another process is reading)."""
        if not self.enabled or handle.fd < 0:
            return False
        node = handle.node
        if any(not h.passthrough for h in node.handles if h is not handle):
            return False  # the inode is in page-cache mode until those close
        shared = self._backing.get(node.ino)
        if shared is not None:
            if shared.backing_ino != handle.backing_ino:
                raise FsError(errno.ETXTBSY, "file is open on an older version")
            shared.users += 1
        else:
            try:
                backing_id = fcntl.ioctl(self.dev_fd, FUSE_DEV_IOC_BACKING_OPEN,
                                         bytearray(struct.pack("<iIQ", handle.fd, 0, 0)))
            except OSError as exc:
                log.warning("passthrough refused for %r: %s", node.name, exc.strerror)
                if exc.errno in (errno.EOPNOTSUPP, errno.EPERM):
                    self.enabled = False  # not this file's fault: stop asking
                return False
            shared = self._backing[node.ino] = Backing(backing_id, handle.backing_ino)
        handle.passthrough = True
        self._offers[handle.fh] = shared.backing_id
        return True

    def withdraw(self, handle: Handle) -> None:
        """The kernel released the file: drop its backing id when the inode's last user goes."""
        if self._offers.pop(handle.fh, None) is None:
            return
        shared = self._backing[handle.node.ino]
        shared.users -= 1
        if shared.users == 0:
            del self._backing[handle.node.ino]
            with contextlib.suppress(OSError):
                fcntl.ioctl(self.dev_fd, FUSE_DEV_IOC_BACKING_CLOSE,
                            bytearray(struct.pack("<I", shared.backing_id)))

    # -- the relays -----------------------------------------------------------------------

    def _relay_requests(self) -> None:
        while True:
            try:
                message = os.read(self.dev_fd, MESSAGE_MAX)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ENOENT):
                    continue  # ENOENT: the request was interrupted before we read it
                if exc.errno != errno.ENODEV:
                    log.error("reading /dev/fuse: %s", exc.strerror)
                break  # ENODEV: unmounted
            _length, opcode, unique = IN_HEADER.unpack_from(message)
            if opcode == FUSE_INIT:
                message = self._edit_init_request(message)
            if opcode in (FUSE_INIT, FUSE_OPEN, FUSE_CREATE):
                self._awaiting[unique] = opcode
            try:
                self._kernel_side.sendall(message)
            except OSError:
                break  # libfuse is gone
        self._on_unmount()

    def _relay_replies(self) -> None:
        while True:
            try:
                message = self._kernel_side.recv(MESSAGE_MAX)
            except OSError:
                break
            if not message:
                break  # libfuse closed its end
            _length, error, unique = OUT_HEADER.unpack_from(message)
            opcode = self._awaiting.pop(unique, None) if unique else None
            if opcode is not None and error == 0:
                try:
                    message = self._edit_reply(opcode, message)
                except Exception:  # a relay that stops would hang every process on the mount
                    log.exception("cannot edit a reply to opcode %d; sent unchanged", opcode)
            try:
                os.write(self.dev_fd, message)
            except OSError as exc:
                if exc.errno == errno.ENODEV:
                    break
                if exc.errno != errno.ENOENT:  # ENOENT: the request was interrupted
                    log.error("writing /dev/fuse: %s", exc.strerror)

    def _edit_init_request(self, message: bytes) -> bytes:
        """libfuse reads from a socket, not the device: it must not splice."""
        edited = bytearray(message)
        flags_at = IN_HEADER_SIZE + 12
        (flags,) = struct.unpack_from("<I", edited, flags_at)
        struct.pack_into("<I", edited, flags_at, flags & ~FUSE_SPLICE_FLAGS)
        flags2 = 0
        if flags & FUSE_INIT_EXT:
            (flags2,) = struct.unpack_from("<I", edited, flags_at + 4)
        self._kernel_offers = bool(flags2 & FUSE_PASSTHROUGH_FLAGS2)
        return bytes(edited)

    def _edit_reply(self, opcode: int, message: bytes) -> bytes:
        if opcode == FUSE_INIT:
            return self._edit_init_reply(message)
        at = OUT_HEADER_SIZE + (ENTRY_OUT_SIZE if opcode == FUSE_CREATE else 0)
        if len(message) < at + OPEN_OUT.size:
            return message
        fh, open_flags, _ = OPEN_OUT.unpack_from(message, at)
        backing_id = self._offers.get(fh)
        if backing_id is None:
            return message
        edited = bytearray(message)
        open_flags = (open_flags | FOPEN_PASSTHROUGH) & FOPEN_PASSTHROUGH_MASK
        OPEN_OUT.pack_into(edited, at, fh, open_flags, backing_id)
        return bytes(edited)

    def _edit_init_reply(self, message: bytes) -> bytes:
        at = OUT_HEADER_SIZE
        if not self._kernel_offers or len(message) < at + 40:
            log.info("the kernel does not offer FUSE passthrough: data goes through the daemon")
            return message
        edited = bytearray(message)
        (flags,) = struct.unpack_from("<I", edited, at + 12)
        if flags & FUSE_WRITEBACK_CACHE:
            return message  # the kernel allows one or the other
        struct.pack_into("<I", edited, at + 12, flags | FUSE_INIT_EXT)
        (flags2,) = struct.unpack_from("<I", edited, at + 32)
        struct.pack_into("<II", edited, at + 32, flags2 | FUSE_PASSTHROUGH_FLAGS2, 1)
        self.enabled = True
        log.info("FUSE passthrough on: file data moves between the kernel and the RAM store")
        return bytes(edited)
