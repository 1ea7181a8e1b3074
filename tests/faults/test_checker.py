"""The partition suite's checker (tests/faults/checker.py) on histories written by hand: a good
history passes, and each property it promises to hold is reported when a history breaks it (so
that a run that passes means something)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.checker import Bounds, check
from tests.faults.history import Event, History

pytestmark = pytest.mark.faults

NODES = ["n0", "n1"]
BOUNDS = Bounds(settle=10.0, commit=5.0, save=20.0)


class Writer:
    """Builds a history with explicit times."""

    def __init__(self) -> None:
        self.history = History()
        self.time = 0.0
        self.next_id = 0

    def at(self, kind: str, op: str, id: int = 0, **value: Any) -> None:
        self.time += 1.0
        self.history.events.append(Event(self.time, kind, op, value, id))

    def op(self, op: str, ok: bool, **value: Any) -> None:
        self.next_id += 1
        invoke = {k: v for k, v in value.items() if k in ("path", "seed", "node", "to")}
        self.at("invoke", op, self.next_id, **invoke)
        self.at("ok" if ok else "fail", op, self.next_id, **{"error": "", **value})

    def save(self, path: str, seed: int, ok: bool = True, state: str = "committed",
             seconds: float = 1.0, commit: float = 0.5) -> None:
        self.op("save", ok, path=path, seed=seed, seconds=seconds, commit_seconds=commit,
                states=[state if ok else None] * 2)

    def load(self, node: str, link: str | None, seeds: list[int], ok: bool = True,
             ranks: list[dict[str, Any]] | None = None) -> None:
        """A load through `latest`; `ranks`: each rank's answer, else `link`/`seeds` on each."""
        if ranks is None:
            ranks = [{"seeds": seeds, "link": link, "link_after": link}] * 2 if ok else []
        self.op("load", ok, path="run/latest", node=node, seconds=0.1, ranks=ranks)

    def latest(self, node: str, link: str | None) -> None:
        self.at("latest", "latest", node=node, link=link)

    def fault(self, fault_id: int, start: bool, cut: list[str] | None = None) -> None:
        self.at("nemesis", "start" if start else "stop", fault_id=fault_id,
                **({"fault": "partition", "cut": cut or []} if start else {}))

    def settled(self, steps: dict[str, int], latest: str, seconds: float = 1.0) -> None:
        self.at("settled", "settled", seconds=seconds, latest=latest, steps=steps)

    def final(self, path: str, seed: int, files: dict[str, str] | None = None,
              nodes: list[str] = NODES) -> None:
        for node in nodes:
            self.op("final", True, path=path, node=node, seeds=[seed], state="committed",
                    files=files or {"__0_0.distcp": "aa", ".metadata": "bb"})

    def check(self) -> list[str]:
        return check(self.history, NODES, "run", BOUNDS)[0]


def good() -> Writer:
    w = Writer()
    w.save("run/step_10", 10)
    w.latest("n0", "step_10")
    w.load("n1", "step_10", [10])
    w.fault(1, True, cut=NODES)
    w.save("run/step_20", 20, ok=False, seconds=6.0, commit=5.0)
    w.load("n0", None, [], ok=False)  # during a cut: allowed
    w.latest("n1", "step_10")
    w.fault(1, False)
    w.settled({"run/step_10": 1, "run/step_20": 1}, "step_20")
    w.final("run/step_10", 10)
    w.final("run/step_20", 20)
    w.load("n0", "step_20", [20])
    w.load("n1", "step_20", [20])
    return w


def test_a_good_history_passes() -> None:
    violations, counts = check(good().history, NODES, "run", BOUNDS)
    assert violations == []
    assert counts["saves_ok"] == 1 and counts["saves_failed"] == 1
    assert counts["acknowledged_steps_checked"] == 2  # step_10 on both nodes
    assert counts["faults_applied"] == 1 and counts["loads_failed_in_cuts"] == 1


def test_an_acknowledged_save_not_committed_when_it_returns() -> None:
    w = Writer()
    w.fault(1, True, cut=NODES)
    w.save("run/step_5", 5, state="incomplete")  # committed, a holder cut off: fine
    w.fault(1, False)
    w.save("run/step_10", 10, state="writing")
    w.settled({"run/step_10": 1}, "step_10")
    w.final("run/step_10", 10)
    found = w.check()
    assert any("returned success on every rank but its step is writing" in v for v in found)
    assert not any("step_5 returned" in v for v in found), found


