"""Placement across failure domains (`--failure-domain`): a file's K copies go to nodes of other
domains than its writer's first, the ring interleaves the domains so that every node gets about
as many copies as it sends, a domain lost whole leaves every file a copy elsewhere, and without
domains placement is what it always was (the next K live nodes on the sorted ring)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.mount_helper.status_view import nodes_line, tiers_of
from tierfs.replication.coordination import placement

pytestmark = pytest.mark.core

RACKS = {"n0": "rackA", "n1": "rackA", "n2": "rackA", "n3": "rackA",
         "n4": "rackB", "n5": "rackB", "n6": "rackB", "n7": "rackB"}


def test_each_node_replicates_to_another_rack_and_gets_one_copy() -> None:
    ring = placement.ring(RACKS, RACKS)
    assert ring == ["n0", "n4", "n1", "n5", "n2", "n6", "n3", "n7"]
    targets = {n: placement.replica_targets(ring, n, 1, RACKS) for n in RACKS}
    assert all(RACKS[t[0]] != RACKS[n] for n, t in targets.items()), targets
    assert collections.Counter(t[0] for t in targets.values()) == {n: 1 for n in RACKS}


def test_without_domains_placement_is_the_sorted_ring() -> None:
    nodes = ["n3", "n1", "n4", "n2"]
    assert placement.ring(nodes) == placement.ring(nodes, {}) == ["n1", "n2", "n3", "n4"]
    assert placement.replica_targets(placement.ring(nodes), "n4", 2) == ["n1", "n2"]
    # a rack-sorted ring without domains would put n0's and n1's copies in rack A
    ring = placement.ring(RACKS)
    assert placement.replica_targets(ring, "n0", 1) == ["n1"]


def test_without_domains_a_gone_writer_s_copies_go_from_its_own_place() -> None:
    """A writer lost for good and a node with the next id in its place: that node takes the
    lost writer's copies, as before failure domains (b0d0c24 started from the file's first
    live holder's place in every cluster, and the copy went to node1)."""
    file = placement.Placement("node2", frozenset({"node2", "node0"}))
    plan = placement.restore_plan({"f": file}, ["node0", "node1", "node3"], 1)
    assert plan.copies == [placement.Copy("f", "node0", "node3")]


def test_k_copies_spread_over_as_many_domains_as_there_are() -> None:
    domains = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "c1": "C"}
    ring = placement.ring(domains, domains)
    for writer in domains:
        holders = placement.desired_holders(ring, writer, 2, domains)
        assert holders[0] == writer and len(holders) == 3
        assert len({domains[h] for h in holders}) == 3, holders
    # more copies than domains: the domains first, then clockwise again
    holders = placement.desired_holders(ring, "a1", 4, domains)
    assert len(set(holders)) == 5


def test_a_node_without_a_domain_is_a_domain_of_its_own() -> None:
    domains = {"a1": "A", "a2": "A"}
    ring = placement.ring(["a1", "a2", "x"], domains)
    assert placement.replica_targets(ring, "a1", 1, domains) == ["x"]
    assert placement.replica_targets(ring, "x", 1, domains) in (["a1"], ["a2"])


def test_a_lost_copy_is_made_again_in_the_domain_that_lost_it() -> None:
    file = placement.Placement("n0", frozenset({"n0", "n4"}))
    survivors = [n for n in RACKS if n != "n4"]
    live = {n: RACKS[n] for n in survivors}
    plan = placement.restore_plan({"f": file}, placement.ring(survivors, live), 1, live)
    assert len(plan.copies) == 1 and plan.copies[0].source == "n0"
    assert RACKS[plan.copies[0].target] == "rackB", plan.copies


def test_a_writer_that_is_gone_still_gives_one_plan_on_every_node() -> None:
    file = placement.Placement("n9", frozenset({"n5"}))
    live = {n: RACKS[n] for n in RACKS if n != "n4"}
    rings = [placement.ring(list(reversed(live)), live), placement.ring(sorted(live), live)]
    plans = [placement.restore_plan({"f": file}, ring, 1, live) for ring in rings]
    assert plans[0] == plans[1] and len(plans[0].copies) == 1
    assert RACKS[plans[0].copies[0].target] == "rackA"  # n5's rack holds it already


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([f"n{i}" for i in range(12)]),
                       st.sampled_from(["r1", "r2", "r3"]), min_size=2),
       st.integers(min_value=1, max_value=3), st.data())
def test_a_domain_lost_whole_leaves_every_file_a_copy(domains: dict[str, str], replicas: int,
                                                      data: st.DataObject) -> None:
    """With K >= 1 and at least two domains, the K + 1 holders of every file are never all in
    one domain; the plan for a fresh file is its desired holders; and with one domain lost
    whole, restore_plan brings every file back to K + 1 copies from the survivors."""
    ring = placement.ring(domains, domains)
    writers = data.draw(st.lists(st.sampled_from(sorted(domains)), min_size=1, max_size=6))
    files = {}
    for i, writer in enumerate(writers):
        holders = placement.desired_holders(ring, writer, replicas, domains)
        assert holders[0] == writer
        if len(set(domains.values())) > 1:
            assert len({domains[h] for h in holders}) >= 2, holders
        fresh = placement.restore_plan({"f": placement.Placement(writer, frozenset({writer}))},
                                       ring, replicas, domains)
        assert sorted(c.target for c in fresh.copies) == sorted(holders[1:])
        files[f"f{i}"] = placement.Placement(writer, frozenset(holders))
    lost = data.draw(st.sampled_from(sorted(set(domains.values()))))
    survivors = {n: d for n, d in domains.items() if d != lost}
    if not survivors:
        return
    plan = placement.restore_plan(files, placement.ring(survivors, survivors), replicas,
                                  survivors)
    if len(set(domains.values())) > 1:
        assert plan.lost == []
    for name, file in files.items():
        held = (file.holders & set(survivors)) | {c.target for c in plan.copies
                                                 if c.file == name}
        if name not in plan.lost:
            assert len(held) == min(replicas + 1, len(survivors))


def test_status_names_each_copy_s_domain() -> None:
    step = {"tiers": "ram,peer:n4", "domains": {"n0": "rackA", "n4": "rackB"},
            "ram": True, "replicas": [], "persisted": False}
    assert tiers_of(step, "n0") == "ram(rackA),peer:n4(rackB)"
    assert tiers_of({**step, "domains": {}}, "n0") == "ram,peer:n4"
    assert nodes_line([{"node_id": "n4", "addr": "10.0.0.5:7070", "up": True, "state": "up",
                        "domain": "rackB"}]) == "nodes: n4 (10.0.0.5:7070, rackB) up"
