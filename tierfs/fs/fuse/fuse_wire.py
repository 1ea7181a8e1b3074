"""The FUSE messages the passthrough relay reads and edits, as named layouts, and the edits as
pure functions over bytes (sans-IO: `fs/fuse/passthrough.py` moves the bytes, this module only looks
at them, so every edit is unit-tested on constructed messages without a mount).

Layouts and constants are those of <linux/fuse.h> at FUSE protocol 7.40 (Linux 6.9, the
version that added FUSE_PASSTHROUGH, `fuse_open_out.backing_id` and
`fuse_init_out.max_stack_depth`). Older kernels speak a prefix of it: the INIT request is
shorter before 7.36 (no flags2) and nothing is offered for passthrough before 7.40; that is what
`InitOffer` records and the checks below rely on.

What the relay changes, and why:
- INIT request: the SPLICE flags are cleared, since libfuse reads a socket, not the device.
- INIT reply: `max_write` and `max_pages` are clamped to what the relay's buffers hold (libfuse
  sizes them from the page size: 16 MiB with 64 KiB pages), and, when the kernel offered it,
  FUSE_PASSTHROUGH is turned on with a `max_stack_depth`.
- OPEN and CREATE replies of files the daemon offered: FOPEN_PASSTHROUGH and the backing id.
What the relay answers itself, without libfuse:
- GETXATTR of a name outside `user.`: EOPNOTSUPP, the daemon's answer for every file (tierfs
  keeps no security labels, ACLs or capabilities: `nodes.XATTR_NAMESPACE`). GNU `ls -l` asks
  for two such names per entry (security.selinux, system.posix_acl_access) and FUSE forwards
  both; as round trips through libfuse and the daemon's loop they were most of an `ls -l`, and
  even answered here (ENODATA, until 2026-12-03) two round trips per entry: told the file
  system has none, `ls` stops asking for it.
- GETATTR, from the daemon's own answer with no await (`attr_reply`, `fs.fuse.passthrough`):
  the kernel asks it of a directory before every file created in it (its permissions); through
  libfuse it was three turns of the daemon's loop, answered here one.
- LOOKUP of a name the directory does not hold, when the daemon has nothing to ask first
  (`Operations.lookup_absent`): ENOENT, the daemon's answer. The kernel looks up every file's
  name before it creates it, so a step of many files saved asks one such LOOKUP per file.
- FLUSH and RELEASE of a file whose writer's end commits nothing (`Operations.flush_now`,
  `release_now`): done by the daemon on the relay's turn of the loop, as its handlers would,
  and answered.
- CREATE of a file whose create waits for nothing (`Operations.create_now`): made by the daemon
  on the relay's turn of the loop, answered with the reply libfuse's `fuse_reply_create` would
  write for pyfuse3 (`create_reply`), then edited as every CREATE reply (`edit_open_reply`).
- FALLOCATE (`Operations.fallocate_now`): pyfuse3 has no handler for it, and libfuse's ENOSYS
  would make the kernel refuse every later fallocate(2) on the mount with EOPNOTSUPP
  (`fallocate -l`, `rsync --preallocate`).
What the relay takes aside:
- Notifications (a message from libfuse with `unique` 0: the daemon's invalidations,
  `fs.tree.kernel_cache`): written to the kernel by a thread of their own (`fs.fuse.passthrough`).
Everything else passes unchanged. A message that does not parse raises WireError: the relay
then aborts the connection rather than guess.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, Protocol

from tierfs.fs.model.nodes import XATTR_NAMESPACE

# A message's bytes: the relay hands over views of the buffers it reuses from message to
# message (a fresh 2 MiB buffer per message cost about 20 us each way), which no function here
# keeps beyond its call.
Message = bytes | memoryview

PROTOCOL_MAJOR = 7  # the only major version there has ever been
PASSTHROUGH_MINOR = 40  # the first minor version with FUSE_PASSTHROUGH
INIT_EXT_MINOR = 36  # the first with fuse_init_in.flags2 (FUSE_INIT_EXT)


class Opcode(IntEnum):
    LOOKUP = 1
    GETATTR = 3
    SETATTR = 4
    OPEN = 14
    RELEASE = 18
    GETXATTR = 22
    FLUSH = 25
    INIT = 26
    CREATE = 35
    IOCTL = 39
    FALLOCATE = 43


# fuse_init_in/out.flags (flags2 holds bits 32-63, FUSE_INIT_EXT says it is there)
FUSE_SPLICE_WRITE = 1 << 7
FUSE_SPLICE_MOVE = 1 << 8
FUSE_SPLICE_READ = 1 << 9
FUSE_SPLICE_FLAGS = FUSE_SPLICE_WRITE | FUSE_SPLICE_MOVE | FUSE_SPLICE_READ
FUSE_WRITEBACK_CACHE = 1 << 16
FUSE_HANDLE_KILLPRIV_V2 = 1 << 28
FUSE_MAX_PAGES = 1 << 22
FUSE_INIT_EXT = 1 << 30
FUSE_PASSTHROUGH_FLAGS2 = 1 << (37 - 32)  # FUSE_PASSTHROUGH is bit 37

# fuse_open_out.open_flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_NOFLUSH = 1 << 5
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6
FOPEN_PASSTHROUGH = 1 << 7
# The only open flags the kernel accepts beside FOPEN_PASSTHROUGH (not KEEP_CACHE: no cache).
FOPEN_PASSTHROUGH_MASK = (FOPEN_DIRECT_IO | FOPEN_NOFLUSH | FOPEN_PARALLEL_DIRECT_WRITES
                          | FOPEN_PASSTHROUGH)

# The stacking depth of a passthrough mount over its backing files: they live in the RAM dir, a
# tmpfs (depth 0), so this mount is one level deep. The kernel allows up to
# FILESYSTEM_MAX_STACK_DEPTH (2); 0 would mean "no passthrough".
MAX_STACK_DEPTH = 1
# What the kernel uses when the INIT reply does not set FUSE_MAX_PAGES (fs/fuse/fuse_i.h).
FUSE_DEFAULT_MAX_PAGES_PER_REQ = 32
# The kernel refuses to read requests into a buffer smaller than this (FUSE_MIN_READ_BUFFER).
FUSE_MIN_READ_BUFFER = 8192

# struct fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
IN_HEADER = struct.Struct("<IIQQIIIHH")
# struct fuse_out_header: len, error, unique
OUT_HEADER = struct.Struct("<IiQ")
# struct fuse_init_in up to flags2 (7.36+; the unused[11] after it is not read): major, minor,
# max_readahead, flags, flags2. Before 7.36 it ends after flags.
INIT_IN = struct.Struct("<IIIII")
INIT_IN_BEFORE_EXT = struct.Struct("<IIII")
# struct fuse_init_out up to max_stack_depth (the unused[6] after it is not touched): major,
# minor, max_readahead, flags, max_background, congestion_threshold, max_write, time_gran,
# max_pages, map_alignment, flags2, max_stack_depth.
INIT_OUT = struct.Struct("<IIIIHHIIHHII")
# struct fuse_open_out: fh, open_flags, backing_id (padding before 7.40)
OPEN_OUT = struct.Struct("<QIi")
# struct fuse_attr (7.9+): ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec,
# ctimensec, mode, nlink, uid, gid, rdev, blksize, flags; times signed, as the kernel reads them.
FUSE_ATTR = "3Q3q10I"
# struct fuse_entry_out (with its struct fuse_attr), which precedes fuse_open_out in a CREATE
# reply: nodeid, generation, entry_valid, attr_valid, entry_valid_nsec, attr_valid_nsec, attr.
ENTRY_OUT = struct.Struct("<QQQQII88x")
# struct fuse_attr_out (7.9+) with its struct fuse_attr: attr_valid, attr_valid_nsec, dummy;
# then the attributes.
ATTR_OUT = struct.Struct("<QII" + FUSE_ATTR)
ATTR_OUT_MINOR = 9  # the first minor version with these layouts (before: no blksize, flags)
# A CREATE reply's body: fuse_entry_out, then fuse_open_out (fh, open_flags, backing_id).
CREATE_OUT = struct.Struct("<QQQQII" + FUSE_ATTR + "QIi")
# struct fuse_create_in (7.12+): flags, mode, umask, open_flags; the name follows,
# NUL-terminated (then any request extensions, `total_extlen`, which libfuse does not read).
CREATE_IN = struct.Struct("<IIII")
CREATE_IN_MINOR = 12  # the first minor version with this layout (before: no umask)
GETXATTR_IN = struct.Struct("<II")  # size, padding; the name follows, NUL-terminated
# struct fuse_setattr_in: valid, padding, fh, size, lock_owner, atime, mtime, ctime, atimensec,
# mtimensec, ctimensec, mode, unused4, uid, gid, unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
# fuse_setattr_in.valid
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH = 1 << 4, 1 << 5, 1 << 6
FATTR_ATIME_NOW, FATTR_MTIME_NOW, FATTR_LOCKOWNER, FATTR_CTIME = 1 << 7, 1 << 8, 1 << 9, 1 << 10
FATTR_KILL_SUIDGID = 1 << 11
# struct fuse_fallocate_in: fh, offset, length, mode, padding
FALLOCATE_IN = struct.Struct("<QQQII")
# struct fuse_write_in, which with the in-header precedes a WRITE's data.
WRITE_IN_SIZE = 40

assert IN_HEADER.size == 40 and OUT_HEADER.size == 16 and OPEN_OUT.size == 16
assert INIT_OUT.size == 40 and ENTRY_OUT.size == 128 and ATTR_OUT.size == 104
assert SETATTR_IN.size == 88
assert CREATE_OUT.size == ENTRY_OUT.size + OPEN_OUT.size and CREATE_IN.size == 16


class WireError(Exception):
    """A message the relay cannot make sense of (too short, unknown protocol)."""


class InHeader(NamedTuple):
    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    total_extlen: int
    padding: int


class OutHeader(NamedTuple):
    length: int
    error: int
    unique: int


class InitIn(NamedTuple):
    major: int
    minor: int
    max_readahead: int
    flags: int
    flags2: int


class InitOut(NamedTuple):
    major: int
    minor: int
    max_readahead: int
    flags: int
    max_background: int
    congestion_threshold: int
    max_write: int
    time_gran: int
    max_pages: int
    map_alignment: int
    flags2: int
    max_stack_depth: int


class OpenOut(NamedTuple):
    fh: int
    open_flags: int
    backing_id: int


class CreateIn(NamedTuple):
    flags: int  # open(2)'s flags
    mode: int  # the new file's mode, before the umask
    umask: int
    open_flags: int  # FUSE_OPEN_KILL_SUIDGID; libfuse does not read it
    name: bytes


class SetattrIn(NamedTuple):
    """What a SETATTR request sets (None: left as it is), as pyfuse3 hands it to `setattr`;
    times in nanoseconds."""

    fh: int | None
    mode: int | None
    uid: int | None
    gid: int | None
    atime_ns: int | None
    mtime_ns: int | None


# The SETATTR fields `setattr_in` reads; a request with any other (a size, a field it does not
# know) goes to libfuse. FATTR_KILL_SUIDGID, which the kernel sends with every chown of a file
# (FUSE_HANDLE_KILLPRIV_V2), is left as libfuse leaves it to pyfuse3, which hands it to no
# handler: the mount is nosuid (`edit_init_reply`).
SETATTR_READ = (FATTR_MODE | FATTR_UID | FATTR_GID | FATTR_ATIME | FATTR_MTIME | FATTR_FH
                | FATTR_ATIME_NOW | FATTR_MTIME_NOW | FATTR_LOCKOWNER | FATTR_CTIME
                | FATTR_KILL_SUIDGID)


def setattr_in(message: Message, now_ns: int) -> SetattrIn | None:
    """A SETATTR request's changes, or None for one that sets more than `SETATTR_READ` or
    clears set-id bits with a new size (the ctime the kernel sends with them is not kept:
    pyfuse3 hands it to no handler)."""
    (valid, _pad, fh, _size, _lock_owner, atime, mtime, _ctime, atimensec, mtimensec,
     _ctimensec, mode, _unused4, uid, gid, _unused5) = _unpack(SETATTR_IN, message,
                                                              IN_HEADER.size, "SETATTR request")
    if valid & ~SETATTR_READ or (valid & FATTR_KILL_SUIDGID
                                 and not valid & (FATTR_UID | FATTR_GID)):
        return None
    # as pyfuse3: the kernel's time where it sends one (with ATIME_NOW it sends its now), else
    # now for ATIME_NOW alone
    atime_ns = atime * 1_000_000_000 + atimensec if valid & FATTR_ATIME else (
        now_ns if valid & FATTR_ATIME_NOW else None)
    mtime_ns = mtime * 1_000_000_000 + mtimensec if valid & FATTR_MTIME else (
        now_ns if valid & FATTR_MTIME_NOW else None)
    return SetattrIn(fh if valid & FATTR_FH else None,
                     mode if valid & FATTR_MODE else None, uid if valid & FATTR_UID else None,
                     gid if valid & FATTR_GID else None, atime_ns, mtime_ns)


def _unpack(layout: struct.Struct, message: Message, at: int, what: str) -> tuple[int, ...]:
    if len(message) < at + layout.size:
        raise WireError(f"{what}: {len(message)} bytes, needs {at + layout.size}")
    return layout.unpack_from(message, at)


def in_header(message: Message) -> InHeader:
    return InHeader(*_unpack(IN_HEADER, message, 0, "request header"))


# The two fields the relay reads of every message (`opcode_of`, `unique_of`), read alone: every
# request of a step of many files passes here, and a whole header as a named tuple, twice a
# message, was a tenth of the relay's own time.
_OPCODE = struct.Struct("<I")  # fuse_in_header.opcode, at offset 4
_UNIQUE = struct.Struct("<Q")  # fuse_in_header.unique and fuse_out_header.unique, at offset 8
_NODEID = struct.Struct("<Q")  # fuse_in_header.nodeid, at offset 16
_FH = struct.Struct("<Q")  # the fh that begins fuse_flush_in and fuse_release_in


def opcode_of(message: Message) -> int:
    """A request's opcode."""
    if len(message) < IN_HEADER.size:
        raise WireError(f"request header: {len(message)} bytes, needs {IN_HEADER.size}")
    return _OPCODE.unpack_from(message, 4)[0]


