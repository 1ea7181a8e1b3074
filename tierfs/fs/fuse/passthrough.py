"""FUSE passthrough: the kernel reads and writes an open file's backing file in the RAM store
directly, so file data never crosses the daemon.

Without it, every 1 MiB of a checkpoint is a FUSE request that Python receives, copies and
writes again; the daemon's one busy core caps a save at a fraction of tmpfs speed (see
doc/BENCHMARKS.md for the profile). Linux 6.9+ can instead serve an open file from a
backing file the daemon names. That takes three things from the daemon: the FUSE_PASSTHROUGH
flag in the INIT reply, a backing id registered with an ioctl on /dev/fuse, and that id with
FOPEN_PASSTHROUGH in the reply to OPEN or CREATE.

pyfuse3 sits on libfuse 3.14, which predates passthrough (3.16). So tierfs mounts /dev/fuse
itself and gives libfuse one end of a SOCK_SEQPACKET socket pair as "/dev/fd/N" (libfuse's way
of accepting a device that its caller mounted). Two relay tasks on the daemon's trio loop move
whole messages between the device and libfuse, editing on the way the INIT request (no splice:
a socket is not the device), the INIT reply and the OPEN/CREATE replies of files offered for
passthrough. (They were threads: waking two more threads for each request, on two cores, took
about 90 us of a request's 135 us round trip; on the loop it is one more turn of epoll.) Every
other message passes unchanged, so the handlers stay ordinary pyfuse3 code. The messages and
the edits are in `tierfs.fs.fuse.fuse_wire` (pure functions over bytes); this module moves them, and
aborts the connection if the relay fails, so that no process waits forever on the mount.
A GETATTR is answered by the relay itself, from the daemon's handler with no await
(`_answer_now`): one turn of the loop instead of three; so are a LOOKUP of an absent name, a
CREATE, a FLUSH, a RELEASE and a SETATTR (but of a size) where the handler would never wait;
right after such an answer the relay retries its read of the next request for a few
microseconds before it waits on epoll (`_read_request`), as a synchronous saver's next request
comes that soon.

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
import queue
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from tierfs.fs.fuse import fuse_wire as wire
from tierfs.fs.model.nodes import FsError, Handle

if TYPE_CHECKING:
    from pyfuse3 import EntryAttributes

log = logging.getLogger(__name__)

# The ioctls of <linux/fuse.h> (protocol 7.40, as in tierfs.fs.fuse.fuse_wire) and <linux/mount.h>.
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)
BACKING_MAP = struct.Struct("<iIQ")  # struct fuse_backing_map: fd, flags, padding
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
SO_SNDBUFFORCE = 32

PAGE_SIZE = os.sysconf("SC_PAGESIZE")
# The data one relayed message carries at most: 1 MiB writes and reads (libfuse's max_write with
# 4 KiB pages; with 64 KiB pages libfuse asks for 16 MiB and the INIT reply is clamped to this).
PAYLOAD_MAX = wire.relay_payload(PAGE_SIZE)
MESSAGE_MAX = wire.relay_buffer(PAYLOAD_MAX)
SOCKET_BUFFER = 4 * MESSAGE_MAX
CONNECTIONS = "/sys/fs/fuse/connections"  # fusectl: where a FUSE connection can be aborted
# How long the relay retries its read of the next request right after it answered one itself
# (`_read_request`): a synchronous saver's next request comes within a few microseconds.
SPIN_NS = 30_000


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
    """The daemon's /dev/fuse, mounted at `mountpoint`, relayed to libfuse with passthrough.

    Any failure in the relay (a message that does not parse, one cut short, an unexpected
    error from the device or the socket) aborts the FUSE connection: processes on the mount get
    ENOTCONN at once, the log says why, instead of every one of them waiting forever for a
    reply that the stopped relay will never pass on."""

    def __init__(self, mountpoint: str, mount_options: list[str],
                 source: str = "tierfs") -> None:
        if os.geteuid() != 0:
            raise PassthroughUnavailable("registering backing files needs root")
        self.mountpoint = mountpoint
        self.source = source  # what /proc/self/mountinfo and df show as the mount's source
        self._offers: dict[int, int] = {}  # fh -> backing id, until the file is released
        self._backing: dict[int, Backing] = {}  # FUSE inode -> its registered backing file
        self._no_flush: set[int] = set()  # fh opened read-only, until the file is released
        self._wire = wire.RelayState(self._offers, payload=PAYLOAD_MAX, page_size=PAGE_SIZE,
                                     no_flush=self._no_flush)
        # Each relay task's buffer, reused for every message it moves (fuse_wire.Message).
        self._request_buffer = memoryview(bytearray(MESSAGE_MAX))
        self._reply_buffer = memoryview(bytearray(MESSAGE_MAX))
        self._request_buffers = [self._request_buffer]
        self._answered = False  # the last request was answered on the relay's own turn
        # The daemon's notifications to the kernel, for the thread that writes them
        # (`_send_notices`); None ends it.
        self._notices: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        # A GETATTR's answer with no await (`Operations.getattr_now`): the attributes, or the
        # errno that fails it; the relay answers GETATTR itself with it (`_answer_now`).
        self.getattr_now: Callable[[int], EntryAttributes | int] | None = None
        # Whether a LOOKUP of (directory inode, name) fails with an errno the daemon knows with
        # no await (`Operations.lookup_absent`): that errno, or None (libfuse answers it).
        self.lookup_absent: Callable[[int, bytes], int | None] | None = None
        # A FLUSH done with no await (`Operations.flush_now`): 0 or the errno that fails it,
        # or None (libfuse answers it).
        self.flush_now: Callable[[int], int | None] | None = None
        self.release_now: Callable[[int], int | None] | None = None  # the same for a RELEASE
        # A CREATE done with no await (`Operations.create_now`: directory inode, name, mode,
        # flags, umask, uid, gid, pid): the new file's handle and entry, the errno that fails
        # it, or None (libfuse answers it).
        self.create_now: Callable[[int, bytes, int, int, int, int, int, int],
                                  tuple[int, EntryAttributes] | int | None] | None = None
        # A SETATTR of anything but the size done with no await (`Operations.setattr_now`:
        # inode, the change): the attributes, the errno that fails it, or None.
        self.setattr_now: Callable[[int, wire.SetattrIn],
                                   EntryAttributes | int | None] | None = None
        # A FALLOCATE, done with no await (`Operations.fallocate_now`): 0 or the errno.
        self.fallocate_now: Callable[[wire.FallocateIn], int] | None = None
        self._closing = False
        self._aborted = False  # the connection was aborted
        self.connection: str | None = None  # the mount's directory under CONNECTIONS
        # not once mounted: that would wait for INIT
        self._where = where = os.path.realpath(mountpoint)
        try:
            self.dev_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise PassthroughUnavailable(f"/dev/fuse: {exc.strerror}") from None
        try:
            self._mount(mount_options)
        except BaseException:
            os.close(self.dev_fd)
            raise
        self.connection = _connection_id(where)
        self._kernel_side, library_side = socket.socketpair(socket.AF_UNIX,
                                                            socket.SOCK_SEQPACKET)
        for sock in (self._kernel_side, library_side):
            try:  # room for whole messages (root may exceed the sysctl maximum)
                sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SOCKET_BUFFER)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        self._kernel_side.setblocking(False)
        # libfuse owns this end from pyfuse3.init on and closes it in pyfuse3.close.
        self._library_fd = library_side.detach()

    @property
    def enabled(self) -> bool:
        """The kernel accepted passthrough in INIT (and no backing file was refused since)."""
        return self._wire.passthrough

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

    async def run(self, on_unmount: Callable[[], None]) -> None:
        """Relay until the kernel unmounts (then `on_unmount` is called) and libfuse ends its
        session, or until cancelled."""
        notices = threading.Thread(target=self._send_notices, name="fuse-notices", daemon=True)
        notices.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._relay_requests, on_unmount)
                nursery.start_soon(self._relay_replies)
        finally:
            self._notices.put(None)

    def _send_notices(self) -> None:
        """Give the kernel the daemon's notifications (`fs.tree.kernel_cache`), in order, from a
        thread of their own: the kernel handles an entry's by taking its directory's lock,
        which a request in that directory holds until the daemon answers it. Written on the
        daemon's loop, such a notification would wait for a reply the loop can no longer
        relay."""
        while (notice := self._notices.get()) is not None:
            try:
                os.write(self.dev_fd, notice)
            except OSError as exc:
                if exc.errno == errno.ENODEV:
                    return  # unmounted
                # ENOENT: the kernel holds nothing of that entry or inode (nothing to drop)
                if exc.errno != errno.ENOENT:
                    log.warning("a notification to the kernel failed: %s", exc.strerror)

    def unmount(self) -> None:
        """Lazy unmount; the relay tasks end when the kernel drops the connection. Once this
        mount is gone (`tierfs umount`), what is left at the mount point (a container's volume,
        a bind mount) stays."""
        if not _on_top(self._where, self.connection):
            return
        if _libc().umount2(os.fsencode(self.mountpoint), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOENT):  # already unmounted
                log.warning("unmounting %s: %s", self.mountpoint, os.strerror(err))

    def close(self) -> None:
        """After pyfuse3.close (which closed libfuse's end) and the end of `run`: free the
        fds."""
        self.stop()
        self._kernel_side.close()
        os.close(self.dev_fd)

    def stop(self) -> None:
        """Unmount and end libfuse's side: a running `run` returns soon after."""
        self._closing = True
        self.unmount()
        with contextlib.suppress(OSError):
            self._kernel_side.shutdown(socket.SHUT_RDWR)

    def abort(self, reason: str) -> None:
        """Fail every request on the mount, now and later, with ENOTCONN.

        The kernel's way is fusectl's `abort` file. Where fusectl is not mounted it is mounted
        in a private mount namespace of a short-lived `unshare` (nothing changes for the rest
        of the machine). Libfuse's end of the relay is shut too, so the daemon ends and
        unmounts even if neither works."""
        if self._aborted:
            return  # the other relay task got there first
        self._aborted = True
        if self._closing:
            log.info("FUSE relay stopped while closing: %s", reason)
        else:
            log.error("FUSE relay failed, aborting the connection (processes on %s get "
                      "ENOTCONN): %s", self.mountpoint, reason)
        if self.connection is not None:
            _abort_connection(self.connection)
        with contextlib.suppress(OSError):
            self._kernel_side.shutdown(socket.SHUT_RDWR)

    # -- choosing and registering ---------------------------------------------------------

    def choose(self, handle: Handle) -> bool:
        """Offer `handle` for passthrough if the kernel's io-mode rules allow it.

        Concurrent passthrough opens of an inode must share one backing id, so ids are kept
        per inode and counted. Raises ETXTBSY for the one case with no good answer: the inode
        is open for passthrough to one backing file and this open needs another (a write into
        a committed file that another process is reading).

        A read-only open is also spared the FLUSH of each close(): the daemon does nothing then,
        and a step of many small files read back costs one request less per file."""
        if not handle.writable:
            self._no_flush.add(handle.fh)
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
                                         bytearray(BACKING_MAP.pack(handle.fd, 0, 0)))
            except OSError as exc:
                log.warning("passthrough refused for %r: %s", node.name, exc.strerror)
                if exc.errno in (errno.EOPNOTSUPP, errno.EPERM):
                    self._wire.passthrough = False  # not this file's fault: stop asking
                return False
            shared = self._backing[node.ino] = Backing(backing_id, handle.backing_ino)
        handle.passthrough = True
        self._offers[handle.fh] = shared.backing_id
        return True

    def withdraw(self, handle: Handle) -> None:
        """The kernel released the file: drop its backing id when the inode's last user goes."""
        self._no_flush.discard(handle.fh)
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

    async def _relay_requests(self, on_unmount: Callable[[], None]) -> None:
        try:
            while await self._relay_request():
                pass
        except Exception as exc:  # noqa: BLE001 - any failure: abort, never hang the mount
            self.abort(f"relaying a request: {exc!r}")
        on_unmount()

    async def _relay_request(self) -> bool:
        """Move one message from the kernel to libfuse; False once the kernel unmounted."""
        try:
            length = self._read_request()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(self.dev_fd)
            return True
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT):
                return True  # ENOENT: the request was interrupted before we read it
            if exc.errno == errno.ENODEV:
                return False  # unmounted (or aborted)
            raise
        message = self._request_buffer[:length]
        answer = wire.answer_here(message)
        if answer is None:
            answer = self._answer_now(message)
        if answer is not None:
            if not self._to_kernel(answer):
                return False
            self._answered = True
            await trio.lowlevel.checkpoint_if_cancelled()  # as a relayed request does
            return True
        message = self._wire.request(message)
        while True:
            try:
                self._kernel_side.send(message)  # one whole message (SOCK_SEQPACKET)
                break
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._kernel_side)
            except (BrokenPipeError, ConnectionResetError):
                # libfuse ended its session (pyfuse3.close); the daemon closes the device next
                log.debug("libfuse ended its session: the request relay stops")
                return False
        await trio.lowlevel.checkpoint_if_cancelled()
        return True

    def _read_request(self) -> int:
        """Read the next request into the relay's buffer: its length, or BlockingIOError when
        none came. Right after the relay answered one itself, a few microseconds of retries
        first: a saver's next request (the close after the CREATE, the RELEASE after the
        FLUSH, the next file's LOOKUP) comes that soon, and each wait on epoll is another
        turn of the loop. Never when idle: the first miss after a wait is the last."""
        if not self._answered:
            return os.readv(self.dev_fd, self._request_buffers)
        self._answered = False
        deadline = time.perf_counter_ns() + SPIN_NS
        while True:
            try:
                return os.readv(self.dev_fd, self._request_buffers)
            except BlockingIOError:
                if time.perf_counter_ns() >= deadline:
                    raise

    def _answer_now(self, message: wire.Message) -> bytes | None:
        """A GETATTR, a LOOKUP of an absent name, a CREATE with room in the RAM tier, a FLUSH or
        RELEASE that commits nothing, a SETATTR of a mode, an owner or times of a file in RAM
        (`tar x` and `rsync -a` set all three on every file), a FALLOCATE (which libfuse would
        refuse: pyfuse3 has no handler for it), answered by the daemon on this
        turn of the loop, or None: a request relayed to libfuse is three turns of the loop (this
        task, the pyfuse3 worker's, the reply relay's), and these handlers never wait (a step of
        many files saved asks each once per file: the kernel checks the step directory's
        permissions, looks each new name up before it creates it, creates it, flushes it at its
        close and releases it). The answer is the handler's, only sooner: requests are answered
        in no particular order anyway (pyfuse3 runs several at once), the kernel discards
        attributes that raced with a change of them (`fuse_change_attributes`, by attr_version),
        and it holds the directory's lock over a LOOKUP as over the requests that change its
        names."""
        offer = self._wire.offer
        if not self._wire.initialized or offer is None or offer.minor < wire.ATTR_OUT_MINOR:
            return None
        code = wire.opcode_of(message)
        error: int | None = None
        if code == wire.Opcode.LOOKUP and self.lookup_absent is not None:
            error = self.lookup_absent(wire.nodeid_of(message), wire.lookup_name(message))
        elif code == wire.Opcode.FLUSH and self.flush_now is not None:
            error = self.flush_now(wire.flush_fh(message))
        elif code == wire.Opcode.RELEASE and self.release_now is not None:
            error = self.release_now(wire.flush_fh(message))
        elif code == wire.Opcode.FALLOCATE and self.fallocate_now is not None:
            error = self.fallocate_now(wire.fallocate_in(message))
        if code in (wire.Opcode.LOOKUP, wire.Opcode.FLUSH, wire.Opcode.RELEASE,
                    wire.Opcode.FALLOCATE):
            return None if error is None else wire.error_reply(wire.unique_of(message), error)
        if code == wire.Opcode.CREATE:
            return self._create_now(message) if offer.minor >= wire.CREATE_IN_MINOR else None
        attrs: EntryAttributes | int | None
        if code == wire.Opcode.SETATTR and self.setattr_now is not None:
            change = wire.setattr_in(message, time.time_ns())
            attrs = None if change is None else self.setattr_now(wire.nodeid_of(message),
                                                                 change)
        elif code == wire.Opcode.GETATTR and self.getattr_now is not None:
            attrs = self.getattr_now(wire.nodeid_of(message))
        else:
            return None
        if attrs is None:
            return None
        unique = wire.unique_of(message)
        if isinstance(attrs, int):
            return wire.error_reply(unique, attrs)
        return wire.attr_reply(unique, attrs, attrs.attr_timeout)

    def _create_now(self, message: wire.Message) -> bytes | None:
        """A CREATE made by the daemon on this turn of the loop (`_answer_now`), answered as
        libfuse would with pyfuse3's reply and the relay's edits of it (passthrough, its
        backing id), or None."""
        if self.create_now is None:
            return None
        header = wire.in_header(message)
        request = wire.create_in(message)
        made = self.create_now(header.nodeid, request.name, request.mode, request.flags,
                               request.umask, header.uid, header.gid, header.pid)
        if made is None:
            return None
        if isinstance(made, int):
            return wire.error_reply(header.unique, made)
        fh, entry = made
        return wire.edit_open_reply(wire.Opcode.CREATE, wire.create_reply(header.unique, entry, fh),
                                    self._offers, self._no_flush)

    async def _relay_replies(self) -> None:
        try:
            while await self._relay_reply():
                pass
        except Exception as exc:  # noqa: BLE001 - any failure: abort, never hang the mount
            self.abort(f"relaying a reply: {exc!r}")

    async def _relay_reply(self) -> bool:
        """Move one message from libfuse to the kernel; False once either end is gone."""
        try:
            length, _ancillary, flags, _address = self._kernel_side.recvmsg_into(
                [self._reply_buffer])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(self._kernel_side)
            return True
        except OSError as exc:
            if self._closing:
                return False
            raise wire.WireError(f"libfuse's end of the relay: {exc.strerror}") from None
        if not length:
            # libfuse ended its session (pyfuse3.close): how every mount ends, and the daemon
            # closes the device right after
            log.debug("libfuse ended its session: the reply relay stops")
            return False
        if flags & socket.MSG_TRUNC:
            raise wire.WireError(f"a reply longer than the relay's {MESSAGE_MAX} bytes")
        if wire.is_notification(self._reply_buffer[:length]):
            self._notices.put(bytes(self._reply_buffer[:length]))
            return True
        initialized = self._wire.initialized
        message = self._wire.reply(self._reply_buffer[:length])
        if self._wire.initialized and not initialized:
            log.info("FUSE passthrough on: file data moves between the kernel and the RAM store"
                     if self.enabled else
                     "the kernel does not offer FUSE passthrough: data goes through the daemon")
        if not self._to_kernel(message):
            return False
        await trio.lowlevel.checkpoint_if_cancelled()
        return True

    def _to_kernel(self, reply: wire.Message) -> bool:
        """Give the kernel a reply; False once it unmounted."""
        try:
            os.write(self.dev_fd, reply)  # the device takes a reply whole, never blocks
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return False
            if exc.errno != errno.ENOENT:  # ENOENT: the request was interrupted
                raise
        return True