def test_an_acknowledged_save_lost_or_read_back_wrong() -> None:
    w = Writer()
    w.save("run/step_10", 10)
    w.save("run/step_20", 20)
    w.settled({"run/step_10": 1}, "step_10")
    w.final("run/step_10", 11)  # another save's tensors
    found = w.check()
    assert any("run/step_20: acknowledged" in v and "lost" in v for v in found), found
    assert any("holds seeds [11]" in v for v in found), found


def test_nodes_that_read_different_bytes_or_a_bad_hash() -> None:
    w = Writer()
    w.save("run/step_10", 10)
    w.settled({"run/step_10": 1}, "step_10")
    w.final("run/step_10", 10, nodes=["n0"])
    w.final("run/step_10", 10, files={"__0_0.distcp": "bad: read x, manifest y"},
            nodes=["n1"])
    found = w.check()
    assert any("nodes read different bytes" in v for v in found)
    assert any("bad: read x" in v for v in found)


def test_a_load_of_mixed_bytes_or_a_failed_load_outside_cuts() -> None:
    w = good()
    w.load("n1", "step_20", [-1, 20])
    w.load("n0", None, [], ok=False)
    found = w.check()
    assert any("read mixed or wrong bytes" in v for v in found)
    assert any("failed outside any cut" in v for v in found)


def test_a_load_whose_ranks_read_different_saves() -> None:
    """Each rank read one save, matching what `latest` named to it, but not the same one: a
    job resumed from two steps at once."""
    w = good()
    w.save("run/step_20", 20)
    w.load("n0", None, [], ranks=[{"seeds": [20], "link": "step_20", "link_after": "step_20"},
                                  {"seeds": [10], "link": "step_10", "link_after": "step_10"}])
    assert any("its ranks read different saves" in v for v in w.check())


def test_a_load_whose_metadata_and_shards_came_from_two_steps() -> None:
    """The two steps have one layout, so DCP loads them together and every rank's tensors
    are of one save: only the step directories its files were opened in tell."""
    w = good()
    w.save("run/step_20", 20)
    w.load("n0", None, [], ranks=[
        {"seeds": [20], "link": "step_20", "link_after": "step_20",
         "read_from": ["step_10", "step_20"]},
        {"seeds": [20], "link": "step_20", "link_after": "step_20", "read_from": ["step_20"]}])
    assert any("its files came from 2 steps" in v for v in w.check())


def test_latest_going_back_outside_cuts_and_deletes() -> None:
    w = Writer()
    w.save("run/step_10", 10)
    w.save("run/step_20", 20)
    w.latest("n0", "step_20")
    w.latest("n0", "step_10")  # back, no cut, no delete
    w.op("delete", True, path="run/step_20", node="n0")
    w.latest("n0", "step_20")
    w.latest("n0", "step_10")  # back after the delete: fine
    w.settled({"run/step_10": 1}, "step_10")
    w.final("run/step_10", 10)
    found = w.check()
    assert len([v for v in found if "went back" in v]) == 1, found


def test_bounds_on_saves_and_settling() -> None:
    w = Writer()
    w.save("run/step_10", 10, seconds=25.0, commit=7.0)
    w.fault(1, True, cut=NODES)
    w.fault(1, False)
    w.settled({"run/step_10": 1}, "step_10", seconds=12.0)
    w.final("run/step_10", 10)
    found = w.check()
    assert any("the call that commits (.metadata) blocked 7.0 s" in v for v in found)
    assert any("blocked 25.0 s (bound 20.0 s" in v for v in found)
    assert any("did not agree within 10.0 s" in v for v in found)


def test_a_deleted_or_renamed_step_that_comes_back() -> None:
    w = Writer()
    w.save("run/step_10", 10)
    w.save("run/step_20", 20)
    w.op("delete", True, path="run/step_10", node="n0")
    w.op("rename", True, path="run/step_20", to="run/step_25", node="n1")
    w.settled({"run/step_10": 1, "run/step_25": 1}, "step_25")
    w.final("run/step_10", 10)
    w.final("run/step_25", 20)
    found = w.check()
    assert any("run/step_10: acknowledged deleted or renamed away" in v for v in found), found
    assert not any("step_25" in v for v in found), found  # it holds step_20's save


def test_latest_at_the_end_must_name_the_newest_step() -> None:
    w = good()
    w.load("n1", "step_10", [10])
    assert any("newest committed step is run/step_20" in v for v in w.check())
