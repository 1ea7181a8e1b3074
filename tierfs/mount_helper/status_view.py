"""`tierfs status` for a person: the steps under a path, with the age of each and the `latest`
of each run directory, one summary line per run directory, and a warning for what exists only
in this node's RAM, a step whose commit waits, one whose upload fails (why, since when), or a
committed step that cannot be read whole (`incomplete`: a file that no live node and no store
holds). The lines `tierfs flush` and `tierfs umount` print about steps not in the store are here
too.

Pure functions over the daemon's status document (`tierfs status --json`): no trio, no socket,
so they are tested from a dict. A run directory is the directory holding a step.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Iterable
from typing import Any

from tierfs.step_names import some_names

Step = dict[str, Any]
LATEST = "<- latest"
NAMED = 5  # steps named in one warning line; the rest are counted


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """12s, 5m07s, 2h05m, 3d02h: two units at most, what a glance needs."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def in_subtree(step_path: str, relpath: str) -> bool:
    """Whether a step belongs to `tierfs status PATH` for PATH at `relpath` (relative to the
    mount): the step is PATH, or below it, or PATH is inside the step."""
    return (relpath in (".", "") or step_path == relpath
            or step_path.startswith(relpath + "/") or relpath.startswith(step_path + "/"))


def subtree(status: dict[str, Any], relpath: str) -> dict[str, Any]:
    """The status document with only the steps of PATH's subtree; `subtree` names PATH."""
    return dict(status, subtree=relpath,
                steps=[s for s in status["steps"] if in_subtree(s["path"], relpath)],
                own_latest=[run for run in status.get("own_latest", ())
                            if in_subtree(run, relpath)])


def run_of(step: Step) -> str:
    return posixpath.dirname(step["path"]) or "."


def by_run(steps: Iterable[Step]) -> dict[str, list[Step]]:
    runs: dict[str, list[Step]] = {}
    for step in steps:
        runs.setdefault(run_of(step), []).append(step)
    for members in runs.values():
        members.sort(key=lambda s: (number_of(s), s["path"]))
    return runs


def number_of(step: Step) -> int:
    """A step's number for ordering: a loose file (`step` null) comes first."""
    return -1 if step["step"] is None else step["step"]


def only_in_ram(step: Step) -> bool:
    """No copy beyond this node's RAM: not committed, or committed but neither persisted nor
    replicated yet (or not selected by --persist-every, with no peer). In a cluster, a
    committed step's `only_here` says it (from the records of its files: a step whose files
    are spread over several nodes, or held by peers and read back here, is not only here)."""
    if step["state"] == "empty":
        return False  # nothing in it
    if step.get("only_here") is not None:
        return bool(step["only_here"])
    return bool(step["ram"]) and not step["persisted"] and not step["replicas"]


def latest_paths(steps: Iterable[Step], own_latest: Iterable[str] = ()) -> set[str]:
    """Per run directory, the committed step `latest` names: the highest step number (step
    directories only: file steps and loose files are never `latest`); none in the run
    directories whose `latest` is their own (`own_latest`)."""
    own = set(own_latest)
    newest: dict[str, Step] = {}
    for step in steps:
        if (step["state"] == "committed" and step.get("kind", "dir") == "dir"
                and run_of(step) not in own):
            best = newest.get(run_of(step))
            if best is None or step["step"] > best["step"]:
                newest[run_of(step)] = step
    return {step["path"] for step in newest.values()}


def step_age(step: Step, now_ns: int) -> float | None:
    """Seconds since the step was committed, or for a step being written since it last changed
    (None from a daemon that does not say)."""
    stamp = step.get("committed_ns") if step["state"] not in ("writing", "empty") else (
        step.get("changed_ns") or step.get("committed_ns"))
    return None if stamp is None else (now_ns - stamp) / 1e9


