"""The passthrough relay's edits of FUSE messages (tierfs.fs.fuse.fuse_wire), on constructed bytes
laid out as <linux/fuse.h> 7.40 has them: no mount, no root, no kernel support needed."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pyfuse3
import pytest

from tierfs.fs.fuse import fuse_wire as wire

pytestmark = pytest.mark.core

UNIQUE = 7
PAYLOAD_4K = wire.relay_payload(4096)


def request(opcode: int, body: bytes, unique: int = UNIQUE) -> bytes:
    length = wire.IN_HEADER.size + len(body)
    return wire.IN_HEADER.pack(length, opcode, unique, 1, 0, 0, 1234, 0, 0) + body


def reply(body: bytes, unique: int = UNIQUE, error: int = 0) -> bytes:
    return wire.OUT_HEADER.pack(wire.OUT_HEADER.size + len(body), error, unique) + body


def init_request(minor: int = 40, flags: int = 0, flags2: int = 0) -> bytes:
    """A kernel's INIT request; before 7.36 it has no flags2 and is 16 bytes long."""
    if minor < wire.INIT_EXT_MINOR:
        return request(wire.Opcode.INIT, struct.pack("<IIII", 7, minor, 131072, flags))
    return request(wire.Opcode.INIT,
                   struct.pack("<IIIII44x", 7, minor, 131072, flags | wire.FUSE_INIT_EXT,
                               flags2))


def init_reply(max_write: int = 1 << 20, max_pages: int = 256, flags: int = 0,
               flags2: int = 0) -> bytes:
    """libfuse 3.14's INIT reply (protocol 7.36 on its side): 64 bytes of fuse_init_out."""
    return reply(wire.INIT_OUT.pack(7, 36, 131072, flags | wire.FUSE_MAX_PAGES, 16, 12,
                                    max_write, 1, max_pages, 0, flags2, 0) + bytes(24))


def open_reply(fh: int, open_flags: int = 0, create: bool = False) -> bytes:
    entry = wire.ENTRY_OUT.pack(5, 1, 1, 1, 0, 0) if create else b""
    return reply(entry + wire.OPEN_OUT.pack(fh, open_flags, 0))


def test_the_layouts_have_the_kernel_header_sizes() -> None:
    assert (wire.IN_HEADER.size, wire.OUT_HEADER.size) == (40, 16)
    assert (wire.INIT_OUT.size, wire.OPEN_OUT.size, wire.ENTRY_OUT.size) == (40, 16, 128)
    assert wire.open_out_offset(wire.Opcode.OPEN) == 16
    assert wire.open_out_offset(wire.Opcode.CREATE) == 16 + 128


def test_init_request_loses_the_splice_flags_and_nothing_else() -> None:
    flags = wire.FUSE_SPLICE_FLAGS | wire.FUSE_MAX_PAGES | 1
    message = init_request(flags=flags, flags2=wire.FUSE_PASSTHROUGH_FLAGS2)
    edited, offer = wire.edit_init_request(message)
    assert len(edited) == len(message)
    assert wire.init_in(edited).flags == (flags | wire.FUSE_INIT_EXT) & ~wire.FUSE_SPLICE_FLAGS
    assert edited[:52] == message[:52] and edited[56:] == message[56:]
    assert offer == wire.InitOffer(minor=40, passthrough=True, max_pages=True)


@pytest.mark.parametrize(("minor", "flags2", "offered"), [
    (40, wire.FUSE_PASSTHROUGH_FLAGS2, True),
    (41, wire.FUSE_PASSTHROUGH_FLAGS2, True),
    (40, 0, False),  # a kernel built without CONFIG_FUSE_PASSTHROUGH
    (39, wire.FUSE_PASSTHROUGH_FLAGS2, False),  # the bit means nothing before 7.40
    (31, 0, False),  # no flags2 at all: a 16-byte INIT request
])
def test_passthrough_is_offered_only_by_protocol_740_with_the_flag(minor: int, flags2: int,
                                                                  offered: bool) -> None:
    _edited, offer = wire.edit_init_request(init_request(minor, flags2=flags2))
    assert offer.passthrough is offered


