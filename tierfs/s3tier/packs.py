"""Packs: the small files of a step also stored as a few large objects of the persistent tier,
so that a node reading back a step of thousands of small files makes a handful of GETs, not one
per file (each GET costs 1.5-2 ms of boto3's CPU under the GIL: 10,000 of them took a minute).

Layout. A step directory committed on one node with at least MIN_FILES files of at most
SMALL_FILE bytes each keeps every file as its plain object `<step>/<file>` (what standard tools
read), and, beside them, `<step>/.tierfs-pack-0`, `-1`, ...: those small files' bytes one after
the other, in manifest order, at most PACK_BYTES per pack (a file larger than that never is
small); and `<step>/.tierfs-packs`, the index: msgpack `{"format": 1, "packs": [[pack name,
pack size, [[file name, offset, size, xxh3-128], ...]], ...]}`. The uploader writes the packs,
then the index, after the plain objects and before the manifest; they live and go with the
step's other objects (a delete, retention, the cleanup of an incomplete upload list the step's
prefix), and an upload that does not write them again removes them (`Uploader._remove_stale`).
The manifest does not name them: manifests are what they were, and a step without packs (an
older one, a multi-node step, one renamed while its files were not in RAM here) reads as before.

A pack is a cache, never a source of truth: `PackedReader` serves a small file from its pack
only if the index names it with the manifest's size and xxh3-128 and the bytes it cuts out hash
to that xxh3-128 (then the fetch checks them again, as it checks any source). A missing index
is one 404 per step; a missing, short or corrupt pack, or an unreadable index, sends its step's
reads to the plain objects (per-file GETs) for BAD_PAUSE seconds: never wrong data.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgpack
import trio
import xxhash

from tierfs import layout, reserved
from tierfs import manifest as mf
from tierfs.msgpack_map import decode_map
from tierfs.s3tier.interface import BackendError, NotFound
from tierfs.s3tier.reader import PersistentReader

log = logging.getLogger(__name__)

# as `fs.lifecycle.fetch_back.SMALL_FILE`: the files that come back with each other
SMALL_FILE = 1 << 20
MIN_FILES = 64  # fewer small files: their GETs cost less than a pack's upload
PACK_BYTES = 64 << 20
INDEX_FORMAT = 1
CACHED_PACKS = 2  # packs held in the daemon's memory while their files are read back
CACHED_INDEXES = 64
BAD_PAUSE = 300.0  # seconds a step whose packs failed is read from its plain objects
_PACK_NAME = re.compile(re.escape(reserved.PACK) + r"[0-9]{1,6}$")
_HEX128 = re.compile(r"^[0-9a-f]{32}$")


class PackIndexError(ValueError):
    """An index object that cannot be decoded or does not hold together."""


@dataclass(frozen=True)
class Packed:
    """Where a small file's bytes are in the packs: `pack`'s bytes [offset, +size)."""

    pack: str
    offset: int
    size: int
    xxh3: str


@dataclass(frozen=True)
class PackIndex:
    sizes: dict[str, int]  # pack name -> its size
    counts: dict[str, int]  # pack name -> how many files it holds
    files: dict[str, Packed]


def pack_name(number: int) -> str:
    return f"{reserved.PACK}{number}"


def is_pack_object(name: str) -> bool:
    """Whether `name`, in a step directory of the store, is a pack or the packs' index."""
    return name == reserved.PACKS or bool(_PACK_NAME.match(name))


def plan(manifest: mf.StepManifest) -> list[list[mf.FileEntry]]:
    """The small files of a step, in manifest order, grouped into packs (none: the step is a
    single file, or has fewer than MIN_FILES small files)."""
    if manifest.single_file:
        return []
    small = [e for e in manifest.files if e.size <= SMALL_FILE and not e.segments]
    if len(small) < MIN_FILES:
        return []
    groups: list[list[mf.FileEntry]] = [[]]
    total = 0
    for entry in small:
        if groups[-1] and total + entry.size > PACK_BYTES:
            groups.append([])
            total = 0
        groups[-1].append(entry)
        total += entry.size
    return groups


def build(group: list[mf.FileEntry], object_path: Callable[[str], str]) -> bytes | None:
    """The bytes of one pack, read from the RAM tier's committed objects; None if a file of it
    is not there (or not whole). Blocking: a worker thread's."""
    pieces = []
    for entry in group:
        try:
            with open(object_path(entry.xxh3), "rb") as f:
                data = f.read(entry.size + 1)
        except FileNotFoundError:
            return None
        if len(data) != entry.size:
            return None
        pieces.append(data)
    return b"".join(pieces)


def encode_index(groups: list[list[mf.FileEntry]]) -> bytes:
    packs = []
    for number, group in enumerate(groups):
        offset, files = 0, []
        for entry in group:
            files.append([entry.name, offset, entry.size, entry.xxh3])
            offset += entry.size
        packs.append([pack_name(number), offset, files])
    return msgpack.packb({"format": INDEX_FORMAT, "packs": packs}, use_bin_type=True)


def decode_index(data: bytes) -> PackIndex:
    """Decode and validate an index; PackIndexError for anything malformed."""
    raw = decode_map(data, PackIndexError, "pack index", kind=INDEX_FORMAT)
    if not isinstance(raw.get("packs"), list):
        raise PackIndexError("unknown pack index format")
    sizes, counts, files = {}, {}, {}
    try:
        for name, size, entries in raw["packs"]:
            if not (isinstance(name, str) and _PACK_NAME.match(name) and isinstance(size, int)
                    and 0 <= size <= PACK_BYTES and name not in sizes):
                raise PackIndexError(f"bad pack {name!r}")
            sizes[name], counts[name] = size, len(entries)
            for file, offset, length, xxh3 in entries:
                if not (isinstance(offset, int) and isinstance(length, int) and
                        0 <= offset <= offset + length <= size and isinstance(xxh3, str)
                        and _HEX128.match(xxh3) and isinstance(file, str)
                        and file not in files):
                    raise PackIndexError(f"bad entry {file!r} in {name}")
                files[mf.check_relative_path(file)] = Packed(name, offset, length, xxh3)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, PackIndexError):
            raise
        raise PackIndexError(f"malformed pack index: {exc!r}") from None
    return PackIndex(sizes, counts, files)


