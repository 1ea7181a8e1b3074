"""The daemon's control socket: one JSON request and one JSON reply per connection.

The socket lives in the RAM dir (mode 0600); a client finds it from any path under a mount
through the `user.tierfs.control` extended attribute, so `tierfs status|commit` need nothing but
a path. Requests are `{"cmd": ..., ...}`; replies `{"ok": true, ...}` or
`{"ok": false, "error": "one line"}`.

With --allow-other the users of the mount must reach it too, but the RAM dir stays private (it
holds the committed objects): the socket is then an abstract one, its name starting with "@"
(`@tierfs-control:<ram dir>`), and the daemon asks the kernel who is calling (SO_PEERCRED).
Anyone may ask what only reads (`status`, which `tierfs flush` polls); `commit` (and
`commit_waits`, what a commit in progress waits for, which `tierfs commit` polls), `prefetch`,
`verify` (which repairs) and `settle` (commit the quiet steps, before an unmount) are for root,
the daemon's user and the owner given to the mount root.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierfs.mount_helper.mounts import (
    PATIENCE,
    TIERFS_TYPE,
    dead_mount_hint,
    describe_daemon,
    enclosing_mount,
    ram_dir_of,
    with_patience,
)

if TYPE_CHECKING:  # the server side's; the client side (the command line) runs without trio
    import trio

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20
REQUEST_PATIENCE = 10.0  # seconds the command line waits for a reply to a quick request
XATTR_CONTROL = "user.tierfs.control"
ABSTRACT = "@"  # how an abstract socket name is written (in the xattr, in messages)
READ_ONLY = frozenset({"status"})  # what every user who reaches the socket may ask
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(Exception):
    """The daemon could not be reached or refused the request; the text is for the user."""


def _address(path: str) -> str:
    """What bind/connect take: an abstract name starts with a NUL byte."""
    return "\0" + path[len(ABSTRACT):] if path.startswith(ABSTRACT) else path


def remove(path: str) -> None:
    """Remove a socket file left behind (an abstract name goes with its socket)."""
    if not path.startswith(ABSTRACT):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def serve(path: str, handler: Handler, trusted: frozenset[int] = frozenset({0}),
                task_status: trio.TaskStatus[None] | None = None) -> None:
    """Answer requests on `path`; users not in `trusted` (uids) may only ask READ_ONLY ones."""
    import trio  # here: the command line imports this module, and must not import trio

    remove(path)  # left by a daemon that was killed; we hold the RAM dir lock
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(_address(path))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"control socket {path}: {exc.strerror}") from None
    if not path.startswith(ABSTRACT):
        os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    if task_status is not None:
        task_status.started()
    await trio.serve_listeners(lambda stream: _answer(stream, handler, trusted), [listener])


def _caller_uid(stream: trio.SocketStream) -> int:
    _pid, uid, _gid = PEERCRED.unpack(
        stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return uid


async def _answer(stream: trio.SocketStream, handler: Handler, trusted: frozenset[int]) -> None:
    import trio

    async with stream:
        try:
            with trio.fail_after(10):
                request = await _read_message(stream)
        except (trio.TooSlowError, ValueError, trio.BrokenResourceError) as exc:
            log.warning("control request dropped: %s", exc)
            return
        uid = _caller_uid(stream)
        try:
            if request.get("cmd") not in READ_ONLY and uid not in trusted:
                reply = {"ok": False, "error": f"{request.get('cmd')}: permission denied (only "
                         "root, the daemon's user and the owner of the mount root may; "
                         "others may ask for status)"}
            else:
                reply = await handler(request)
        except Exception as exc:
            log.exception("control request %r failed", request.get("cmd"))
            reply = {"ok": False, "error": f"internal error: {exc}"}
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(json.dumps(reply).encode() + b"\n")


async def _read_message(stream: trio.SocketStream) -> dict[str, Any]:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_MESSAGE:
            raise ValueError("request too large")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("request is not an object")
    return message


def request(socket_path: str, message: dict[str, Any],
            timeout: float | None = REQUEST_PATIENCE) -> dict[str, Any]:
    """Send one request to a daemon and return its reply (blocking, for the command line)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(_address(socket_path))
            sock.sendall(json.dumps(message).encode() + b"\n")
            data = bytearray()
            while chunk := sock.recv(65536):
                data += chunk
    except TimeoutError:
        raise ControlError(f"the tierfs daemon did not answer in {timeout:g} s: "
                           f"{describe_daemon(_ram_dir_of_socket(socket_path))}") from None
    except OSError as exc:
        raise ControlError(f"cannot reach the tierfs daemon at {socket_path}: "
                           f"{exc.strerror or exc}") from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise ControlError("the tierfs daemon sent an unreadable reply") from None
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "request refused"))
    return reply


def _ram_dir_of_socket(socket_path: str) -> Path | None:
    """The RAM dir a socket belongs to: its directory, or named by an abstract name."""
    if not socket_path.startswith(ABSTRACT):
        return Path(socket_path).parent
    _prefix, _, ram_dir = socket_path.partition(":")
    return Path(ram_dir) if ram_dir.startswith("/") else None


def locate(path: str) -> tuple[str, str, str]:
    """(control socket, mount root, path relative to the root) for any path under a mount.

    Finding them touches the mount (stat, getxattr), which blocks while its daemon is stopped:
    after PATIENCE seconds the mount table and the daemon's state say what is wrong instead."""
    try:
        return with_patience(lambda: _locate(path))
    except TimeoutError:
        entry = enclosing_mount(path)
        if entry is None or entry.fstype != TIERFS_TYPE:
            raise ControlError(f"{path} does not answer (waited {PATIENCE:g} s)") from None
        raise ControlError(f"the tierfs mount {entry.mountpoint} does not answer (waited "
                           f"{PATIENCE:g} s): {describe_daemon(ram_dir_of(entry))}") from None


def _locate(path: str) -> tuple[str, str, str]:
    real = os.path.realpath(path)
    try:
        os.stat(real)
        socket_path = os.getxattr(real, XATTR_CONTROL).decode()
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise ControlError(dead_mount_message(real)) from None
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            raise ControlError(f"{path} is not on a tierfs mount") from None
        raise ControlError(f"{path}: {(exc.strerror or str(exc)).lower()}") from None
    entry = enclosing_mount(real)
    root = entry.mountpoint if entry is not None else "/"
    return socket_path, root, os.path.relpath(real, root)


def dead_mount_message(path: str) -> str:
    """One line for a path on a mount whose daemon died (ENOTCONN)."""
    entry = enclosing_mount(path)
    where = entry.mountpoint if entry is not None else path
    ram_dir = ram_dir_of(entry) if entry is not None else None
    return (f"the tierfs mount {where} is dead ({describe_daemon(ram_dir)}): "
            f"{dead_mount_hint(where)}")