def test_an_unknown_protocol_major_or_a_short_init_is_refused() -> None:
    with pytest.raises(wire.WireError, match="protocol 8"):
        wire.edit_init_request(request(wire.Opcode.INIT, struct.pack("<IIII", 8, 0, 0, 0)))
    with pytest.raises(wire.WireError, match="INIT request"):
        wire.edit_init_request(request(wire.Opcode.INIT, b"\7\0\0\0"))


def test_init_reply_turns_passthrough_on_with_a_stack_depth() -> None:
    offer = wire.InitOffer(minor=40, passthrough=True, max_pages=True)
    edited, on = wire.edit_init_reply(init_reply(), offer, payload=PAYLOAD_4K, page_size=4096)
    out = wire.init_out(edited)
    assert on
    assert out.flags & wire.FUSE_INIT_EXT and out.flags2 & wire.FUSE_PASSTHROUGH_FLAGS2
    assert out.max_stack_depth == wire.MAX_STACK_DEPTH == 1
    assert (out.max_write, out.max_pages) == (1 << 20, 256)  # 4 KiB pages: as libfuse said
    assert len(edited) == len(init_reply()) and edited[56:] == init_reply()[56:]


def test_the_kernel_is_told_the_daemon_handles_killpriv_where_it_offers_to_be() -> None:
    """Without FUSE_HANDLE_KILLPRIV_V2 the kernel asks the daemon for security.capability
    before every write() (a round trip per 1 MiB written); the mount is nosuid, so the bits
    that asks about have no effect there."""
    flags = wire.FUSE_MAX_PAGES | wire.FUSE_HANDLE_KILLPRIV_V2
    _edited, offer = wire.edit_init_request(init_request(flags=flags))
    assert offer.killpriv_v2
    edited, _on = wire.edit_init_reply(init_reply(), offer, payload=PAYLOAD_4K, page_size=4096)
    assert wire.init_out(edited).flags & wire.FUSE_HANDLE_KILLPRIV_V2
    _edited, old_kernel = wire.edit_init_request(init_request(flags=wire.FUSE_MAX_PAGES))
    edited, _on = wire.edit_init_reply(init_reply(), old_kernel, payload=PAYLOAD_4K,
                                       page_size=4096)
    assert not wire.init_out(edited).flags & wire.FUSE_HANDLE_KILLPRIV_V2


def test_init_reply_without_the_offer_or_with_writeback_cache_stays_without() -> None:
    plain = init_reply()
    no_offer = wire.InitOffer(minor=39, passthrough=False, max_pages=True)
    edited, on = wire.edit_init_reply(plain, no_offer, payload=PAYLOAD_4K, page_size=4096)
    assert not on and edited == plain
    offer = wire.InitOffer(minor=40, passthrough=True, max_pages=True)
    cached = init_reply(flags=wire.FUSE_WRITEBACK_CACHE)
    edited, on = wire.edit_init_reply(cached, offer, payload=PAYLOAD_4K, page_size=4096)
    assert not on and edited == cached


def test_init_reply_with_64k_pages_is_clamped_to_the_relay_buffers() -> None:
    """libfuse on a 64 KiB-page kernel asks for 16 MiB writes in 256 pages; the relay holds
    2 MiB (32 pages: what a kernel without max_pages would send anyway)."""
    page = 64 << 10
    payload = wire.relay_payload(page)
    assert payload == 2 << 20
    offer = wire.InitOffer(minor=40, passthrough=True, max_pages=True)
    edited, on = wire.edit_init_reply(init_reply(max_write=16 << 20, max_pages=256), offer,
                                      payload=payload, page_size=page)
    out = wire.init_out(edited)
    assert on and (out.max_write, out.max_pages) == (payload, 32)
    assert wire.relay_buffer(payload) >= (wire.IN_HEADER.size + wire.WRITE_IN_SIZE
                                          + out.max_write)


@pytest.mark.parametrize("create", [False, True], ids=["open", "create"])
def test_open_reply_of_an_offered_handle_passes_through(create: bool) -> None:
    opcode = wire.Opcode.CREATE if create else wire.Opcode.OPEN
    message = open_reply(42, wire.FOPEN_DIRECT_IO | (1 << 1), create=create)  # KEEP_CACHE
    edited = wire.edit_open_reply(opcode, message, {42: 3})
    assert wire.open_out(opcode, edited) == wire.OpenOut(
        42, wire.FOPEN_DIRECT_IO | wire.FOPEN_PASSTHROUGH, 3)  # KEEP_CACHE dropped
    assert edited[:wire.open_out_offset(opcode)] == message[:wire.open_out_offset(opcode)]
    assert wire.edit_open_reply(opcode, message, {41: 3}) == message  # not offered


