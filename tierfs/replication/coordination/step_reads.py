"""The records of the steps read last, kept so that reading a step again costs what changed.

A status, a copy's plan and an upload's read a step's file records in etcd again and again,
mostly unchanged: a 10,000-file step's took about 180 ms of the daemon's loop to read whole
again, and 65 ms to decode (ad hoc). `StepReads` keeps, for the DECODED_STEPS steps read last
(at most DECODED_RECORDS records, or the last step alone whatever its size):

- every key-value of the step at the revision read, so that the next read asks etcd only for
  the keys put since (`Etcd.get_prefix`'s `changed_after`); the reply counts every key, so a
  deletion meanwhile (a lower count) makes it read the step whole, as does a reply whose
  revision is lower than the last read's (an etcd wiped, or restored from a backup);
- each record decoded with the bytes it was decoded from, so that a record is decoded again
  only when its bytes changed (the records this node writes are kept as it wrote them:
  `wrote`).

Reads of one step are made one after the other: one that starts while another is on its way
waits for it, then asks only for what changed since.

`stamp` names the records' content: the newest revision among them and their count, which
changes with every put and every delete and never comes back to a value it had.

Nothing here knows what a record means: the caller gives the prefix of each step's keys and
how to decode one value (ValueError, KeyError or TypeError for a malformed one, which is
logged and left out).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio

from tierfs.replication.coordination.etcd import Etcd, KeyValue

log = logging.getLogger(__name__)

DECODED_RECORDS, DECODED_STEPS = 20_000, 8  # about 1 KiB per record: 20 MiB

R = TypeVar("R")
Stamp = tuple[int, int]  # (the newest mod_revision among the records, their count)


@dataclass
class StepRead:
    """A step's records as etcd held them at `revision`: every key-value, by path."""

    revision: int
    kvs: dict[str, KeyValue]

    @property
    def stamp(self) -> Stamp:
        return max((kv.mod_revision for kv in self.kvs.values()), default=0), len(self.kvs)


class StepReads(Generic[R]):
    """The read and decoded records of the steps read last (see the module docstring)."""

    def __init__(self, etcd: Etcd, prefix: Callable[[str], str],
                 decode: Callable[[bytes], R]) -> None:
        self.etcd = etcd
        self._prefix = prefix  # a step's records' key prefix
        self._decode = decode
        self._reads: dict[str, StepRead] = {}  # the most recently read last
        self._decoded: dict[str, dict[str, tuple[bytes, R]]] = {}
        self._reading: dict[str, trio.Event] = {}  # steps being read, set once read

    def kept(self, step: str) -> bool:
        """Whether a read of the step is kept (its next read asks only for changes)."""
        return step in self._reads

    async def read(self, step: str) -> StepRead:
        """Every record of the step as etcd holds it now. A read that starts while another
        of the step is on its way waits for it, then asks for what changed since: right after
        a many-file commit its copies' plan, a status and the commit read the step at about
        the same time, and each read it whole (a 50,000-file step's took about 0.8 s of the
        loop; ad hoc, py-spy)."""
        while step in self._reading:
            await self._reading[step].wait()
        self._reading[step] = done = trio.Event()
        try:
            return await self._read(step)
        finally:
            del self._reading[step]
            done.set()

    async def _read(self, step: str) -> StepRead:
        prefix = self._prefix(step)
        last = self._reads.pop(step, None)  # this call's own while it reads
        read: StepRead | None = None
        if last is not None:
            changes = await self.etcd.get_prefix(prefix, changed_after=last.revision)
            kvs = last.kvs
            added = False
            for kv in changes.kvs:
                path = kv.key[len(prefix):]
                added = added or path not in kvs
                kvs[path] = kv
            # A backup's history is taken for this one's once it has passed the last read's
            # revision, as by the watches.
            if len(kvs) == changes.count and changes.revision >= last.revision:
                if added:  # in the keys' order, as a whole read gives them
                    kvs = dict(sorted(kvs.items()))
                read = StepRead(changes.revision, kvs)
        if read is None:
            snapshot = await self.etcd.get_prefix(prefix)
            read = StepRead(snapshot.revision,
                            {kv.key[len(prefix):]: kv for kv in snapshot.kvs})
        self._reads[step] = read
        _bound(self._reads, lambda kept: len(kept.kvs))
        return read

    def decode(self, step: str, kvs: Mapping[str, KeyValue], *, whole: bool = True
               ) -> dict[str, R]:
        """The records of `kvs` (by path: `whole`, every record of the step, else some of
        them, as a watch brings changes), by path; those decoded before with the same bytes
        are not decoded again."""
        known = self._decoded.pop(step, {})
        decoded = {} if whole else known
        records: dict[str, R] = {}
        for path, kv in kvs.items():
            value = kv.value
            hit = known.get(path)
            if hit is not None and hit[0] == value:
                record = hit[1]
            else:
                try:
                    record = self._decode(value)
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("ignoring the malformed record %s%s: %s",
                                self._prefix(step), path, exc)
                    continue
            records[path] = record
            decoded[path] = (value, record)
        self._decoded[step] = decoded
        _bound(self._decoded, len)
        return records

    def decode_kvs(self, step: str, kvs: Iterable[KeyValue], *, whole: bool = True
                   ) -> dict[str, R]:
        """`decode` of key-values of the step as etcd gives them (full keys)."""
        cut = len(self._prefix(step))
        return self.decode(step, {kv.key[cut:]: kv for kv in kvs}, whole=whole)

    def wrote(self, step: str, written: Iterable[tuple[str, bytes, R]]) -> None:
        """This node put these records ((path, bytes, record)): the next read of them decodes
        none (the seals of a 50,000-file save, read back by its commit, took about 0.45 s of
        its loop to decode; ad hoc)."""
        known = self._decoded.pop(step, {})
        known.update((path, (value, record)) for path, value, record in written)
        self._decoded[step] = known
        _bound(self._decoded, len)


def _bound(kept: dict[str, Any], size: Callable[[Any], int]) -> None:
    """Keep the most recently added steps of `kept` (the last), at most DECODED_STEPS of
    them and DECODED_RECORDS records, or the last one alone whatever its size."""
    while len(kept) > 1 and (len(kept) > DECODED_STEPS
                             or sum(map(size, kept.values())) > DECODED_RECORDS):
        del kept[next(iter(kept))]