def unique_of(message: Message) -> int:
    """A request's or a reply's `unique` (0: a notification)."""
    if len(message) < OUT_HEADER.size:
        raise WireError(f"header: {len(message)} bytes, needs {OUT_HEADER.size}")
    return _UNIQUE.unpack_from(message, 8)[0]


def nodeid_of(message: Message) -> int:
    """The inode a request is about (pyfuse3's inode numbers are the kernel's node ids)."""
    if len(message) < IN_HEADER.size:
        raise WireError(f"request header: {len(message)} bytes, needs {IN_HEADER.size}")
    return _NODEID.unpack_from(message, 16)[0]


def lookup_name(message: Message) -> bytes:
    """The name a LOOKUP request asks for in its directory (`nodeid_of`): the body is the name,
    NUL-terminated."""
    end = bytes(message[IN_HEADER.size:]).find(b"\0")
    if end < 0:
        raise WireError(f"a LOOKUP request of {len(message)} bytes with no NUL")
    return bytes(message[IN_HEADER.size:IN_HEADER.size + end])


def flush_fh(message: Message) -> int:
    """The file handle a FLUSH or RELEASE request closes (the fh that begins fuse_flush_in and
    fuse_release_in, right after the header)."""
    if len(message) < IN_HEADER.size + 8:
        raise WireError(f"a FLUSH or RELEASE request of {len(message)} bytes")
    return _FH.unpack_from(message, IN_HEADER.size)[0]