@pytest.mark.parametrize("offered", [False, True], ids=["page-cache", "passthrough"])
def test_a_read_only_open_is_spared_its_flushes(offered: bool) -> None:
    message = open_reply(42, wire.FOPEN_DIRECT_IO)
    edited = wire.edit_open_reply(wire.Opcode.OPEN, message, {42: 3} if offered else {},
                                  no_flush={42})
    out = wire.open_out(wire.Opcode.OPEN, edited)
    assert out.open_flags & wire.FOPEN_NOFLUSH
    assert bool(out.open_flags & wire.FOPEN_PASSTHROUGH) == offered
    assert wire.edit_open_reply(wire.Opcode.OPEN, message, {}, no_flush={41}) == message


def test_a_short_open_reply_is_an_error_not_a_guess() -> None:
    with pytest.raises(wire.WireError):
        wire.edit_open_reply(wire.Opcode.CREATE, open_reply(42), {42: 3})


def test_relay_state_edits_only_the_replies_it_waits_for() -> None:
    offers: dict[int, int] = {}
    state = wire.RelayState(offers, payload=PAYLOAD_4K, page_size=4096)
    state.request(init_request(flags2=wire.FUSE_PASSTHROUGH_FLAGS2))
    assert not state.initialized
    state.reply(init_reply())
    assert state.initialized and state.passthrough
    offers[9] = 5
    state.request(request(wire.Opcode.OPEN, bytes(8), unique=20))
    state.request(request(wire.Opcode.OPEN, bytes(8), unique=21))
    failed = reply(b"", unique=21, error=-2)
    assert state.reply(failed) == failed  # an error reply has no fuse_open_out
    edited = state.reply(reply(wire.OPEN_OUT.pack(9, 0, 0), unique=20))
    assert wire.open_out(wire.Opcode.OPEN, edited).backing_id == 5
    again = reply(wire.OPEN_OUT.pack(9, 0, 0), unique=20)
    assert state.reply(again) == again  # answered already: nothing awaited any more
    assert state.awaiting == {}
    read = request(15, bytes(16), unique=22)
    assert state.request(read) == read and state.awaiting == {}  # READ: not awaited


def test_an_init_reply_without_its_request_is_an_error() -> None:
    state = wire.RelayState({}, payload=PAYLOAD_4K, page_size=4096)
    state.awaiting[UNIQUE] = wire.Opcode.INIT
    with pytest.raises(wire.WireError):
        state.reply(init_reply())


def getxattr_request(name: bytes, size: int = 0) -> bytes:
    return request(wire.Opcode.GETXATTR, wire.GETXATTR_IN.pack(size, 0) + name + b"\0")


@pytest.mark.parametrize("name", [b"security.selinux", b"system.posix_acl_access",
                                  b"security.capability", b"trusted.overlay.opaque"])
def test_a_getxattr_outside_user_is_answered_by_the_relay_with_eopnotsupp(name: bytes) -> None:
    """`ls -l` asks for two of these per entry until one says the file system has none; the
    daemon's answer is the same (tierfs keeps only `user.` attributes)."""
    answer = wire.answer_here(getxattr_request(name, size=256))
    assert answer is not None
    assert wire.out_header(answer) == (wire.OUT_HEADER.size, -errno.EOPNOTSUPP, UNIQUE)


@pytest.mark.parametrize("name", [b"user.tierfs.state", b"user.mine", b"user."])
def test_a_getxattr_in_user_and_other_requests_go_to_the_daemon(name: bytes) -> None:
    assert wire.answer_here(getxattr_request(name)) is None
    assert wire.answer_here(init_request()) is None


