"""The checker of the partition suite: what a history (tests/faults/history.py) must satisfy.
Pure functions over the events; `check` returns the violations, each one line a person can
act on, and the counts a run reports.

Properties (doc/RELIABILITY.md lists them for users):

1. *An acknowledged save is committed*: a save that returned success on every rank shows its
   step `committed` on rank 0's node (the node that committed it) when `dcp.save` returns
   (or `incomplete`, committed with a file on a node it cannot reach, while a cut touches
   it).
2. *An acknowledged save survives*: after the faults heal and the cluster settles, every step
   whose last acknowledged operation was a save is listed committed on every node and reads
   back whole, with the saved tensors (every rank's, in one process: `verify`) and the same
   bytes on every node, matching the manifest's hashes. A step acknowledged deleted or renamed
   away is listed nowhere.
3. *No wrong bytes, ever*: every load that returned success read, on each rank, the tensors of
   one save of the step it read (`latest` resolved before and after the load), never a mix
   of two saves nor bytes of none; and every rank read the same save (a job that resumes
   some ranks from one step and others from another trains on a model that never was).
4. *Loads work outside faults*: a load may fail only while a cut (a drop or partition) touches
   the node it reads through, or within the settle bound after that cut healed; delay, loss
   and rate limits slow loads down but do not make them fail.
5. *`latest` never goes back*: on each node the step number `latest` names never decreases,
   except while a cut touches that node (a step it cannot read whole is skipped: documented),
   or after the step it named was deleted or renamed away.
6. *Every node agrees within the bound*: after every heal, every node lists the same committed
   steps (and versions) and the same `latest`, none writing or incomplete, within `settle`
   seconds; at the end `latest` names the newest committed step.
7. *A saver's call is bounded*: the call that commits (rank 0's `finish`: `.metadata`'s
   write and rename) returns, with success or an error the saver sees, within `commit`
   seconds (`--commit-timeout` and a little scheduling), and the whole save within `save`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.faults.history import Event, History

ABSENT = None  # a path with no committed step


@dataclass(frozen=True)
class Bounds:
    """The documented bounds a run is held to (seconds; doc/CLUSTER.md, "Bounds")."""

    settle: float  # every node agrees after a heal
    commit: float  # the saver's call that commits
    save: float  # a whole dcp.save


@dataclass
class Windows:
    """When a cut touched each node: (start, end) with end = heal + settle bound."""

    cuts: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))

    def disturbed(self, node: str, start: float, end: float | None = None) -> bool:
        """Whether a cut touched `node` at some time in [start, end]."""
        end = start if end is None else end
        return any(a <= end and start <= b for a, b in self.cuts.get(node, []))


def fault_windows(history: History, settle: float) -> Windows:
    windows = Windows()
    started: dict[int, Event] = {}
    for event in history.events:
        if event.kind != "nemesis":
            continue
        if event.op == "start":
            started[event.value["fault_id"]] = event
        else:
            begun = started.pop(event.value["fault_id"])
            for node in begun.value.get("cut", []):
                windows.cuts[node].append((begun.time, event.time + settle))
    for begun in started.values():  # never healed: disturbed to the end
        for node in begun.value.get("cut", []):
            windows.cuts[node].append((begun.time, float("inf")))
    return windows


def step_number(path: str | None) -> int | None:
    if not path:
        return None
    digits = "".join(ch for ch in path.rsplit("/", 1)[-1].rsplit("_", 1)[-1] if ch.isdigit())
    return int(digits) if digits else None


@dataclass
class Model:
    """What each step path may hold: the seeds of the saves that may be there, ABSENT if none
    may be (`now`), and every seed that was ever written there (`ever`)."""

    run: str
    now: dict[str, set[int | None]] = field(default_factory=lambda: defaultdict(lambda: {ABSENT}))
    ever: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))

    def apply(self, event: Event) -> None:
        value, ok = event.value, event.kind == "ok"
        path = value.get("path", "")
        if event.op == "save":
            self.now[path] = {value["seed"]} if ok else self.now[path] | {value["seed"]}
            self.ever[path].add(value["seed"])
        elif event.op == "delete":
            self.now[path] = {ABSENT} if ok else self.now[path] | {ABSENT}
        elif event.op == "rename":
            moved = self.now[path] - {ABSENT}
            self.ever[value["to"]] |= moved
            if ok:
                self.now[value["to"]] = set(self.now[path])
                self.now[path] = {ABSENT}
            else:
                self.now[value["to"]] = self.now[value["to"]] | self.now[path]
                self.now[path] = self.now[path] | {ABSENT}

    def resolve(self, link: str | None) -> str:
        """The step path a `latest` link names."""
        return f"{self.run}/{link}" if link else ""


def check(history: History, nodes: list[str], run: str, bounds: Bounds
          ) -> tuple[list[str], dict[str, Any]]:
    """The violations of the history, and its counts."""
    settle = bounds.settle
    windows = fault_windows(history, settle)
    model = Model(run)
    violations: list[str] = []
    counts: dict[str, Any] = defaultdict(int)
    moved: dict[str, float] = {}  # path -> when a delete or rename of it was first invoked
    last_latest: dict[str, tuple[float, str | None]] = {}
    invoked: dict[int, Event] = {}
    for event in history.events:
        value = event.value
        if event.kind == "invoke":
            counts["operations"] += 1
            invoked[event.id] = event
            if event.op in ("delete", "rename"):
                moved.setdefault(value["path"], event.time)
            continue
        if event.kind == "nemesis":
            counts["faults_applied" if event.op == "start" else "faults_healed"] += 1
            continue
        if event.kind == "settled":
            counts["settles"] += 1
            seconds = value["seconds"]
            if seconds is None or seconds > settle:
                violations.append(f"the nodes did not agree within {settle} s of a heal "
                                  f"(t={event.time}): {value.get('views')}")
            else:
                counts["settle_seconds_max"] = max(counts["settle_seconds_max"], seconds)
            continue
        if event.kind == "latest":
            violations += _latest_step(event, last_latest, moved, windows)
            continue
        start = invoked[event.id].time
        if event.op == "save":
            violations += _save(event, bounds, counts,
                                windows.disturbed(nodes[0], start, event.time))
        elif event.op == "load":
            violations += _load(event, start, model, windows, counts)
        elif event.op == "final":
            continue  # judged below, against the model after every operation
        model.apply(event)
    violations += _final(history, model, nodes, counts)
    return violations, dict(counts)


def _save(event: Event, bounds: Bounds, counts: dict[str, Any], cut: bool) -> list[str]:
    """`cut`: a cut touched rank 0's node during the save (its step may then be committed but
    `incomplete` there: a file of it only on a node it cannot reach)."""
    value = event.value
    found = []
    counts["saves_ok" if event.kind == "ok" else "saves_failed"] += 1
    counts["save_seconds_max"] = max(counts["save_seconds_max"], value["seconds"])
    commit = value.get("commit_seconds") or 0.0
    counts["commit_seconds_max"] = max(counts["commit_seconds_max"], commit)
    if commit > bounds.commit:
        found.append(f"save of {value['path']}: the call that commits (.metadata) blocked "
                     f"{commit} s (bound {bounds.commit} s; t={event.time})")
    if value["seconds"] > bounds.save:
        found.append(f"save of {value['path']} blocked {value['seconds']} s (bound "
                     f"{bounds.save} s; t={event.time})")
    allowed = ("committed", "incomplete") if cut else ("committed",)
    if event.kind == "ok" and value["states"][0] not in allowed:
        found.append(f"save of {value['path']} returned success on every rank but its step "
                     f"is {value['states'][0]} on rank 0's node (t={event.time}; every "
                     f"rank's node: {value['states']})")
    return found


def _load(event: Event, start: float, model: Model, windows: Windows,
          counts: dict[str, Any]) -> list[str]:
    value = event.value
    node = value["node"]
    # how long a load blocked (reported, not bounded: a read whose holders are cut off waits
    # for each of them, doc/RELIABILITY.md)
    counts["load_seconds_max"] = max(counts["load_seconds_max"], value.get("seconds", 0.0))
    if event.kind == "fail":
        if windows.disturbed(node, start, event.time):
            counts["loads_failed_in_cuts"] += 1
            return []
        return [f"load of {value['path']} through {node} failed outside any cut of {node} "
                f"(t={start}-{event.time}): {value['error']}"]
    counts["loads_ok"] += 1
    found = []
    for rank, answer in enumerate(value["ranks"]):
        seeds = answer["seeds"]
        if value["path"].endswith("/latest"):
            paths = {model.resolve(answer["link"]), model.resolve(answer["link_after"])}
        else:
            paths = {value["path"]}
        if len(seeds) != 1 or seeds[0] < 0:
            found.append(f"load of {value['path']} through {node}: rank {rank} read mixed or "
                         f"wrong bytes (seeds {seeds}, t={event.time})")
        elif not any(seeds[0] in model.ever[p] for p in paths):
            found.append(f"load of {value['path']} through {node}: rank {rank} read the save "
                         f"of seed {seeds[0]}, never saved at {sorted(paths)} (t={event.time})")
    read = {tuple(answer["seeds"]) for answer in value["ranks"]}
    if len(read) > 1:
        found.append(f"load of {value['path']} through {node}: its ranks read different saves "
                     f"(seeds {[a['seeds'] for a in value['ranks']]}, t={event.time})")
    steps = {step for answer in value["ranks"] for step in answer.get("read_from", [])}
    if len(steps) > 1:
        found.append(f"load of {value['path']} through {node}: its files came from "
                     f"{len(steps)} steps (ranks' .metadata and shards from "
                     f"{[a.get('read_from') for a in value['ranks']]}, t={event.time})")
    return found


def _latest_step(event: Event, last: dict[str, tuple[float, str | None]],
                 moved: dict[str, float], windows: Windows) -> list[str]:
    node, link = event.value["node"], event.value["link"]
    previous = last.get(node)
    last[node] = (event.time, link)
    if previous is None or previous[1] is None:
        return []
    before, now = step_number(previous[1]), step_number(link)
    if now is not None and before is not None and now >= before:
        return []
    path = previous[1]
    if windows.disturbed(node, previous[0], event.time):
        return []
    if any(p.endswith("/" + path) and t <= event.time for p, t in moved.items()):
        return []
    return [f"latest on {node} went back from {previous[1]} to {link} at t={event.time} "
            f"with no cut of {node} and no delete or rename of {path}"]


def _final(history: History, model: Model, nodes: list[str],
           counts: dict[str, Any]) -> list[str]:
    settled = [e for e in history.events if e.kind == "settled"]
    if not settled or settled[-1].value["seconds"] is None:
        return ["the run ended without every node agreeing (no final settle)"]
    listed = settled[-1].value["steps"]
    found = []
    for path, possible in sorted(model.now.items()):
        if path not in listed and ABSENT not in possible:
            found.append(f"{path}: acknowledged (may hold seeds {sorted(possible)}) but "
                         f"listed committed on no node at the end: lost")
        if path in listed and possible == {ABSENT}:
            found.append(f"{path}: acknowledged deleted or renamed away, yet listed at the end")
    reads: dict[str, dict[str, dict[str, str]]] = defaultdict(dict)
    for event in history.events:
        if event.op != "final" or event.kind == "invoke":
            continue
        path, node, value = event.value["path"], event.value["node"], event.value
        counts["final_reads"] += 1
        if model.now[path] != {ABSENT}:
            counts["acknowledged_steps_checked"] += int(ABSENT not in model.now[path])
        reads[path][node] = value["files"]
        allowed = model.now[path] - {ABSENT}
        if event.kind == "fail" or value["state"] != "committed":
            found.append(f"{path} on {node}: listed committed but reads "
                         f"{value['state']}: {value['error']}")
        elif len(value["seeds"]) != 1 or value["seeds"][0] not in allowed:
            found.append(f"{path} on {node}: holds seeds {value['seeds']}, expected one of "
                         f"{sorted(allowed)}")
        bad = {n: h for n, h in value["files"].items() if h.startswith(("bad:", "error:"))}
        if bad:
            found.append(f"{path} on {node}: {bad}")
    for path, by_node in sorted(reads.items()):
        if len({tuple(sorted(files.items())) for files in by_node.values()}) > 1:
            found.append(f"{path}: nodes read different bytes: {by_node}")
        missing = set(nodes) - set(by_node)
        if missing:
            found.append(f"{path}: not read on {sorted(missing)}")
    newest = max(listed, key=lambda p: step_number(p) or -1, default=None)
    final_loads = [e for e in history.events if e.op == "load" and e.kind != "invoke"
                   and e.time >= settled[-1].time]
    for event in final_loads:
        if event.kind == "fail":
            found.append(f"at the end, a load through latest on {event.value['node']} "
                         f"failed: {event.value['error']}")
            continue
        links = {a["link"] for a in event.value.get("ranks", [])}
        if newest is not None and links != {newest.rsplit("/", 1)[-1]}:
            found.append(f"at the end, latest on {event.value['node']} names {links}, the "
                         f"newest committed step is {newest}")
    return found