def tiers_of(step: Step, me: str = "") -> str:
    """Where the step is: in a cluster, a committed step's `tiers` (from the records of its
    files, the same on every node: `fs.tree.holders`), each copy with its failure domain when it
    has one (`ram(rack1),peer:node2(rack2)`; `me`: this node's id); else this node's RAM, the
    peers holding the whole step, and the store."""
    if step.get("tiers"):
        domains = step.get("domains") or {}
        if not domains:
            return str(step["tiers"])
        return ",".join(
            f"{tier}({domain})" if (domain := domains.get(
                me if tier == "ram" else tier.removeprefix("peer:"))) else tier
            for tier in str(step["tiers"]).split(","))
    tiers = (["ram"] if step["ram"] else []) + [f"peer:{p}" for p in step["replicas"]]
    if step["persisted"]:
        tiers.append("persist")
    return ",".join(tiers) or "-"


def table(steps: list[Step], now_ns: int, own_latest: Iterable[str] = (),
          me: str = "") -> list[str]:
    latest = latest_paths(steps, own_latest)
    rows = [("PATH", "STEP", "STATE", "VERSION", "FILES", "SIZE", "AGE", "TIERS", "")]
    for step in steps:
        age = step_age(step, now_ns)
        rows.append((step["path"], "-" if step["step"] is None else str(step["step"]),
                     step["state"], str(step["version"]),
                     str(step["files"]), human_bytes(step["bytes"]),
                     "-" if age is None else human_age(age), tiers_of(step, me),
                     LATEST if step["path"] in latest else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = {1, 3, 4, 5, 6}
    return ["  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in rows]


def run_summary(run: str, steps: list[Step], now_ns: int, own_latest: bool = False) -> str:
    """`run1: 3 steps, 1.2 MiB; newest committed step_300 (12s ago); oldest only in RAM
    step_100 (writing)`, and whether `latest` there is the run directory's own file."""
    size = sum(s["bytes"] for s in steps)
    parts = [f"{run}: {len(steps)} step{'s' if len(steps) != 1 else ''}, {human_bytes(size)}"]
    committed = [s for s in steps if s["state"] == "committed"]
    if committed:
        newest = committed[-1]
        age = step_age(newest, now_ns)
        parts.append(f"newest committed {posixpath.basename(newest['path'])}"
                     + ("" if age is None else f" ({human_age(age)} ago)"))
    else:
        parts.append("nothing committed yet")
    ram_only = [s for s in steps if only_in_ram(s)]
    if ram_only:
        oldest = ram_only[0]
        parts.append(f"oldest only in RAM {posixpath.basename(oldest['path'])} "
                     f"({oldest['state']})")
    else:
        parts.append("none only in RAM")
    if own_latest:
        parts.append("its own `latest` is in use (no virtual link)")
    return "; ".join(parts)


def names(steps: list[Step]) -> str:
    return some_names([s["path"] for s in steps], NAMED)


def warnings(status: dict[str, Any], now_ns: int) -> list[str]:
    """What a person must know: data only in this node's RAM, steps whose commit waits, steps
    whose upload fails (why, and for how long), committed steps that cannot be read whole,
    and those committed without their saver's mark of a finished save."""
    lines = []
    ram_only = [s for s in status["steps"] if only_in_ram(s)]
    if ram_only:
        writing = sum(s["state"] == "writing" for s in ram_only)
        kinds = [f"{writing} being written"] if writing else []
        if len(ram_only) > writing:
            kinds.append(f"{len(ram_only) - writing} committed, not yet persisted or replicated")
        alone = ("; there is no persistent tier (--persist) and no peer"
                 if status.get("persist") is None and not status.get("peers") else "")
        counted = "1 step exists" if len(ram_only) == 1 else f"{len(ram_only)} steps exist"
        lines.append(f"warning: {counted} only in this node's RAM ({', '.join(kinds)}{alone}): "
                     f"{names(ram_only)}")
    lines += [f"warning: {s['path']}: its commit waits for {s['waiting_for']}"
              for s in status["steps"] if s.get("waiting_for")]
    failing = [s for s in due_in_store(status) if s["persist_wait"]["failures"]]
    if failing:
        lines.append(f"warning: {steps_are(failing, 'step')} not yet in {status['persist']['url']}:"
                     f" {not_in_store(failing, now_ns)}")
    lines += [incomplete_warning(s, now_ns) for s in status["steps"]
              if s["state"] == "incomplete" and s.get("lost")]
    lines += [f"warning: {s['path']} was committed without {s['unfinished']}, which the "
              "steps before it have (its saver stopped in the middle of a save?): `latest` "
              "names an older step" for s in status["steps"] if s.get("unfinished")]
    lines += [f"warning: {s['path']} has fewer copies than --replicas asks "
              f"(for {human_age((now_ns - s['copies_wait']['since_ns']) / 1e9)}): "
              f"{s['copies_wait']['reason']}"
              for s in status["steps"] if s.get("copies_wait")]
    return ram_dir_warning(status) + lines + failing_peers(status)


FULL_SHARE = 0.9  # a RAM dir's file system this full earns a warning


def ram_dir_warning(status: dict[str, Any]) -> list[str]:
    """A warning when the RAM dir's file system is nearly full, whatever the RAM tier's own
    count says (others write to a shared /dev/shm): writes and copies from peers then find no
    room before --ram-limit."""
    ram = status["ram"]
    size, free = ram.get("fs_size_bytes"), ram.get("fs_free_bytes")
    if not size or free is None or free > (1 - FULL_SHARE) * size:
        return []
    return [f"warning: the file system of the RAM dir {status.get('ram_dir', '')} is "
            f"{100 * (size - free) / size:.0f}% full ({human_bytes(free)} free of "
            f"{human_bytes(size)}): writes, and copies from peers, find no room before the "
            "RAM tier's limit"]


def peer_state(peer: dict[str, Any]) -> str:
    """`up`, `up, refused (token)`, `up, refused (TLS)`, `up, unreachable` or `down`
    (`up`/`down` from a daemon that predates the handshake states)."""
    return str(peer.get("state") or ("up" if peer["up"] else "down"))


def nodes_line(peers: list[dict[str, Any]]) -> str:
    """`nodes: node1 (10.0.0.2:7070) up; node2 (10.0.0.3:7070, rack2) up, refused (token)`
    (a failure domain after the address)."""
    return "nodes: " + "; ".join(
        f"{p['node_id']} ({p['addr']}{', ' + p['domain'] if p.get('domain') else ''}) "
        f"{peer_state(p)}" for p in peers)


def failing_peers(status: dict[str, Any]) -> list[str]:
    """A warning for each live peer whose handshake with this node fails."""
    return [f"warning: node {p['node_id']} at {p['addr']} is {peer_state(p)}: "
            f"{p.get('link_error') or 'its peer handshake fails'}; the steps only it holds "
            f"are not `latest` here until their files can be read"
            for p in status.get("peers", ()) if peer_state(p).startswith("up, ")]


def incomplete_warning(step: Step, now_ns: int) -> str:
    """`warning: run/step_20 is incomplete (for 12s): 1 file is on no live node and in no
    store: __1_0.distcp (lost with node1 before its copies were made); `latest` skips it`."""
    lost = step["lost"]
    shown = lost["shown"]
    named = "; ".join(f"{f['name']} ({f['why']})" for f in shown[:3])
    more = f"; and {lost['files'] - 3} more" if lost["files"] > 3 else ""
    files = "1 file is" if lost["files"] == 1 else f"{lost['files']} files are"
    return (f"warning: {step['path']} is incomplete (for "
            f"{human_age((now_ns - lost['since_ns']) / 1e9)}): {files} on no live node and in "
            f"no store: {named}{more}; `latest` skips it until a holder returns")


def persist_line(persist: dict[str, Any]) -> str:
    """`persistent tier s3://b/p (new store): 2 steps (1.2 GiB) not in it yet`."""
    new = " (new store)" if persist.get("new_store") else ""
    waiting = persist["pending_steps"]
    return (f"persistent tier {persist['url']}{new}: "
            + (f"{waiting} step{'s' if waiting != 1 else ''} "
               f"({human_bytes(persist['pending_bytes'])}) not in it yet" if waiting
               else "every committed step due there is in it"))


def persist_reason(step: Step, now_ns: int) -> str:
    """Why a step due in the store is not there yet: `queued`, `uploading`, or its upload's
    last failure and for how long it has failed."""
    wait = step["persist_wait"]
    if not wait["failures"]:
        return wait["reason"]
    return f"failing for {human_age((now_ns - wait['since_ns']) / 1e9)}: {wait['reason']}"


def not_in_store(steps: list[Step], now_ns: int | None = None) -> str:
    """`run/step_1 (queued), run/step_2 (failing for 12s: ...)`: steps and why."""
    return some_names(_store_waits(steps, now_ns), NAMED)


def _store_waits(steps: list[Step], now_ns: int | None = None) -> list[str]:
    now_ns = time.time_ns() if now_ns is None else now_ns
    return [f"{s['path']} ({persist_reason(s, now_ns)})" for s in steps]


def flush_left(status: dict[str, Any]) -> str:
    """What `tierfs flush` still waits for, and why: the steps due in the store and not there
    yet, then those short of their copies on peers (`run/step_2 (copying to peers)`), then
    the deleted steps and old names of renamed ones the store still holds."""
    replication = status.get("replication") or {}
    return some_names(_store_waits(due_in_store(status))
                      + [f"{path} ({reason} to peers)"
                         for path, reason in replication.get("pending", {}).items()]
                      + [f"{path} (to leave the store)"
                         for path in (status.get("persist") or {}).get("pending_deletes", ())],
                      NAMED)


def due_in_store(status: dict[str, Any]) -> list[Step]:
    """Committed steps that --persist-every selects and the store does not hold yet."""
    return [s for s in status["steps"] if s.get("persist_wait")]


def blocked_in_store(status: dict[str, Any]) -> list[Step]:
    """Steps due in the store that can never get there whole as things are (a file on no
    live node and not in the store): a flush waiting for them waits for nothing."""
    return [s for s in due_in_store(status) if s["persist_wait"].get("blocked")]


def ram_only_committed(status: dict[str, Any]) -> list[Step]:
    """Committed steps due in the store that no other tier holds: not in the store, and no
    peer holds a copy of every file (in a cluster, a step held by peers too is safe there)."""
    return [s for s in due_in_store(status) if _no_peer_copy(s)]


def _no_peer_copy(step: Step) -> bool:
    """Of a committed step: no peer holds a copy of some file of it (`only_here` in a
    cluster; else no peer holds every file)."""
    if step.get("only_here") is not None:
        return bool(step["only_here"])
    return not step["replicas"]


def store_lines(status: dict[str, Any]) -> tuple[str | None, str | None]:
    """For `tierfs umount`: one line naming the committed steps that exist only in this node's
    RAM, and one naming those the store lacks but peers hold (None where there are none)."""
    url = status["persist"]["url"] if status.get("persist") else ""
    alone = ram_only_committed(status)
    held = [s for s in due_in_store(status) if not _no_peer_copy(s)]
    return ((f"{steps_are(alone, 'committed step')} only in this node's RAM, not in {url}: "
             f"{not_in_store(alone)}") if alone else None,
            (f"{steps_are(held, 'committed step')} not in {url} yet (peers hold copies): "
             f"{not_in_store(held)}") if held else None)


def steps_are(steps: list[Step], what: str) -> str:
    """`1 step is`, `3 steps are` (`what` in place of step)."""
    return f"1 {what} is" if len(steps) == 1 else f"{len(steps)} {what}s are"


def uncommitted(status: dict[str, Any]) -> str | None:
    """One line naming the steps that are not committed (for flush and umount), or None."""
    writing = [s for s in status["steps"] if s["state"] == "writing"]
    if not writing:
        return None
    named = [s["path"] + (f" (waits for {s['waiting_for']})" if s.get("waiting_for") else "")
             for s in writing]
    return (f"{steps_are(writing, 'step')} not committed, so in no tier but this node's RAM: "
            f"{some_names(named)}")


def being_written(status: dict[str, Any]) -> list[Step]:
    """The steps (and loose files) not committed: in no tier but this node's RAM."""
    return [s for s in status["steps"] if s["state"] == "writing"]


def commit_wait(step: Step, now_ns: int) -> str:
    """When a step being written commits by itself, from its `commit_outlook`:
    `commits by itself in 3s`, `files open for writing: a.pt`, `waits for ...`."""
    outlook = step.get("commit_outlook") or {}
    kind = outlook.get("kind")
    if kind == "due":
        left = (outlook["due_ns"] - now_ns) / 1e9
        return ("commits by itself in " + human_age(left)) if left >= 1 else \
            "commits by itself now"
    if kind == "writers":
        return f"files open for writing: {some_names(outlook['files'], 3)}"
    if kind == "never":
        return f"does not commit by itself: it waits for {outlook['reason']}"
    reason = outlook.get("reason") or step.get("waiting_for")
    return f"waits for {reason}" if reason else "being written"


def cannot_commit(writing: list[Step], deadline_ns: float, held_open: set[str]
                  ) -> list[Step]:
    """The steps being written that `tierfs flush` cannot see committed: a file of them held
    open for writing (`held_open`: the paths of steps seen so for a while), none that commits
    by itself (a save cut short), or none before `deadline_ns` (--commit-idle after their
    last change is later). Those that wait for something that may come are not here."""
    stuck = []
    for step in writing:
        outlook = step.get("commit_outlook") or {}
        kind = outlook.get("kind")
        if (kind == "never" or (kind == "writers" and step["path"] in held_open)
                or (kind == "due" and outlook["due_ns"] > deadline_ns)):
            stuck.append(step)
    return stuck


def commit_waits(steps: list[Step], now_ns: int | None = None) -> str:
    """`run/step_2 (commits by itself in 3s), ...`: steps being written and when they commit."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    return some_names([f"{s['path']} ({commit_wait(s, now_ns)})" for s in steps], NAMED)


def format_status(status: dict[str, Any], now_ns: int | None = None) -> str:
    """The human form of `tierfs status [PATH]`."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    ram = status["ram"]
    share = 100 * ram["used_bytes"] / max(ram["limit_bytes"], 1)
    domain = f" (failure domain {status['failure_domain']})" if status.get(
        "failure_domain") else ""
    lines = [f"tierfs at {status['mountpoint']}  node {status['node_id']}{domain}  "
             f"pid {status['pid']}",
             f"RAM tier {human_bytes(ram['used_bytes'])} of {human_bytes(ram['limit_bytes'])} "
             f"({share:.0f}%) in {status.get('ram_dir', '?')}; file data "
             + ("passes straight to it (FUSE passthrough)" if status.get("passthrough")
                else "goes through the daemon")]
    if status.get("persist"):
        lines.append(persist_line(status["persist"]))
    if status.get("peers"):
        lines.append(nodes_line(status["peers"]))
    where = status.get("subtree", ".")
    steps = status["steps"]
    if not steps:
        lines.append("no step directories yet" if where == "." else f"no steps under {where}")
        return "\n".join(lines + ram_dir_warning(status) + failing_peers(status))
    own = set(status.get("own_latest", ()))
    lines += table(steps, now_ns, own, status["node_id"])
    lines += [run_summary(run, members, now_ns, run in own)
              for run, members in by_run(steps).items()]
    lines += warnings(status, now_ns)
    return "\n".join(lines)