def _mounts_at(mountpoint: str) -> list[tuple[str, bool]]:
    """The mounts at `mountpoint`, oldest first, from /proc/self/mountinfo (a stat would wait
    for INIT): each one's FUSE connection as fusectl names it (the kernel's dev_t of the
    superblock) and whether it is a tierfs mount."""
    escaped = mountpoint.replace("\\", "\\134").replace(" ", "\\040").replace(
        "\t", "\\011").replace("\n", "\\012")
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == escaped:
                major, minor = (int(n) for n in fields[2].split(":"))
                # the kernel's MKDEV, which fusectl prints
                found.append((str(major << 20 | minor), " - fuse.tierfs " in line))
    return found


def _connection_id(mountpoint: str) -> str | None:
    """The FUSE connection of the newest tierfs mount at `mountpoint`."""
    found = [connection for connection, tierfs in _mounts_at(mountpoint) if tierfs]
    if not found:
        log.warning("%s is not in /proc/self/mountinfo: a relay failure cannot abort it",
                    mountpoint)
        return None
    return found[-1]


def _on_top(mountpoint: str, connection: str | None) -> bool:
    """The newest mount at `mountpoint` is this tierfs mount (any tierfs mount when its
    connection is unknown)."""
    mounts = _mounts_at(mountpoint)
    if not mounts or not mounts[-1][1]:
        return False
    return connection is None or mounts[-1][0] == connection


def _abort_connection(connection: str) -> None:
    """Write fusectl's `abort` file of the connection; where fusectl is not mounted, mount it
    in the private mount namespace of a short-lived `unshare` to do so."""
    abort = f"{CONNECTIONS}/{connection}/abort"
    if os.path.ismount(CONNECTIONS):
        try:
            with open(abort, "w") as f:
                f.write("1")
        except OSError as exc:
            log.error("cannot abort FUSE connection %s: %s", connection, exc.strerror)
        return
    try:
        subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f"mount -t fusectl fusectl {CONNECTIONS} && echo 1 > {abort}"],
                       check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("cannot abort FUSE connection %s (fusectl is not mounted): %s",
                  connection, exc)
