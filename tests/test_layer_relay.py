"""The passthrough relay (tierfs.fs.fuse.passthrough) with the test as libfuse: a real /dev/fuse
mount whose library end this test answers. A reply the relay cannot pass on aborts the
connection, so the process waiting on the mount gets ENOTCONN instead of hanging."""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path

import pytest
import trio

from tierfs.fs.fuse import fuse_wire as wire
from tierfs.fs.fuse.passthrough import MESSAGE_MAX, PassthroughDevice, PassthroughUnavailable

pytestmark = pytest.mark.core


@pytest.fixture
def relay(tmp_path: Path):  # type: ignore[no-untyped-def]
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    try:
        device = PassthroughDevice(str(mountpoint), [], source="tierfs-relay-test")
    except PassthroughUnavailable as exc:
        pytest.skip(f"cannot mount /dev/fuse here: {exc}")
    ended = threading.Event()
    # The relay runs on a trio loop (the daemon's); here, on one of its own in a thread, while
    # the test answers as libfuse.
    loop = threading.Thread(target=trio.run, args=(device.run, ended.set), daemon=True)
    loop.start()
    library = socket.socket(fileno=int(device.library_mountpoint.rsplit("/", 1)[1]))
    try:
        yield device, library, mountpoint, ended
    finally:
        library.close()
        device.stop()
        loop.join(timeout=20)
        device.close()
        assert not loop.is_alive(), "the relay did not end"


def stat_in_thread(path: Path) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def stat() -> None:
        try:
            os.stat(path)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            errors.append(exc)

    thread = threading.Thread(target=stat, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("bad_reply", ["short INIT reply", "reply longer than the relay"])
def test_a_reply_the_relay_cannot_pass_on_aborts_the_connection(relay, bad_reply: str,
                                                               caplog) -> None:  # type: ignore[no-untyped-def]
    device, library, mountpoint, ended = relay
    thread, errors = stat_in_thread(mountpoint)  # waits for INIT
    library.settimeout(10)
    init = library.recv(MESSAGE_MAX)
    header = wire.in_header(init)
    assert header.opcode == wire.Opcode.INIT
    assert not wire.init_in(init).flags & wire.FUSE_SPLICE_FLAGS  # the relay's edit
    body = b"\7\0\0\0" if bad_reply == "short INIT reply" else bytes(MESSAGE_MAX)
    library.sendall(wire.OUT_HEADER.pack(16 + len(body), 0, header.unique) + body)
    thread.join(timeout=20)
    assert not thread.is_alive(), "the process on the mount still waits"
    assert len(errors) == 1 and isinstance(errors[0], OSError)
    assert errors[0].errno == errno.ENOTCONN
    assert ended.wait(20)  # the request relay saw the connection end
    assert "aborting the connection" in caplog.text
