"""Facts about mount points, read from /proc so that nothing stats a possibly hung FUSE mount."""

from __future__ import annotations

import os


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def mount_table() -> list[tuple[str, str]]:
    """(mount point, file system type) for every mount this process sees."""
    table = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            table.append((_unescape(left.split()[4]), right.split()[0]))
    return table


def is_mounted(path: str | os.PathLike[str]) -> bool:
    target = os.path.abspath(path)
    return any(mountpoint == target for mountpoint, _ in mount_table())


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """Type of the file system holding `path` (the longest mount point that contains it)."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    for mountpoint, fstype in mount_table():
        inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) >= len(best):
            best, best_type = mountpoint, fstype
    return best_type
