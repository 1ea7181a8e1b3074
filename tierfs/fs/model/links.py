"""Symbolic links as committed state: a link outside any step directory whose target is
relative and stays inside the mount (Lightning's `last.ckpt` -> `epoch=0-step=5.ckpt` with
`save_last="link"`) is kept in the persistent tier as part of its directory's state, one small
object per directory (`<dir>/.tierfs-links`: name -> target), rewritten whenever a link there
changes, and made again on a node that mounts the same store with an empty RAM dir. Other links
(absolute, pointing out of the mount, or inside a step directory) live in this node's RAM dir
only; `tierfs status` names them.

In a cluster the same links are kept in etcd, so that every node shows them and a node that
replaces a lost one finds them without a store (`replication.coordination.shared_links`).

The tree notes which directories changed (`LinkChanges`); the daemon's workers write their
objects, and their etcd keys, retrying while the store or etcd cannot."""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Awaitable, Callable

import msgpack
import trio

from tierfs import reserved
from tierfs.msgpack_map import decode_map
from tierfs.retry import POLICY

log = logging.getLogger(__name__)

LINKS_OBJECT = reserved.LINKS
FORMAT = 1
MAX_LINKS = 100_000


def stays_inside(link_path: str, target: str) -> bool:
    """Whether `target`, the target of the link at `link_path` (relative to the mount), is
    relative and names something inside the mount."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(link_path), target))
    return joined not in (".", "..") and not joined.startswith("../")


def encode(links: dict[str, str], writer: str | None = None) -> bytes:
    """A directory's links as an object; `writer`: the node whose mount made them (the
    cluster's copy, in etcd)."""
    raw: dict[str, object] = {"format": FORMAT, "links": links}
    if writer is not None:
        raw["writer"] = writer
    return msgpack.packb(raw, use_bin_type=True)


def decode(directory: str, data: bytes) -> dict[str, str]:
    """The links of a directory's object; ValueError if it is malformed or a link would
    point out of the mount."""
    return decode_written(directory, data)[1]


def decode_written(directory: str, data: bytes) -> tuple[str | None, dict[str, str]]:
    """The writer (None: not said) and the links of a directory's object; ValueError as
    `decode`."""
    raw = decode_map(data, ValueError, "links object", kind=FORMAT, max_map_len=MAX_LINKS)
    writer = raw.get("writer")
    if writer is not None and not isinstance(writer, str):
        raise ValueError("bad writer of a links object")
    if not isinstance(raw.get("links"), dict):
        raise ValueError("unknown links object format")
    links = raw["links"]
    for name, target in links.items():
        if not (isinstance(name, str) and isinstance(target, str)) or not name or "/" in name \
                or name in (".", "..") or name.startswith(reserved.PREFIX) or \
                not stays_inside(posixpath.join(directory, name), target):
            raise ValueError(f"bad link {name!r}")
    return writer, links


class LinkChanges:
    """The directories (relative to the mount, "" the top) whose links changed, told to each
    of their followers (the store's writer, the cluster's)."""

    def __init__(self) -> None:
        self._queues: list[LinkQueue] = []

    def note(self, directory: str) -> None:
        for queue in self._queues:
            queue.note(directory)

    def follow(self) -> LinkQueue:
        """A queue of the changes from now on (taken before the mount answers anyone)."""
        queue = LinkQueue()
        self._queues.append(queue)
        return queue


class LinkQueue:
    """The directories whose links changed since one follower last wrote them."""

    def __init__(self) -> None:
        self.dirs: set[str] = set()
        self.changed = trio.Event()

    def note(self, directory: str) -> None:
        self.dirs.add(directory)
        self.changed.set()
        self.changed = trio.Event()

    def take(self) -> set[str]:
        taken, self.dirs = self.dirs, set()
        return taken

    async def write_each(self, write: Callable[[str], Awaitable[None]],
                         failure: type[Exception], where: str) -> None:
        """`write` the links of each directory noted, until cancelled; one that fails with
        `failure` (`where` cannot take it) is written again after the one retry policy's
        pause (`tierfs.retry.POLICY`)."""
        failures = 0
        while True:
            changed = self.changed
            for directory in sorted(self.take()):
                try:
                    await write(directory)
                    failures = 0
                except failure as exc:
                    failures += 1
                    log.log(POLICY.level(failures), "the links of %s could not reach %s yet: %s",
                            directory or ".", where, exc)
                    self.dirs.add(directory)  # again after the pause
            if self.dirs:
                with trio.move_on_after(POLICY.delay(failures)):
                    await self.changed.wait()
            else:
                await changed.wait()