class FallocateIn(NamedTuple):
    fh: int
    offset: int
    length: int
    mode: int  # fallocate(2)'s


def fallocate_in(message: Message) -> FallocateIn:
    """A FALLOCATE request's arguments."""
    return FallocateIn(*_unpack(FALLOCATE_IN, message, IN_HEADER.size, "FALLOCATE request")[:4])


def create_in(message: Message) -> CreateIn:
    """A CREATE request's arguments and the name it makes in its directory (`nodeid_of`), as
    libfuse reads them at protocol 7.12 and later."""
    fields = _unpack(CREATE_IN, message, IN_HEADER.size, "CREATE request")
    name_at = IN_HEADER.size + CREATE_IN.size
    end = bytes(message[name_at:]).find(b"\0")
    if end < 0:
        raise WireError(f"a CREATE request of {len(message)} bytes with no NUL")
    return CreateIn(*fields, bytes(message[name_at:name_at + end]))


def out_header(message: Message) -> OutHeader:
    return OutHeader(*_unpack(OUT_HEADER, message, 0, "reply header"))


def init_in(message: Message) -> InitIn:
    """The kernel's INIT request; flags2 is 0 where the kernel does not send it."""
    major, minor, max_readahead, flags = _unpack(INIT_IN_BEFORE_EXT, message, IN_HEADER.size,
                                                 "INIT request")
    if major != PROTOCOL_MAJOR:
        raise WireError(f"the kernel speaks FUSE protocol {major}.{minor}, "
                        f"the relay {PROTOCOL_MAJOR}.x")
    flags2 = 0
    if flags & FUSE_INIT_EXT:
        flags2 = _unpack(INIT_IN, message, IN_HEADER.size, "INIT request with flags2")[4]
    return InitIn(major, minor, max_readahead, flags, flags2)


