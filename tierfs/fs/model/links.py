"""Symbolic links as committed state: a link outside any step directory whose target is
relative and stays inside the mount (Lightning's `last.ckpt` -> `epoch=0-step=5.ckpt` with
`save_last="link"`) is kept in the persistent tier as part of its directory's state, one small
object per directory (`<dir>/.tierfs-links`: name -> target), rewritten whenever a link there
changes, and made again on a node that mounts the same store with an empty RAM dir. Other links
(absolute, pointing out of the mount, or inside a step directory) live in this node's RAM dir
only; `tierfs status` names them.

The tree notes which directories changed (`LinkChanges`); the daemon's worker writes their
objects, retrying while the store cannot."""

from __future__ import annotations

import posixpath

import msgpack
import trio

from tierfs import reserved
from tierfs.msgpack_map import decode_map

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


def encode(links: dict[str, str]) -> bytes:
    return msgpack.packb({"format": FORMAT, "links": links}, use_bin_type=True)


def decode(directory: str, data: bytes) -> dict[str, str]:
    """The links of a directory's object; ValueError if it is malformed or a link would
    point out of the mount."""
    raw = decode_map(data, ValueError, "links object", kind=FORMAT, max_map_len=MAX_LINKS)
    if not isinstance(raw.get("links"), dict):
        raise ValueError("unknown links object format")
    links = raw["links"]
    for name, target in links.items():
        if not (isinstance(name, str) and isinstance(target, str)) or not name or "/" in name \
                or name in (".", "..") or name.startswith(reserved.PREFIX) or \
                not stays_inside(posixpath.join(directory, name), target):
            raise ValueError(f"bad link {name!r}")
    return links


class LinkChanges:
    """The directories (relative to the mount, "" the top) whose links changed since their
    objects were last written."""

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
