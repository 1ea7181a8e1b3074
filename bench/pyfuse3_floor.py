"""The Python FUSE floor of the bench's many-file rows: a file system on pyfuse3 and trio, as
tierfs's daemon is, that keeps files in memory and does nothing else (the counterpart of
`fuse_floor.c`, with the same operations and mount options). What a file costs it is what
pyfuse3's dispatch and trio's loop cost per round trip: no daemon built on them can do better.

    python bench/pyfuse3_floor.py MOUNTPOINT    # serves until unmounted (fusermount3 -u)
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
from typing import Any

import pyfuse3
import trio
from pyfuse3 import EntryAttributes, FileInfo, FUSEError


class Node:
    __slots__ = ("children", "data", "mode", "name", "parent")

    def __init__(self, parent: int, name: bytes, mode: int) -> None:
        self.parent, self.name, self.mode = parent, name, mode
        self.data = bytearray()
        self.children: dict[bytes, int] = {}


class Floor(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        self.nodes = {pyfuse3.ROOT_INODE: Node(0, b"", stat.S_IFDIR | 0o755)}
        self.next_ino = pyfuse3.ROOT_INODE + 1

    def _attrs(self, ino: int) -> EntryAttributes:
        node = self.nodes[ino]
        attrs = EntryAttributes()
        attrs.st_ino, attrs.st_mode, attrs.st_nlink = ino, node.mode, 1
        attrs.st_size = len(node.data)
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = time.time_ns()
        attrs.entry_timeout = attrs.attr_timeout = 1.0  # as fuse_floor.c's
        return attrs

    def _add(self, parent: int, name: bytes, mode: int) -> int:
        ino = self.next_ino
        self.next_ino += 1
        self.nodes[ino] = Node(parent, name, mode)
        self.nodes[parent].children[name] = ino
        return ino

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> EntryAttributes:
        ino = self.nodes[parent_inode].children.get(name)
        if ino is None:
            raise FUSEError(errno.ENOENT)
        return self._attrs(ino)

    async def getattr(self, inode: int, ctx: Any) -> EntryAttributes:
        return self._attrs(inode)

    async def setattr(self, inode: int, attr: EntryAttributes, fields: Any, fh: int | None,
                      ctx: Any) -> EntryAttributes:
        if fields.update_size:
            del self.nodes[inode].data[attr.st_size:]
        return self._attrs(inode)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> EntryAttributes:
        return self._attrs(self._add(parent_inode, name, stat.S_IFDIR | (mode & 0o7777)))

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[FileInfo, EntryAttributes]:
        ino = self.nodes[parent_inode].children.get(name)
        if ino is None:
            ino = self._add(parent_inode, name, stat.S_IFREG | (mode & 0o7777))
        return FileInfo(fh=ino), self._attrs(ino)

    async def open(self, inode: int, flags: int, ctx: Any) -> FileInfo:
        if flags & os.O_TRUNC:
            self.nodes[inode].data.clear()
        return FileInfo(fh=inode)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return bytes(self.nodes[fh].data[off:off + size])

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        data = self.nodes[fh].data
        if len(data) < off:
            data.extend(bytes(off - len(data)))
        data[off:off + len(buf)] = buf
        return len(buf)

    async def flush(self, fh: int) -> None:
        return None

    async def release(self, fh: int) -> None:
        return None

    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        # Offsets are inode numbers, as fuse_floor.c's: entry `ino` is followed by those after.
        for name, ino in self.nodes[fh].children.items():
            if ino > start_id and not pyfuse3.readdir_reply(token, name, self._attrs(ino), ino):
                break

    async def releasedir(self, fh: int) -> None:
        return None


def main() -> None:
    pyfuse3.init(Floor(), sys.argv[1], {"fsname=pyfuse3_floor"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)


if __name__ == "__main__":
    main()