def init_out(message: Message) -> InitOut:
    return InitOut(*_unpack(INIT_OUT, message, OUT_HEADER.size, "INIT reply"))


def open_out_offset(opcode: int) -> int:
    """Where fuse_open_out starts in a successful reply to OPEN or CREATE."""
    return OUT_HEADER.size + (ENTRY_OUT.size if opcode == Opcode.CREATE else 0)


def open_out(opcode: int, message: Message) -> OpenOut:
    return OpenOut(*_unpack(OPEN_OUT, message, open_out_offset(opcode), f"{opcode} reply"))


@dataclass(frozen=True)
class InitOffer:
    """What the kernel's INIT request said that matters to the reply."""

    minor: int
    passthrough: bool  # FUSE_PASSTHROUGH offered (needs protocol 7.40 and FUSE_INIT_EXT)
    max_pages: bool  # FUSE_MAX_PAGES offered (7.28+): the reply's max_pages is honoured
    # FUSE_HANDLE_KILLPRIV_V2 offered (7.33+): see `edit_init_reply`
    killpriv_v2: bool = False


def edit_init_request(message: Message) -> tuple[bytes, InitOffer]:
    """Clear the SPLICE flags (libfuse reads a socket, which cannot splice); note the offer."""
    init = init_in(message)
    edited = bytearray(message)
    flags_at = IN_HEADER.size + 12
    struct.pack_into("<I", edited, flags_at, init.flags & ~FUSE_SPLICE_FLAGS)
    offer = InitOffer(minor=init.minor,
                      passthrough=(init.minor >= PASSTHROUGH_MINOR
                                   and bool(init.flags & FUSE_INIT_EXT)
                                   and bool(init.flags2 & FUSE_PASSTHROUGH_FLAGS2)),
                      max_pages=bool(init.flags & FUSE_MAX_PAGES),
                      killpriv_v2=bool(init.flags & FUSE_HANDLE_KILLPRIV_V2))
    return bytes(edited), offer


