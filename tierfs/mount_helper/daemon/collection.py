"""When the daemon's cyclic garbage collector does its full passes: on a timer, not whenever
allocations pile up.

CPython runs a full (oldest generation) collection once enough objects have survived the young
ones, which is exactly when a burst of allocations ends: the commit of a step of 10,000 files
makes tens of thousands of objects at once (entries, the manifest, its encoding), and the full
pass over the whole daemon (every node of the namespace) then ran inside that commit, with no
await, while the saver's close and every FUSE request waited: 100-500 ms of a 10,000-file
commit in the bench's profile (issue 25). Here the young generations are still collected as
CPython does, while the full passes run every FULL_EVERY seconds from a task of their own: the
same pause, at a moment unrelated to any call, and at most that long a delay before cyclic
garbage that reached the oldest generation is freed (most garbage is freed by reference
counting, at once, either way).
"""

from __future__ import annotations

import gc

import trio

FULL_EVERY = 30.0  # seconds between full collections
NEVER = 1 << 30  # young collections of the middle generation before a full one: none


async def run_full_collections(every: float = FULL_EVERY) -> None:
    """Take the full collections off the allocation path and run them every `every` seconds
    (until cancelled: then the thresholds are put back)."""
    young, middle, oldest = gc.get_threshold()
    gc.set_threshold(young, middle, NEVER)
    try:
        while True:
            await trio.sleep(every)
            gc.collect()
    finally:
        gc.set_threshold(young, middle, oldest)
