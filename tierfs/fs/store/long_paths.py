"""Paths into the RAM store that may be longer than PATH_MAX.

The RAM store's path comes before every path under the mount, so a user's path close to PATH_MAX
is longer than that inside the store, and a tree reached by relative paths (`cd deep; mkdir
more`) can be deeper than PATH_MAX altogether. The kernel refuses such paths in one system call,
but not a path that starts at an open directory: `/proc/self/fd/N/rest` walks from descriptor N.
So a long path is cut at a directory held open (O_PATH), and only the rest is spelled out.
"""

from __future__ import annotations

import os

# Paths up to this length are used as they are; longer ones start at an open directory. Well
# below PATH_MAX (4096), so that a name of up to NAME_MAX can still be joined to the result.
LONG_PATH = 2048


def anchor_path(fd: int) -> bytes:
    """The path of the directory open as `fd`, which any path may continue."""
    return b"/proc/self/fd/%d" % fd


class PathReach:
    """Turns absolute paths of any length into ones the kernel accepts, keeping a descriptor
    of each directory it cut at until `close` (for start-up, while the tree does not move)."""

    def __init__(self) -> None:
        self._anchors: dict[bytes, int] = {}

    def __call__(self, path: bytes) -> bytes:
        if len(path) <= LONG_PATH:
            return path
        cut = path.rfind(b"/", 0, LONG_PATH)
        head, rest = path[:cut], path[cut + 1:]
        fd = self._anchors.get(head)
        if fd is None:
            fd = self._anchors[head] = os.open(head, os.O_PATH | os.O_DIRECTORY)
        return self(anchor_path(fd) + b"/" + rest)

    def close(self) -> None:
        for fd in self._anchors.values():
            os.close(fd)
        self._anchors.clear()