def answer_here(message: Message) -> bytes | None:
    """The reply the relay gives the kernel itself for this request, or None: it goes to
    libfuse. Two requests whose answer never depends on the tree are answered here, without a
    round trip through libfuse and the daemon's loop: a GETXATTR of a name outside
    `XATTR_NAMESPACE` (EOPNOTSUPP), and every IOCTL (ENOTTY: tierfs has none, as libfuse's own
    answer, ENOSYS, tells the kernel; Python's `open()` asks `isatty` of every file it opens,
    one round trip per file saved)."""
    code = opcode_of(message)
    if code == Opcode.IOCTL:
        return OUT_HEADER.pack(OUT_HEADER.size, -errno.ENOTTY, unique_of(message))
    if code != Opcode.GETXATTR:
        return None
    name_at = IN_HEADER.size + GETXATTR_IN.size
    if len(message) <= name_at:
        raise WireError(f"a GETXATTR request of {len(message)} bytes")
    if bytes(message[name_at:name_at + len(XATTR_NAMESPACE)]) == XATTR_NAMESPACE:
        return None
    return OUT_HEADER.pack(OUT_HEADER.size, -errno.EOPNOTSUPP, unique_of(message))


class Attributes(Protocol):
    """What a GETATTR reply carries of a file (an `os.stat_result` or pyfuse3's
    `EntryAttributes`)."""

    @property
    def st_ino(self) -> int: ...
    @property
    def st_mode(self) -> int: ...
    @property
    def st_nlink(self) -> int: ...
    @property
    def st_uid(self) -> int: ...
    @property
    def st_gid(self) -> int: ...
    @property
    def st_rdev(self) -> int: ...
    @property
    def st_size(self) -> int: ...
    @property
    def st_blocks(self) -> int: ...
    @property
    def st_blksize(self) -> int: ...
    @property
    def st_atime_ns(self) -> int: ...
    @property
    def st_mtime_ns(self) -> int: ...
    @property
    def st_ctime_ns(self) -> int: ...