def test_an_ioctl_is_answered_by_the_relay_with_enotty() -> None:
    """Python's `open()` asks `isatty` (TCGETS) of every file: a round trip per file saved.
    tierfs has no ioctl; the kernel turns libfuse's ENOSYS into ENOTTY all the same."""
    tcgets = 0x5401
    answer = wire.answer_here(request(wire.Opcode.IOCTL, struct.pack("<QIIQII", 1, 0, tcgets,
                                                                         0, 0, 60)))
    assert answer is not None
    assert wire.out_header(answer) == (wire.OUT_HEADER.size, -errno.ENOTTY, UNIQUE)


def test_a_lookup_names_what_it_looks_for_and_is_left_to_the_daemon() -> None:
    """The relay answers a LOOKUP only with the daemon's own verdict (`Operations.lookup_absent`,
    `fs.fuse.passthrough`): `answer_here` never does."""
    lookup = request(wire.Opcode.LOOKUP, b"t00042.distcp\0")
    assert wire.lookup_name(lookup) == b"t00042.distcp"
    assert wire.nodeid_of(lookup) == 1
    assert wire.answer_here(lookup) is None
    assert wire.lookup_name(request(wire.Opcode.LOOKUP, b"\xff" * 255 + b"\0")) == b"\xff" * 255


def test_a_flush_or_release_names_the_handle_it_closes_and_is_left_to_the_daemon() -> None:
    """The relay answers a FLUSH or RELEASE only with the daemon's own
    (`Operations.flush_now`, `release_now`)."""
    flush = request(wire.Opcode.FLUSH, struct.pack("<QIIQ", 1 << 40 | 5, 0, 0, 99))
    assert wire.flush_fh(flush) == 1 << 40 | 5
    assert wire.answer_here(flush) is None
    release = request(wire.Opcode.RELEASE, struct.pack("<QIIQ", 6, os.O_WRONLY, 0, 99))
    assert wire.flush_fh(release) == 6
    assert wire.answer_here(release) is None
    with pytest.raises(wire.WireError):
        wire.flush_fh(request(wire.Opcode.FLUSH, b"\0" * 4))


def test_a_fallocate_names_its_handle_range_and_mode() -> None:
    """The relay hands a FALLOCATE to the daemon (`Operations.fallocate_now`), never to
    libfuse, whose ENOSYS would turn fallocate(2) off for the whole mount."""
    message = request(wire.Opcode.FALLOCATE, struct.pack("<QQQII", 7, 1 << 33, 4096, 3, 0))
    assert wire.fallocate_in(message) == wire.FallocateIn(fh=7, offset=1 << 33, length=4096,
                                                          mode=3)
    assert wire.answer_here(message) is None
    with pytest.raises(wire.WireError):
        wire.fallocate_in(request(wire.Opcode.FALLOCATE, b"\0" * 20))


def test_a_lookup_without_its_nul_is_an_error_not_a_guess() -> None:
    with pytest.raises(wire.WireError):
        wire.lookup_name(request(wire.Opcode.LOOKUP, b"name"))


def test_a_getxattr_without_a_name_is_an_error_not_a_guess() -> None:
    with pytest.raises(wire.WireError):
        wire.answer_here(request(wire.Opcode.GETXATTR, wire.GETXATTR_IN.pack(0, 0)))


def test_a_notification_is_told_from_a_reply() -> None:
    """The daemon's invalidations (unique 0, the notification code in `error`) go to the
    kernel from the relay's notice thread; replies to requests do not."""
    inval_entry = wire.OUT_HEADER.pack(wire.OUT_HEADER.size + 16, 3, 0) + bytes(16)
    assert wire.is_notification(inval_entry)
    assert not wire.is_notification(wire.OUT_HEADER.pack(wire.OUT_HEADER.size, 0, 7))


