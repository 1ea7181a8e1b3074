"""The links the store keeps (`fs.model.links`), kept current: each directory whose links
changed is written again, and every directory holding links once after a start; retried with
the one retry policy (`tierfs.retry.POLICY`) while the store cannot take them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tierfs.fs.model.links import LinkQueue
from tierfs.s3tier.interface import BackendError
from tierfs.s3tier.uploader import Uploader


async def store_links(changes: LinkQueue, link_dirs: Callable[[], Iterable[str]],
                      links_of: Callable[[str], dict[str, str]], uploader: Uploader) -> None:
    """The store learns the links of each directory `changes` notes (and of each of
    `link_dirs()`, the directories holding links at the start), as `links_of` tells them."""
    for directory in link_dirs():
        changes.note(directory)

    async def write(directory: str) -> None:
        await uploader.put_links(directory, links_of(directory))

    await changes.write_each(write, BackendError, "the store")