class Entry(Attributes, Protocol):
    """What a CREATE (or LOOKUP) reply carries of a file: pyfuse3's `EntryAttributes`."""

    @property
    def generation(self) -> int: ...
    @property
    def entry_timeout(self) -> float: ...
    @property
    def attr_timeout(self) -> float: ...


def _timeout(seconds: float) -> tuple[int, int]:
    """A validity in seconds as the kernel takes it, whole seconds and nanoseconds (libfuse's
    `calc_timeout_sec` and `calc_timeout_nsec`)."""
    if seconds <= 0:
        return 0, 0
    whole = min(int(seconds), (1 << 64) - 1)
    return whole, min(int((seconds - whole) * 1e9), 999_999_999)


def _fuse_attr(attrs: Attributes) -> tuple[int, ...]:
    """struct fuse_attr's fields, as libfuse's `convert_stat` fills them (flags 0)."""
    atime, atime_ns = divmod(attrs.st_atime_ns, 1_000_000_000)
    mtime, mtime_ns = divmod(attrs.st_mtime_ns, 1_000_000_000)
    ctime, ctime_ns = divmod(attrs.st_ctime_ns, 1_000_000_000)
    return (attrs.st_ino, attrs.st_size, attrs.st_blocks, atime, mtime, ctime,
            atime_ns, mtime_ns, ctime_ns, attrs.st_mode, attrs.st_nlink, attrs.st_uid,
            attrs.st_gid, attrs.st_rdev, attrs.st_blksize, 0)


def attr_reply(unique: int, attrs: Attributes, timeout: float) -> bytes:
    """The reply to a GETATTR: what libfuse's `fuse_reply_attr` writes for the same
    attributes (`answer_now` in `fs.fuse.passthrough` answers GETATTR without libfuse)."""
    return OUT_HEADER.pack(OUT_HEADER.size + ATTR_OUT.size, 0, unique) + ATTR_OUT.pack(
        *_timeout(timeout), 0, *_fuse_attr(attrs))


def create_reply(unique: int, entry: Entry, fh: int) -> bytes:
    """The reply to a CREATE of file handle `fh`: what libfuse's `fuse_reply_create` writes
    for pyfuse3's `FileInfo(fh=fh)` (no open flags; `edit_open_reply` then adds passthrough
    as to every CREATE reply)."""
    entry_valid, entry_valid_nsec = _timeout(entry.entry_timeout)
    attr_valid, attr_valid_nsec = _timeout(entry.attr_timeout)
    return OUT_HEADER.pack(OUT_HEADER.size + CREATE_OUT.size, 0, unique) + CREATE_OUT.pack(
        entry.st_ino, entry.generation, entry_valid, attr_valid, entry_valid_nsec,
        attr_valid_nsec, *_fuse_attr(entry), fh, 0, 0)


def error_reply(unique: int, error: int) -> bytes:
    """A reply that fails a request with `error` (an errno)."""
    return OUT_HEADER.pack(OUT_HEADER.size, -error, unique)


def is_notification(message: Message) -> bool:
    """A message from libfuse that answers no request: a notification the daemon sends the
    kernel on its own (its `unique` is 0; its `error` field holds the notification's code)."""
    return unique_of(message) == 0


def relay_payload(page_size: int, wanted: int = 1 << 20) -> int:
    """The data a relayed message may carry: `wanted`, but never less than a kernel that does
    not take max_pages (FUSE_DEFAULT_MAX_PAGES_PER_REQ pages) may send or ask for."""
    return max(wanted, FUSE_DEFAULT_MAX_PAGES_PER_REQ * page_size)


def relay_buffer(payload: int) -> int:
    """The buffer that holds any message carrying at most `payload` bytes of data: the kernel
    needs room for a WRITE's headers (and FUSE_MIN_READ_BUFFER) beside max_write."""
    return payload + max(FUSE_MIN_READ_BUFFER, IN_HEADER.size + WRITE_IN_SIZE)


