"""`tierfs status [PATH]` for a person: the rendering from a status document (no mount), then
through a real mount: PATH's subtree only, `latest` per run, ages, summaries, warnings, and the
steps `tierfs umount` leaves uncommitted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MountFactory, tierfs
from tests.test_savers import write
from tierfs.mount_helper.status_view import (
    cannot_commit,
    commit_waits,
    format_status,
    human_age,
    in_subtree,
    store_lines,
    subtree,
    uncommitted,
)

pytestmark = pytest.mark.fuse

NOW = 1_800_000_000 * 10**9  # ns


def step(path: str, number: int, state: str = "committed", *, persisted: bool = False,
         replicas: tuple[str, ...] = (), ago: float = 10.0, size: int = 1024,
         waiting_for: str | None = None,
         persist_wait: dict[str, Any] | None = None) -> dict[str, Any]:
    stamp = NOW - int(ago * 1e9)
    return {"path": path, "step": number, "state": state, "version": int(state == "committed"),
            "files": 2, "bytes": size, "ram_bytes": size, "ram": True,
            "replicas": list(replicas), "persisted": persisted, "waiting_for": waiting_for,
            "persist_wait": persist_wait,
            "committed_ns": stamp if state == "committed" else None,
            "changed_ns": stamp if state != "committed" else None}


def document(*steps: dict[str, Any], persist: bool = True) -> dict[str, Any]:
    return {"node_id": "n0", "mountpoint": "/ckpt", "pid": 7, "ram_dir": "/dev/shm/t",
            "ram": {"used_bytes": 1 << 20, "limit_bytes": 1 << 30}, "passthrough": True,
            "peers": [], "persist": {"url": "file:///s", "pending_steps": 0,
                                     "pending_bytes": 0} if persist else None,
            "steps": list(steps)}


def rows(text: str) -> dict[str, list[str]]:
    """Table rows by their PATH cell."""
    return {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and "/" in line.split()[0] and ":" not in line.split()[0]}


def test_table_marks_latest_and_ages_and_summarises_each_run() -> None:
    text = format_status(document(
        step("run1/step_100", 100, persisted=True, ago=65),
        step("run1/step_200", 200, ago=12),
        step("run1/step_300", 300, "writing", ago=3),
        step("run2/checkpoint-5", 5, persisted=True, replicas=("n1",), ago=7500, size=3 << 20),
    ), now_ns=NOW)
    lines = text.splitlines()
    assert lines[2] == "persistent tier file:///s: every committed step due there is in it"
    assert lines[3].split() == ["PATH", "STEP", "STATE", "VERSION", "FILES", "SIZE", "AGE",
                                "TIERS"]
    table = rows(text)
    assert table["run1/step_100"][-2:] == ["1m05s", "ram,persist"]
    assert table["run1/step_200"][-4:] == ["12s", "ram", "<-", "latest"]  # highest committed
    assert table["run1/step_300"][2] == "writing" and table["run1/step_300"][-2:] == ["3s",
                                                                                      "ram"]
    assert table["run2/checkpoint-5"][-4:] == ["2h05m", "ram,peer:n1,persist", "<-", "latest"]
    assert ("run1: 3 steps, 3.0 KiB; newest committed step_200 (12s ago); oldest only in RAM "
            "step_200 (committed)") in lines
    assert ("run2: 1 step, 3.0 MiB; newest committed checkpoint-5 (2h05m ago); none only in "
            "RAM") in lines
    assert ("warning: 2 steps exist only in this node's RAM (1 being written, 1 committed, not "
            "yet persisted or replicated): run1/step_200, run1/step_300") in lines


def test_a_run_directory_with_its_own_latest_marks_no_step_and_says_so() -> None:
    status = document(step("ds/global_step2", 2), step("ds/global_step4", 4),
                      step("run/step_1", 1))
    status["own_latest"] = ["ds"]
    text = format_status(status, now_ns=NOW)
    table = rows(text)
    assert "<-" not in table["ds/global_step4"] and table["run/step_1"][-2:] == ["<-", "latest"]
    assert [line for line in text.splitlines() if line.startswith("ds:")][0].endswith(
        "; its own `latest` is in use (no virtual link)")
    assert "its own" not in [line for line in text.splitlines() if line.startswith("run:")][0]
    assert subtree(status, "run")["own_latest"] == []
    assert subtree(status, "ds/global_step2")["own_latest"] == ["ds"]  # its run directory
    assert subtree(status, "ds")["own_latest"] == ["ds"]


def test_waiting_steps_and_a_lone_node_are_warnings() -> None:
    text = format_status(document(
        step("r/step_1", 1, "writing", waiting_for="files named by its .metadata"),
        step("r/step_2", 2, "writing", waiting_for="space: the RAM tier is full"),
        step("r/step_3", 3, "writing", waiting_for="open writers"), persist=False), now_ns=NOW)
    lines = text.splitlines()
    assert "warning: r/step_1: its commit waits for files named by its .metadata" in lines
    assert "warning: r/step_2: its commit waits for space: the RAM tier is full" in lines
    assert "warning: r/step_3: its commit waits for open writers" in lines
    assert ("warning: 3 steps exist only in this node's RAM (3 being written; there is no "
            "persistent tier (--persist) and no peer): r/step_1, r/step_2, r/step_3") in lines
    assert "r: 3 steps, 3.0 KiB; nothing committed yet; oldest only in RAM step_1 (writing)" \
        in lines


def test_the_nodes_line_and_a_warning_for_each_peer_whose_handshake_fails() -> None:
    status = document(step("r/step_1", 1, persisted=True))
    status["peers"] = [
        {"node_id": "n1", "addr": "10.0.0.2:7070", "up": True, "state": "up"},
        {"node_id": "n2", "addr": "10.0.0.3:7070", "up": True, "state": "up, refused (token)",
         "link_error": "node 'n2' does not know the cluster token"},
        {"node_id": "n3", "addr": "10.0.0.4:7070", "up": True, "state": "up, unreachable",
         "link_error": "connection refused"},
        {"node_id": "n4", "addr": "10.0.0.5:7070", "up": False, "state": "down"}]
    for steps in (status["steps"], []):
        status["steps"] = steps
        lines = format_status(status, now_ns=NOW).splitlines()
        assert ("nodes: n1 (10.0.0.2:7070) up; n2 (10.0.0.3:7070) up, refused (token); "
                "n3 (10.0.0.4:7070) up, unreachable; n4 (10.0.0.5:7070) down") in lines
        assert [line for line in lines if line.startswith("warning:")] == [
            "warning: node n2 at 10.0.0.3:7070 is up, refused (token): node 'n2' does not know "
            "the cluster token; the steps only it holds are not `latest` here until their "
            "files can be read",
            "warning: node n3 at 10.0.0.4:7070 is up, unreachable: connection refused; the "
            "steps only it holds are not `latest` here until their files can be read"]


def test_nothing_to_warn_about_and_no_steps() -> None:
    text = format_status(document(step("r/1", 1, persisted=True)), now_ns=NOW)
    assert "warning" not in text
    assert format_status(document()).splitlines()[-1] == "no step directories yet"
    empty = subtree(document(step("r/1", 1)), "other")
    assert format_status(empty).splitlines()[-1] == "no steps under other"


def test_steps_not_in_the_store_say_why_and_since_when() -> None:
    """A step whose upload fails is a warning with its reason and how long it has failed; the
    persistent tier's line says what waits (and "new store" for a store this mount found
    empty); `tierfs umount` tells the steps only in RAM from those peers hold."""
    unavailable = "the store file:///s is unavailable: /s is missing"
    doc = document(
        step("r/step_1", 1, persist_wait={"reason": unavailable, "since_ns": NOW - 65 * 10**9,
                                          "failures": 4}),
        step("r/step_2", 2, replicas=("n1",),
             persist_wait={"reason": "queued", "since_ns": NOW, "failures": 0}),
        step("r/step_3", 3, persisted=True))
    doc["persist"].update(pending_steps=2, pending_bytes=2048, new_store=True)
    lines = format_status(doc, now_ns=NOW).splitlines()
    assert lines[2] == "persistent tier file:///s (new store): 2 steps (2.0 KiB) not in it yet"
    assert (f"warning: 1 step is not yet in file:///s: r/step_1 (failing for 1m05s: "
            f"{unavailable})") in lines
    alone, held = store_lines(doc)
    assert alone is not None and alone.startswith(
        "1 committed step is only in this node's RAM, not in file:///s: r/step_1 (failing for ")
    assert held == "1 committed step is not in file:///s yet (peers hold copies): r/step_2 " \
        "(queued)"
    assert store_lines(document(step("r/step_3", 3, persisted=True))) == (None, None)


def test_subtree_is_the_path_below_or_the_step_around() -> None:
    assert in_subtree("run1/step_1", ".")
    assert in_subtree("run1/step_1", "run1")
    assert in_subtree("run1/step_1", "run1/step_1")
    assert in_subtree("run1/step_1", "run1/step_1/mp_rank_00/model.pt")
    assert not in_subtree("run1/step_1", "run")  # a name prefix is not a directory
    assert not in_subtree("run1/step_1", "run1/step_10")
    doc = subtree(document(step("a/step_1", 1), step("b/step_1", 1)), "b")
    assert [s["path"] for s in doc["steps"]] == ["b/step_1"] and doc["subtree"] == "b"
    assert doc["node_id"] == "n0" and doc["persist"]["url"] == "file:///s"  # keys kept


def test_ages_and_the_uncommitted_line() -> None:
    assert [human_age(s) for s in (-1, 0, 59.9, 60, 3599, 3600, 86399, 90000)] == [
        "0s", "0s", "59s", "1m00s", "59m59s", "1h00m", "23h59m", "1d01h"]
    assert uncommitted(document(step("r/1", 1))) is None
    line = uncommitted(document(*[step(f"r/{n}", n, "writing") for n in range(7)],
                                step("r/w", 9, "writing", waiting_for="its .metadata")))
    assert line.startswith("8 steps are not committed, so in no tier but this node's RAM: r/0, r/1")
    assert line.endswith("and 3 more")


def test_what_flush_gives_up_on_among_the_steps_being_written() -> None:
    """A step with a file held open for writing (seen so for a while), one that never commits
    by itself, and one due after the flush's deadline cannot be waited for; one due before
    it, one that waits for what may come, and a file open a moment only, can."""
    def writing(path: str, **outlook: Any) -> dict[str, Any]:
        return dict(step(path, 1, "writing"), commit_outlook={
            "due_ns": None, "reason": None, "files": [], **outlook})

    soon = writing("r/due_soon", kind="due", due_ns=NOW + 3 * 10**9)
    late = writing("r/due_late", kind="due", due_ns=NOW + 600 * 10**9)
    held = writing("r/held", kind="writers", files=["model.pt"])
    moment = writing("r/moment", kind="writers", files=["a.pt"])
    never = writing("r/never", kind="never", reason="the rest of its save")
    waits = writing("r/waits", kind="waits", reason="files named by its .metadata")
    steps = [soon, late, held, moment, never, waits]
    assert cannot_commit(steps, NOW + 60 * 10**9, {"r/held"}) == [late, held, never]
    assert cannot_commit(steps, float("inf"), set()) == [never]
    assert commit_waits(steps, NOW) == (
        "r/due_late (commits by itself in 10m00s), r/due_soon (commits by itself in 3s), "
        "r/held (files open for writing: model.pt), r/moment (files open for writing: a.pt), "
        "r/never (does not commit by itself: it waits for the rest of its save) and 1 more")


def test_status_of_a_path_through_a_mount(mounts: MountFactory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    mnt = mounts.mount("--persist", f"file://{store}", "--commit-idle", "600")
    write(mnt / "run1/step_1/model.pt", b"one")
    (mnt / "run1/step_2").mkdir()  # the next step: step_1 commits
    write(mnt / "run1/step_2/model.pt", b"two")  # quiet, but --commit-idle is long
    write(mnt / "run2/step_7/.metadata", b"meta")  # committed at once
    write(mnt / "run3/step_1/__0_0.distcp", b"shard")  # a DCP save cut short: waits for
    write(mnt / "run3/step_2/.metadata", b"meta")  # its .metadata, also past the next step
    flushed = tierfs("flush", str(mnt.mountpoint), "--timeout", "60", check=False)
    assert flushed.returncode == 1 and "2 steps are not committed" in flushed.stderr, \
        flushed.stderr  # the committed ones are in the store; these two are in no tier

    text = tierfs("status", str(mnt / "run1")).stdout
    table = rows(text)
    assert sorted(table) == ["run1/step_1", "run1/step_2"]
    assert table["run1/step_1"][2] == "committed" and table["run1/step_1"][-2:] == ["<-",
                                                                                    "latest"]
    assert table["run1/step_2"][2] == "writing"
    assert any(line.startswith("run1: 2 steps, 6 B; newest committed step_1 (")
               and line.endswith("oldest only in RAM step_2 (writing)")
               for line in text.splitlines()), text
    assert ("warning: 1 step exists only in this node's RAM (1 being written): run1/step_2"
            in text.splitlines())
    everything = tierfs("status", str(mnt.mountpoint)).stdout
    assert "warning: run3/step_1: its commit waits for its .metadata" in everything
    assert sorted(rows(everything)) == ["run1/step_1", "run1/step_2", "run2/step_7",
                                        "run3/step_1", "run3/step_2"]

    for path, expected in [("run1/step_2", "run1/step_2"), ("run2/latest", "run2/step_7"),
                           ("run2/step_7/.metadata", "run2/step_7")]:
        doc = json.loads(tierfs("status", str(mnt / path), "--json").stdout)
        assert [s["path"] for s in doc["steps"]] == [expected], path
        assert doc["pid"] == mnt.pid and doc["node_id"]  # the other keys stay
    assert doc["subtree"] == "run2/step_7/.metadata"
    doc = json.loads(tierfs("status", str(mnt / "run1"), "--json").stdout)
    by_path = {s["path"]: s for s in doc["steps"]}
    assert isinstance(by_path["run1/step_2"]["changed_ns"], int)
    assert isinstance(by_path["run1/step_1"]["committed_ns"], int)

    # umount --flush commits the quiet step_2 first, persists it, then names what is left.
    done = tierfs("umount", str(mnt.mountpoint), "--flush")
    assert "1 step is not committed, so in no tier but this node's RAM: run3/step_1 (waits for " \
        "its .metadata" in done.stderr, done.stderr
    assert "run1/step_2" not in done.stderr
    assert (store / "run1/step_2/model.pt").read_bytes() == b"two"
    assert not (store / "run3/step_1").exists()
    again = mounts.remount(mnt)
    assert again.step("run1/step_2")["state"] == "committed"


def test_an_incomplete_step_is_not_latest_and_gets_a_warning_naming_what_is_lost() -> None:
    lost = {"files": 4, "since_ns": NOW - 12 * 10**9,
            "shown": [{"name": f"__1_{i}.distcp", "holders": ["node1"],
                       "why": "lost with node1 before its copies were made"}
                      for i in range(4)]}
    incomplete = dict(step("run/step_20", 20, replicas=("node0",)), state="incomplete",
                      lost=lost)
    status = document(step("run/step_10", 10, replicas=("node1",)), incomplete)
    text = format_status(status, now_ns=NOW)
    table = rows(text)
    assert table["run/step_10"][-1] == "latest" and table["run/step_20"][2] == "incomplete"
    assert ("warning: run/step_20 is incomplete (for 12s): 4 files are on no live node and "
            "in no store: __1_0.distcp (lost with node1 before its copies were made); "
            "__1_1.distcp (lost with node1 before its copies were made); __1_2.distcp (lost "
            "with node1 before its copies were made); and 1 more; `latest` skips it until a "
            "holder returns") in text.splitlines()
    assert uncommitted(status) is None  # committed, only not whole: not "uncommitted"


def test_a_cluster_step_shows_its_spread_and_warns_only_when_it_is_only_here() -> None:
    """In a cluster a committed step's TIERS and the "only in RAM" warning come from the
    records of its files (`tiers`, `only_here`): a multi-node step spread over four nodes,
    read back here, is not only here; the spread is shown as the records say."""
    from tierfs.fs.tree import holders

    files = {"__0_0.distcp": {"node0", "node1"}, "__1_0.distcp": {"node1", "node2"},
             "__2_0.distcp": {"node2", "node3"}, "__3_0.distcp": {"node3", "node0"}}
    spread = holders.spread(files, lambda _node: True)
    assert spread.tiers(persisted=False) == "peer:node0-3 (2 copies each)"
    assert (spread.copies, spread.holders, spread.whole) == (
        2, ("node0", "node1", "node2", "node3"), ())
    whole = holders.spread({"a": {"node0", "node1"}, "b": {"node1", "node0"}},
                           lambda node: node != "node1")
    assert whole.tiers(persisted=True) == "peer:node0,node1,persist" and whole.copies == 1
    short = holders.spread({"a": {"n1"}, "b": {"n1", "n2", "x"}}, lambda _node: True)
    assert short.tiers(persisted=False) == "peer:n1,n2,x (1-3 copies)"
    assert holders.spread({"a": set()}, lambda _node: True).tiers(persisted=False) == "-"
    assert holders.node_ranges(["node10", "node9", "node8", "a", "node2", "node3"]) == \
        "a,node2,node3,node8-10"

    read_back = step("r/step_1", 1, replicas=()) | {
        "tiers": spread.tiers(persisted=False), "only_here": False}
    alone = step("r/step_2", 2) | {"tiers": "peer:node0", "only_here": True}
    text = format_status(document(read_back, alone), now_ns=NOW)
    assert rows(text)["r/step_1"][8:12] == ["peer:node0-3", "(2", "copies", "each)"]
    assert ("warning: 1 step exists only in this node's RAM (1 committed, not yet persisted "
            "or replicated): r/step_2") in text.splitlines()
