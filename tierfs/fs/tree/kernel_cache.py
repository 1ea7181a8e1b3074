"""What the kernel may keep of the daemon's answers, and telling it when that changes.

The kernel keeps each name it looked up (its dentry) and each file's attributes for the timeouts
the daemon gives with them; within them it answers `stat`, and finds a path's files, without a
round trip. A step of 10,000 files read back after a listing costs a LOOKUP per file once the
listing's entries expire, and `ls -l` run again a GETATTR per file. So entries and attributes
that only change in ways the daemon sees get a long timeout (`SETTLED_TIMEOUT`), and the daemon
tells the kernel (FUSE_NOTIFY_INVAL_ENTRY, FUSE_NOTIFY_INVAL_INODE) when it changes them itself.

Two kinds of change reach a cached answer:

* Those the kernel made: a create, write, truncate, chmod, rename or unlink through this mount.
  The kernel updates or drops what it keeps by itself (a passthrough write updates the size
  and marks size and times stale; the reply to a SETATTR carries the new attributes).
* Those the daemon makes on its own: a step version committed, renamed or deleted by a peer,
  files of a step replaced by a newer version, directories made for a
  step that arrived. The tree reports each (`Tree.attach`, `Tree.detach`,
  `Tree.attrs_changed`) to `KernelCache`, which invalidates the entry or the attributes in the
  kernel, unless the change is the kernel's own (`kernel_knows`, around the tree's handling of
  a request) or the kernel holds nothing of it (a node it never looked up).

A file being written keeps the short timeout (`CHANGING_TIMEOUT`): its size and times are its
writer's, through the kernel. Notifications go from a thread of their own, in order: the kernel
handles an entry's by taking its directory's lock, which a request in that directory holds until
the daemon answers it, so the daemon's loop must never wait for one (see also the relay's
notice thread, `fs.fuse.passthrough`). What a user may see stale, and for how long: doc/SEMANTICS.md
("What the kernel keeps")."""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pyfuse3

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import Node


log = logging.getLogger(__name__)

SETTLED_TIMEOUT = 60.0  # seconds the kernel keeps a settled entry and its attributes
CHANGING_TIMEOUT = 1.0  # a file being written, as every entry had before issue 49

ROOT = pyfuse3.ROOT_INODE


def timeout_for(node: Node) -> float:
    """How long the kernel may keep `node`'s entry and attributes (see the module docstring)."""
    if node.virtual:
        return 0.0  # `latest`: resolved per process (fs.tree.virtual_latest)
    if node.is_file and (node.active_writers or any(h.writable for h in node.handles)):
        return CHANGING_TIMEOUT
    return SETTLED_TIMEOUT


class KernelCache:
    """The tree's changes the kernel cannot see, sent to it as invalidations (see the module
    docstring). Until `start` (and in tests without a mount) it only counts them."""

    def __init__(self) -> None:
        self._kernel_request = 0  # > 0 while the tree handles a change the kernel made
        self._entries: dict[tuple[int, bytes], None] = {}  # (parent ino, name), in order
        self._inodes: dict[int, None] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._send_entry: Callable[[int, bytes], None] = _invalidate_entry
        self._send_inode: Callable[[int], None] = _invalidate_attrs
        self.sent = 0  # invalidations given to the kernel (tests, status)

    # -- what the tree reports (the daemon's loop) ------------------------------------------

    @contextlib.contextmanager
    def kernel_knows(self) -> Iterator[None]:
        """The tree changes as a request of the kernel says: the kernel knows already."""
        self._kernel_request += 1
        try:
            yield
        finally:
            self._kernel_request -= 1

    def entry_gone(self, parent: Node, name: bytes, node: Node) -> None:
        """`name` in `parent` no longer leads to `node`."""
        if self._kernel_request:
            return
        if node.lookups:
            self._queue_entry(parent.ino, name)
        self._parent_changed(parent)

    def entry_added(self, parent: Node) -> None:
        """A new name in `parent` (no negative entry is ever cached: only its attributes)."""
        if not self._kernel_request:
            self._parent_changed(parent)

    def attrs_changed(self, node: Node) -> None:
        """`node`'s attributes (its size, mode, owner or times) are not what they were."""
        if not self._kernel_request and (node.lookups or node.ino == ROOT):
            self._queue_inode(node.ino)

    def _parent_changed(self, parent: Node) -> None:
        if parent.lookups or parent.ino == ROOT:
            self._queue_inode(parent.ino)  # its times and link count

    def _queue_entry(self, parent_ino: int, name: bytes) -> None:
        with self._lock:
            self._entries[(parent_ino, name)] = None
        self._wake.set()

    def _queue_inode(self, ino: int) -> None:
        with self._lock:
            self._inodes[ino] = None
        self._wake.set()

    # -- sending (a thread of its own) --------------------------------------------------------

    def start(self) -> None:
        """Send from now on (after pyfuse3.init: the session exists)."""
        self._thread = threading.Thread(target=self._run, name="kernel-cache", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping:
                return
            with self._lock:
                self._wake.clear()
                entries, self._entries = self._entries, {}
                inodes, self._inodes = self._inodes, {}
            for parent_ino, name in entries:
                self._send(self._send_entry, parent_ino, name)
            for ino in inodes:
                self._send(self._send_inode, ino)

    def _send(self, send: Callable[..., None], *args: object) -> None:
        try:
            send(*args)
            self.sent += 1
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTCONN, errno.ENODEV):
                log.warning("the kernel was not told of a change (%r): %s", args, exc)


def _invalidate_entry(parent_ino: int, name: bytes) -> None:
    pyfuse3.invalidate_entry(parent_ino, name)


def _invalidate_attrs(ino: int) -> None:
    pyfuse3.invalidate_inode(ino, attr_only=True)
