"""A step's packs going to the store (`tierfs.s3tier.packs`: its small files' bytes in a few
objects, for read-backs), for the uploader, after the step's files and before its manifest:
built from the files in RAM here, or, for a step renamed while its files were only in the store,
copied inside the store from its old name's packs."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from tierfs import layout, reserved
from tierfs import manifest as mf
from tierfs.s3tier import packs
from tierfs.s3tier.interface import Backend, NotFound

log = logging.getLogger(__name__)

# call(what, func, *args): func(*args) in a worker thread, for the version being uploaded,
# retried by the uploader's policy while that version is wanted.
Call = Callable[..., Awaitable[Any]]


class PackedSteps(Protocol):
    """The file system's side: where a committed file's bytes are, which names a renamed file
    had in the store, and whether a step was written on one node."""

    def object_path(self, xxh3: str) -> str: ...

    def copy_sources(self, key: str) -> list[tuple[str, str]]: ...

    def single_writer(self, manifest: mf.StepManifest) -> bool: ...


class PackUploads:
    def __init__(self, backend: Backend, steps: PackedSteps, threads: trio.CapacityLimiter,
                 lock: Callable[[str], trio.Lock]) -> None:
        self.backend = backend
        self._steps = steps
        self._threads = threads  # the uploader's requests' limiter: a pack is built in one
        self._lock = lock  # a path's lock: no upload or delete of it meanwhile
        self.bytes_sent = 0  # the steps' packs and their indexes

    async def write(self, manifest: mf.StepManifest, data_dir: str, changed: bool,
                    call: Call) -> set[str] | None:
        """The step's small files packed, the packs then their index. The names of the pack
        objects the step keeps; None: keep those there (no file changed: they still hold its
        small files' bytes).

        Only a step written on one node is packed (each rank of a multi-node load reads its
        own shards), from its files in RAM here; a step renamed while its files were only in
        the store gets its old name's packs, copied inside the store, if their index is the one
        it would have, else none (its old name's go with that name)."""
        if not changed:
            return None  # the same bytes as the stored version: its packs (if any) hold them
        groups = packs.plan(manifest) if self._steps.single_writer(manifest) else []
        if not groups:
            return set()
        index = packs.encode_index(groups)
        names = set()
        for number, group in enumerate(groups):
            data = await trio.to_thread.run_sync(packs.build, group, self._steps.object_path,
                                                 limiter=self._threads)
            if data is None:
                if await self._copy(manifest, data_dir, groups, index, call):
                    return {*map(packs.pack_name, range(len(groups))), reserved.PACKS}
                log.info("%s is not packed: not all its small files are in RAM here",
                         manifest.path)
                return set()
            key = layout.object_key(data_dir, packs.pack_name(number))
            await call(f"upload of {key}", self.backend.put_bytes, key, data)
            self.bytes_sent += len(data)
            names.add(packs.pack_name(number))
        key = layout.object_key(data_dir, reserved.PACKS)
        await call(f"upload of {key}", self.backend.put_bytes, key, index)
        self.bytes_sent += len(index)
        return names | {reserved.PACKS}

    async def _copy(self, manifest: mf.StepManifest, data_dir: str,
                    groups: list[list[mf.FileEntry]], index: bytes, call: Call) -> bool:
        """Copy the packs of the step a renamed one comes from, inside the store, if their
        index there is `index` (the same files, bytes and order); whether it did. Under the
        old name's lock: no upload or delete of it changes them meanwhile."""
        first = layout.object_key(data_dir, groups[0][0].name)
        for old_path, old_key in self._steps.copy_sources(first):
            suffix = "/" + groups[0][0].name
            if old_path == manifest.path or not old_key.endswith(suffix):
                continue  # not the same file of a step directory
            old_dir = old_key[:-len(suffix)]
            async with self._lock(old_path):
                try:
                    stored = await call(f"read of the packs of {old_path}",
                                        self.backend.get_bytes,
                                        layout.object_key(old_dir, reserved.PACKS))
                    if stored != index:
                        continue
                    for number in range(len(groups)):
                        name = packs.pack_name(number)
                        await call(f"copy of {old_dir}/{name}", self.backend.copy,
                                   layout.object_key(old_dir, name),
                                   layout.object_key(data_dir, name))
                except NotFound:
                    continue
            key = layout.object_key(data_dir, reserved.PACKS)
            await call(f"upload of {key}", self.backend.put_bytes, key, index)
            return True
        return False