def test_a_getattr_reply_carries_the_attributes_as_fuse_attr_out(tmp_path: Path) -> None:
    """The relay's own GETATTR reply (`attr_reply`) is the kernel's fuse_attr_out, as
    libfuse's `fuse_reply_attr` writes it: every field at its place, the validity split into
    seconds and nanoseconds, times before 1970 too."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    os.utime(path, ns=(-1_500_000_000, 1_700_000_000_123_456_789))
    st = os.stat(path)
    message = wire.attr_reply(UNIQUE, st, 1.25)
    assert wire.out_header(message) == (16 + 104, 0, UNIQUE)
    fields = struct.unpack("<QII QQQ qqq IIIIIIIIII", message[16:])
    assert fields == (1, 250_000_000, 0, st.st_ino, 5000, st.st_blocks,
                      -2, 1_700_000_000, st.st_ctime_ns // 10**9,
                      500_000_000, 123_456_789, st.st_ctime_ns % 10**9,
                      st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_rdev,
                      st.st_blksize, 0)
    assert wire.attr_reply(UNIQUE, st, 0)[16:32] == bytes(16)  # no validity: asked again
    assert wire.error_reply(UNIQUE, errno.ENOENT) == reply(b"", error=-errno.ENOENT)


def test_a_request_tells_its_node() -> None:
    message = wire.IN_HEADER.pack(40, wire.Opcode.GETATTR, UNIQUE, 1234, 0, 0, 1, 0, 0)
    assert (wire.opcode_of(message), wire.unique_of(message), wire.nodeid_of(message)) == (
        wire.Opcode.GETATTR, UNIQUE, 1234)
    with pytest.raises(wire.WireError):
        wire.nodeid_of(message[:20])


def create_request(name: bytes, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                   mode: int = 0o100644, umask: int = 0o022, extension: bytes = b"") -> bytes:
    """A kernel's CREATE request (7.12+): fuse_create_in, the name, any request extensions."""
    return request(wire.Opcode.CREATE,
                   wire.CREATE_IN.pack(flags, mode, umask, 1) + name + b"\0" + extension)


def test_a_create_names_its_file_its_mode_and_umask_and_is_left_to_the_daemon() -> None:
    """The relay answers a CREATE only with the daemon's own making of it
    (`Operations.create_now`, `fs.fuse.passthrough`): `answer_here` never does."""
    message = create_request(b"shard_00042.bin")
    assert wire.create_in(message) == wire.CreateIn(
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o100644, 0o022, 1, b"shard_00042.bin")
    assert wire.nodeid_of(message) == 1
    assert wire.answer_here(message) is None
    # the name ends at its NUL, whatever follows it (extensions, 8-byte aligned)
    assert wire.create_in(create_request(b"a", extension=bytes(16))).name == b"a"
    assert wire.create_in(create_request(b"\xff" * 255)).name == b"\xff" * 255


@pytest.mark.parametrize("body", [b"", bytes(15), wire.CREATE_IN.pack(0, 0o644, 0, 0),
                                  wire.CREATE_IN.pack(0, 0o644, 0, 0) + b"name"],
                         ids=["empty", "short", "no-name", "no-nul"])
