"""`replication.peers.sources`, the pure decision of where a reader gets each chunk of a file that
many nodes read at once: the holder sends each chunk about once, later readers go to earlier
ones (never to one that waits on them), failed relays are avoided."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tierfs.replication.peers import protocol as proto
from tierfs.replication.peers.sources import (
    FANOUT,
    ChunkRoutes,
    RouteBook,
    StepReaders,
    holder_order,
)

pytestmark = pytest.mark.core


def test_the_holder_sends_each_chunk_once_and_readers_relay_it_to_later_readers() -> None:
    routes = ChunkRoutes("holder")
    readers = [f"n{i}" for i in range(100)]
    rng = random.Random(3)
    sent: Counter[str] = Counter()
    for chunk in range(40):
        order = readers[:]
        rng.shuffle(order)
        seen: set[str] = set()
        given: Counter[str] = Counter()
        for reader in order:
            source = routes.route(reader, chunk)
            assert source == "holder" or source in seen  # an earlier reader of this chunk
            given[source] += 1
            sent[source] += 1
            seen.add(reader)
        assert given["holder"] == 1
        assert max(n for node, n in given.items() if node != "holder") <= FANOUT
    assert sent["holder"] == 40
    assert max(sent[r] for r in readers) <= 2 * 40 * 99 / 100  # load spread over readers


def test_a_failed_relay_is_avoided_and_nobody_is_sent_to_a_later_reader() -> None:
    routes = ChunkRoutes("h")
    assert routes.route("a", 0) == "h"
    assert routes.route("b", 0) == "a"
    assert routes.route("c", 0) == "b"  # the least loaded
    # b asks again: a failed it. Only readers seen before b may serve it (not c, which waits
    # on b): none is left, the holder serves it
    assert routes.route("b", 0, avoid=["a"]) == "h"
    assert routes.route("d", 0) in ("b", "c")  # a was dropped for this chunk
    assert routes.route("a", 1) == "h"  # but still serves other chunks
    assert routes.route("e", 1) == "a"


def test_holder_order_spreads_chunks_over_holders_live_ones_first() -> None:
    holders = ["n0", "n1", "n2"]
    firsts = Counter(holder_order(holders, "f" * 32, c << 23)[0] for c in range(300))
    assert set(firsts) == set(holders) and min(firsts.values()) > 50
    order = holder_order(holders, "f" * 32, 0, is_up=lambda node: node != "n1")
    assert order[-1] == "n1" and sorted(order) == holders
    assert holder_order([], "f" * 32, 0) == []


def test_a_books_routes_are_forgotten_after_the_ttl() -> None:
    book = RouteBook("h", ttl=10.0)
    assert book.route("x" * 32, "a", 0, (), now=0.0) == "h"
    assert book.route("x" * 32, "b", 0, (), now=1.0) == "a"
    assert book.relayed() == 1
    assert book.route("x" * 32, "b", 0, (), now=20.0) == "h"  # a new read of the file


def test_a_steps_small_files_go_at_once_to_its_first_readers_only() -> None:
    """A holder gives a step's small files many at once to its first FILES_READERS readers
    (again to each of them), none to a later one until the step was not asked for a while;
    another step has readers of its own."""
    readers = StepReaders(ttl=10.0, most=2)
    assert readers.admit("run/step_1", "a", now=0.0)
    assert readers.admit("run/step_1", "b", now=1.0)
    assert not readers.admit("run/step_1", "c", now=2.0)
    assert readers.admit("run/step_1", "a", now=3.0)
    assert readers.admit("run/step_2", "c", now=4.0)
    assert not readers.admit("run/step_1", "c", now=12.0)  # asked at 3 (and by c at 12)
    assert readers.admit("run/step_1", "c", now=23.0)


@pytest.mark.parametrize("avoid", [list(range(3)), ["n"] * (proto.MAX_AVOID + 1), [""]])
def test_a_swarm_get_with_a_malformed_avoid_list_is_refused(avoid: list[object]) -> None:
    fields = {"path": "run/step_1", "name": "a.pt", "xxh3": "0" * 32, "offset": 0,
              "length": 1, "avoid": avoid}
    with pytest.raises(proto.ProtocolError):
        proto.validate(proto.Message("SWARM_GET", fields))
    proto.validate(proto.Message("SWARM_GET", {**fields, "avoid": ["node1"]}))
