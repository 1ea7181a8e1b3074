"""The links the store keeps (`fs.model.links`), kept current: each directory whose links
changed is written again, and every directory holding links once after a start; retried with
the one retry policy (`tierfs.retry.POLICY`) while the store cannot take them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from tierfs.fs.model.links import LinkQueue
from tierfs.retry import POLICY
from tierfs.s3tier.interface import BackendError
from tierfs.s3tier.uploader import Uploader

log = logging.getLogger(__name__)


async def store_links(changes: LinkQueue, link_dirs: Callable[[], Iterable[str]],
                      links_of: Callable[[str], dict[str, str]], uploader: Uploader) -> None:
    """The store learns the links of each directory `changes` notes (and of each of
    `link_dirs()`, the directories holding links at the start), as `links_of` tells them."""
    for directory in link_dirs():
        changes.note(directory)
    failures = 0
    while True:
        changed = changes.changed
        for directory in sorted(changes.take()):
            try:
                await uploader.put_links(directory, links_of(directory))
                failures = 0
            except BackendError as exc:
                failures += 1
                log.log(POLICY.level(failures), "the links of %s could not be stored yet: %s",
                        directory or ".", exc)
                changes.dirs.add(directory)  # again after the pause
        if changes.dirs:
            with trio.move_on_after(POLICY.delay(failures)):
                await changes.changed.wait()
        else:
            await changed.wait()
