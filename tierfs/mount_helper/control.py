"""The daemon's control socket: one JSON request and one JSON reply per connection.

The socket lives in the RAM dir (mode 0600); a client finds it from any path under a mount
through the `user.tierfs.control` extended attribute, so `tierfs status|commit` need nothing but
a path. Requests are `{"cmd": ..., ...}`; replies `{"ok": true, ...}` or
`{"ok": false, "error": "one line"}`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20
XATTR_CONTROL = "user.tierfs.control"
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(Exception):
    """The daemon could not be reached or refused the request; the text is for the user."""


async def serve(path: str, handler: Handler,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    if os.path.exists(path):
        os.unlink(path)  # left by a daemon that was killed; we hold the RAM dir lock
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()
    await trio.serve_listeners(lambda stream: _answer(stream, handler), [listener])


async def _answer(stream: trio.SocketStream, handler: Handler) -> None:
    async with stream:
        try:
            with trio.fail_after(10):
                request = await _read_message(stream)
        except (trio.TooSlowError, ValueError, trio.BrokenResourceError) as exc:
            log.warning("control request dropped: %s", exc)
            return
        try:
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
            timeout: float | None = 30) -> dict[str, Any]:
    """Send one request to a daemon and return its reply (blocking, for the command line)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            sock.sendall(json.dumps(message).encode() + b"\n")
            data = bytearray()
            while chunk := sock.recv(65536):
                data += chunk
    except TimeoutError:
        raise ControlError("the tierfs daemon did not answer in time") from None
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


def locate(path: str) -> tuple[str, str, str]:
    """(control socket, mount root, path relative to the root) for any path under a mount."""
    real = os.path.realpath(path)
    if not os.path.exists(real):
        raise ControlError(f"{path}: no such file or directory")
    try:
        socket_path = os.getxattr(real, XATTR_CONTROL).decode()
    except OSError:
        raise ControlError(f"{path} is not on a tierfs mount") from None
    root = real
    while not os.path.ismount(root):
        root = os.path.dirname(root)
    return socket_path, root, os.path.relpath(real, root)