def test_a_malformed_create_is_an_error_not_a_guess(body: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.create_in(request(wire.Opcode.CREATE, body))


def test_a_create_reply_is_what_libfuse_writes_for_pyfuse3_then_edited_as_any(
        tmp_path: Path) -> None:
    """The relay's own CREATE reply (`create_reply`) is fuse_entry_out and fuse_open_out as
    libfuse's `fuse_reply_create` writes them for pyfuse3's `FileInfo(fh=...)`: the entry's
    node, generation and validities, the attributes, the handle and no open flags. The relay's
    edits of a CREATE reply (passthrough with its backing id) then apply to it as to one from
    libfuse."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    os.utime(path, ns=(-1_500_000_000, 1_700_000_000_123_456_789))
    entry = pyfuse3.EntryAttributes()
    st = os.stat(path)
    for field in ("st_ino", "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks",
                  "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
        setattr(entry, field, getattr(st, field))
    entry.st_blksize = 4096
    entry.generation = 3
    entry.entry_timeout, entry.attr_timeout = 60.5, 1.25
    message = wire.create_reply(UNIQUE, entry, 42)
    assert wire.out_header(message) == (16 + 128 + 16, 0, UNIQUE)
    fields = struct.unpack("<QQQQII QQQ qqq IIIIIIIIII QIi", message[16:])
    assert fields == (st.st_ino, 3, 60, 1, 500_000_000, 250_000_000,
                      st.st_ino, 5000, st.st_blocks,
                      -2, 1_700_000_000, st.st_ctime_ns // 10**9,
                      500_000_000, 123_456_789, st.st_ctime_ns % 10**9,
                      st.st_mode, st.st_nlink, st.st_uid, st.st_gid, 0, 4096, 0,
                      42, 0, 0)
    assert message[16:16 + 40] == wire.ENTRY_OUT.pack(st.st_ino, 3, 60, 1, 500_000_000,
                                                      250_000_000)[:40]
    # the attributes are those a GETATTR reply carries
    assert message[16 + 40:16 + 128] == wire.attr_reply(UNIQUE, entry, 0)[16 + 16:]
    edited = wire.edit_open_reply(wire.Opcode.CREATE, message, {42: 3})
    assert wire.open_out(wire.Opcode.CREATE, edited) == wire.OpenOut(
        42, wire.FOPEN_PASSTHROUGH, 3)
    assert edited[:16 + 128] == message[:16 + 128]
    assert wire.edit_open_reply(wire.Opcode.CREATE, message, {}) == message  # not offered


def setattr_request(valid: int, *, fh: int = 0, size: int = 0, atime: tuple[int, int] = (0, 0),
                    mtime: tuple[int, int] = (0, 0), mode: int = 0, uid: int = 0,
                    gid: int = 0) -> bytes:
    return request(wire.Opcode.SETATTR, wire.SETATTR_IN.pack(
        valid, 0, fh, size, 0, atime[0], mtime[0], 1, atime[1], mtime[1], 2, mode, 0, uid, gid,
        0))


def test_a_setattr_says_what_it_sets_as_libfuse_tells_pyfuse3() -> None:
    """The relay has the daemon set a mode, an owner or times on its own turn of the loop
    (`Operations.setattr_now`): the fields the request marks valid, as pyfuse3 hands them to
    `setattr` (times in nanoseconds); a size or a field it does not know leaves the request to
    libfuse (None). `answer_here` never answers it."""
    chmod = setattr_request(wire.FATTR_MODE | wire.FATTR_CTIME, mode=0o100640)
    assert wire.setattr_in(chmod, now_ns=7) == wire.SetattrIn(None, 0o100640, None, None,
                                                              None, None)
    assert wire.answer_here(chmod) is None
    chown = setattr_request(wire.FATTR_UID | wire.FATTR_GID | wire.FATTR_FH, fh=9, uid=1001,
                            gid=1002)
    assert wire.setattr_in(chown, now_ns=7) == wire.SetattrIn(9, None, 1001, 1002, None, None)
    utime = setattr_request(wire.FATTR_ATIME | wire.FATTR_MTIME, atime=(5, 6), mtime=(7, 8))
    assert wire.setattr_in(utime, now_ns=7) == wire.SetattrIn(
        None, None, None, None, 5_000_000_006, 7_000_000_008)
    # `touch`: the kernel sends its now with ATIME_NOW and MTIME_NOW, and pyfuse3 keeps it
    touch = setattr_request(wire.FATTR_ATIME | wire.FATTR_MTIME | wire.FATTR_ATIME_NOW
                            | wire.FATTR_MTIME_NOW, atime=(5, 6), mtime=(7, 8))
    assert wire.setattr_in(touch, now_ns=42) == wire.SetattrIn(
        None, None, None, None, 5_000_000_006, 7_000_000_008)
    now_alone = setattr_request(wire.FATTR_ATIME_NOW | wire.FATTR_MTIME_NOW)
    assert wire.setattr_in(now_alone, now_ns=42) == wire.SetattrIn(None, None, None, None,
                                                                   42, 42)
    # every chown of a file comes with FATTR_KILL_SUIDGID: read as libfuse and pyfuse3 read it
    chown_file = setattr_request(wire.FATTR_UID | wire.FATTR_KILL_SUIDGID, uid=1001)
    assert wire.setattr_in(chown_file, now_ns=7) == wire.SetattrIn(None, None, 1001, None,
                                                                   None, None)
    for valid in (wire.FATTR_SIZE, wire.FATTR_SIZE | wire.FATTR_KILL_SUIDGID,
                  wire.FATTR_MODE | wire.FATTR_KILL_SUIDGID, 1 << 20):
        assert wire.setattr_in(setattr_request(valid), now_ns=7) is None
    with pytest.raises(wire.WireError):
        wire.setattr_in(request(wire.Opcode.SETATTR, bytes(80)), now_ns=7)