def edit_init_reply(message: Message, offer: InitOffer, *, payload: int,
                    page_size: int) -> tuple[bytes, bool]:
    """Clamp max_write and max_pages to `payload` bytes; turn passthrough on where offered.

    Returns the edited reply and whether passthrough is on. Passthrough stays off when the
    kernel did not offer it or libfuse asked for the writeback cache (the kernel allows one or
    the other).

    FUSE_HANDLE_KILLPRIV_V2 is turned on where offered: without it the kernel asks the daemon
    for `security.capability` (GETXATTR) before every write() into a file, passthrough or not
    (a 64 MiB file written 1 MiB at a time: 64 round trips; one per file with it). It means the
    file system clears set-user-ID and set-group-ID bits itself on write; tierfs leaves them:
    the mount is nosuid, where they and file capabilities have no effect (doc/SEMANTICS.md)."""
    reply = init_out(message)
    if reply.major != PROTOCOL_MAJOR:
        raise WireError(f"libfuse answered INIT with protocol {reply.major}.{reply.minor}")
    max_write = min(reply.max_write, payload)
    max_pages = max(1, min(reply.max_pages, payload // page_size))
    flags, flags2, depth = reply.flags, reply.flags2, reply.max_stack_depth
    if offer.killpriv_v2:
        flags |= FUSE_HANDLE_KILLPRIV_V2
    passthrough = offer.passthrough and not flags & FUSE_WRITEBACK_CACHE
    if passthrough:
        flags |= FUSE_INIT_EXT
        flags2 |= FUSE_PASSTHROUGH_FLAGS2
        depth = MAX_STACK_DEPTH
    edited = bytearray(message)
    INIT_OUT.pack_into(edited, OUT_HEADER.size, *reply._replace(
        flags=flags, max_write=max_write, max_pages=max_pages, flags2=flags2,
        max_stack_depth=depth))
    return bytes(edited), passthrough


def edit_open_reply(opcode: int, message: Message, offers: Mapping[int, int],
                    no_flush: Container[int] = ()) -> Message:
    """Pass the opened file through to its backing file if the daemon offered its handle, and
    spare its close() a FLUSH if the daemon has nothing to do then (`no_flush`)."""
    reply = open_out(opcode, message)
    backing_id = offers.get(reply.fh)
    flags, backing = reply.open_flags, reply.backing_id
    if backing_id is not None:
        flags, backing = (flags | FOPEN_PASSTHROUGH) & FOPEN_PASSTHROUGH_MASK, backing_id
    if reply.fh in no_flush:
        flags |= FOPEN_NOFLUSH
    if (flags, backing) == (reply.open_flags, reply.backing_id):
        return message
    edited = bytearray(message)
    OPEN_OUT.pack_into(edited, open_out_offset(opcode), reply.fh, flags, backing)
    return bytes(edited)


@dataclass
class RelayState:
    """The relay's memory between a request and its reply, and the edits it makes (sans-IO).

    `offers` maps a file handle the daemon offered for passthrough to its backing id, and
    `no_flush` holds the handles whose close() needs no FLUSH (opened read-only: the daemon does
    nothing at their flush); both are the daemon's own, read here when the OPEN or CREATE reply
    goes by."""

    offers: Mapping[int, int]
    payload: int
    page_size: int
    no_flush: Container[int] = field(default_factory=set)
    passthrough: bool = False  # the INIT reply turned it on
    initialized: bool = False  # the INIT reply went by
    offer: InitOffer | None = None
    awaiting: dict[int, int] = field(default_factory=dict)  # unique -> opcode to edit

    def request(self, message: Message) -> Message:
        """A message from the kernel, as libfuse should see it (after `answer_here`)."""
        code = opcode_of(message)
        if code == Opcode.INIT:
            message, self.offer = edit_init_request(message)
        if code in (Opcode.INIT, Opcode.OPEN, Opcode.CREATE):
            self.awaiting[unique_of(message)] = code
        return message

    def reply(self, message: Message) -> Message:
        """A message from libfuse, as the kernel should see it."""
        unique = unique_of(message)
        code = self.awaiting.pop(unique, None) if unique and self.awaiting else None
        if code is None or out_header(message).error != 0:
            return message
        if code == Opcode.INIT:
            if self.offer is None:
                raise WireError("an INIT reply without an INIT request")
            message, self.passthrough = edit_init_reply(message, self.offer,
                                                        payload=self.payload,
                                                        page_size=self.page_size)
            self.initialized = True
            return message
        return edit_open_reply(code, message, self.offers, self.no_flush)