class PackedReader:
    """The persistent tier as a read source (`reader`'s), a small file of a packed step read
    out of its pack: one GET of the index per step, one of each pack, both shared by the reads
    that wait on them. Only the read path uses it: `tierfs verify` checks the plain objects.
    At most CACHED_PACKS packs stay in memory, a pack until each of its files was read out of
    it once or until newer ones push it out."""

    def __init__(self, reader: PersistentReader) -> None:
        self.reader = reader
        self.name = reader.name
        self._indexes: collections.OrderedDict[str, PackIndex | None] = \
            collections.OrderedDict()  # step data dir -> its index (None: it has no packs)
        self._packs: collections.OrderedDict[tuple[str, str], bytes] = \
            collections.OrderedDict()
        self._served: dict[tuple[str, str], set[str]] = {}
        self._loading: dict[object, trio.Event] = {}
        self._bad_until: dict[str, float] = {}  # step -> trio time its packs are used again
        self.files_from_packs = 0  # small files served out of a pack (status, tests)

    async def read_range(self, step_path: str, entry: mf.FileEntry, offset: int,
                         length: int) -> bytes:
        if entry.size <= SMALL_FILE and not entry.segments:
            data = await self._from_pack(step_path, entry)
            if data is not None:
                return data[offset:offset + length]
        return await self.reader.read_range(step_path, entry, offset, length)

    async def _from_pack(self, step_path: str, entry: mf.FileEntry) -> bytes | None:
        """The file's bytes out of its pack, checked against its xxh3-128; None if it has no
        pack, or its pack is missing, short or wrong (its step then reads per file)."""
        if trio.current_time() < self._bad_until.get(step_path, -math.inf):
            return None
        index = await self._index(step_path)
        packed = index.files.get(entry.name) if index is not None else None
        if index is None or packed is None or (packed.size, packed.xxh3) != (entry.size,
                                                                             entry.xxh3):
            return None  # not packed, or packed in another version of the file
        pack = await self._pack(step_path, packed.pack, index.sizes[packed.pack])
        if pack is None:
            return None
        data = pack[packed.offset:packed.offset + packed.size]
        if xxhash.xxh3_128_hexdigest(data) != entry.xxh3:
            self._give_up(step_path, f"{packed.pack} holds other bytes for {entry.name}")
            return None
        key = (step_path, packed.pack)
        served = self._served.setdefault(key, set())
        served.add(entry.name)
        if len(served) >= index.counts[packed.pack]:  # each of its files is in RAM now
            self._packs.pop(key, None)
            self._served.pop(key, None)
        self.files_from_packs += 1
        return data

    def _give_up(self, step_path: str, why: str) -> None:
        log.warning("the packs of %s in %s are not used for %.0f s (%s): its small files are "
                    "read one by one", step_path, self.reader.backend.url, BAD_PAUSE, why)
        self._bad_until[step_path] = trio.current_time() + BAD_PAUSE
        self._indexes.pop(step_path, None)
        for key in [key for key in self._packs if key[0] == step_path]:
            del self._packs[key]
            self._served.pop(key, None)

    async def _shared(self, key: object, load: Callable[[], Awaitable[None]]) -> None:
        """Run `load` once for concurrent callers with the same key: the others wait for it."""
        waiting = self._loading.get(key)
        if waiting is not None:
            await waiting.wait()
            return
        done = self._loading[key] = trio.Event()
        try:
            await load()
        finally:
            del self._loading[key]
            done.set()

    async def _index(self, step_path: str) -> PackIndex | None:
        if step_path not in self._indexes:
            await self._shared(("index", step_path), lambda: self._load_index(step_path))
        if step_path in self._indexes:
            self._indexes.move_to_end(step_path)
        return self._indexes.get(step_path)

    async def _load_index(self, step_path: str) -> None:
        if step_path in self._indexes:
            return
        key = layout.object_key(step_path, reserved.PACKS)
        try:
            index: PackIndex | None = decode_index(await self.reader.read_object(key))
        except NotFound:
            index = None
        except PackIndexError as exc:
            self._give_up(step_path, f"{key}: {exc}")
            return
        except BackendError:
            return  # the store fails now: the plain objects' reads say how
        self._indexes[step_path] = index
        while len(self._indexes) > CACHED_INDEXES:
            self._indexes.popitem(last=False)

    async def _pack(self, step_path: str, name: str, size: int) -> bytes | None:
        key = (step_path, name)
        if key not in self._packs:
            await self._shared(key, lambda: self._load_pack(step_path, name, size))
        return self._packs.get(key)

    async def _load_pack(self, step_path: str, name: str, size: int) -> None:
        if (step_path, name) in self._packs:
            return
        object_key = layout.object_key(step_path, name)
        try:
            data = await self.reader.read_object(object_key)
        except BackendError as exc:
            if isinstance(exc, NotFound):
                self._give_up(step_path, f"{object_key} is missing")
            return
        if len(data) != size:
            self._give_up(step_path, f"{object_key} has {len(data)} bytes, not {size}")
            return
        self._packs[(step_path, name)] = data
        while len(self._packs) > CACHED_PACKS:
            old, _ = self._packs.popitem(last=False)
            with contextlib.suppress(KeyError):
                del self._served[old]
