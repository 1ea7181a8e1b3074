"""The workload of the partition suite: a real multi-rank DCP job (tests/faults/dcp_job.py, gloo
on loopback: the job's own fabric is not the one faulted) saving and loading steps on the
mounts of a cluster in network namespaces, plain file operations on the mounts (delete, rename),
a watcher of every node's `latest`, and the final reads; each recorded in a `History`.

Ranks are placed on nodes round robin (rank r on node r % N) and save there; a load names the
node whose mount every rank reads from, so most of what a load reads was written on another
node (fetched from the writer or a replica).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.conftest import Mount, free_port, getxattr
from tests.faults.conftest import file_hash
from tests.faults.history import History

READY_TIMEOUT = 240  # torch's import and gloo's start, 4 ranks on a loaded 2-core machine


class Job:
    """The rank processes of one gloo job; commands go to every rank (a collective) or to one
    (`verify`), answers come back by id."""

    def __init__(self, workdir: Path, world: int, roots: list[Path]) -> None:
        script = Path(__file__).with_name("dcp_job.py")
        port = str(free_port())
        self.ranks: list[subprocess.Popen[str]] = []
        self.answers: list[queue.Queue[dict[str, Any]]] = []
        self.next_id = 0
        self.logs = [workdir / f"rank{rank}.log" for rank in range(world)]
        for rank in range(world):
            with open(self.logs[rank], "w") as log:
                proc = subprocess.Popen([sys.executable, str(script), str(rank), str(world), port,
                                         *map(str, roots)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, text=True,
                                        bufsize=1)
            self.ranks.append(proc)
            self.answers.append(queue.Queue())
            threading.Thread(target=self._read, args=(proc, self.answers[-1]),
                             daemon=True).start()
        for rank in range(world):
            self._answer(rank, 0, READY_TIMEOUT)

    @staticmethod
    def _read(proc: subprocess.Popen[str], answers: queue.Queue[dict[str, Any]]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                answers.put(json.loads(line))
        answers.put({"id": -1, "eof": True})

    def _answer(self, rank: int, command_id: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = self.answers[rank].get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"rank {rank}: no answer to command {command_id} within "
                                     f"{timeout} s") from None
            if answer.get("eof"):
                raise AssertionError(f"rank {rank} exited: {self.logs[rank].read_text()[-3000:]}")
            if answer["id"] == command_id:
                return answer

    def _send(self, rank: int, command: dict[str, Any]) -> None:
        stdin = self.ranks[rank].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def collective(self, timeout: float, **command: Any) -> list[dict[str, Any]]:
        """Every rank's answer to one command all ranks run together."""
        self.next_id += 1
        for rank in range(len(self.ranks)):
            self._send(rank, {**command, "id": self.next_id})
        return [self._answer(rank, self.next_id, timeout) for rank in range(len(self.ranks))]

    def one(self, rank: int, timeout: float, **command: Any) -> dict[str, Any]:
        self.next_id += 1
        self._send(rank, {**command, "id": self.next_id})
        return self._answer(rank, self.next_id, timeout)

    def close(self) -> None:
        for proc in self.ranks:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def step_number(link: str | None) -> int | None:
    """step_30 -> 30; None for no link."""
    if not link:
        return None
    digits = "".join(ch for ch in link.rsplit("_", 1)[-1] if ch.isdigit())
    return int(digits) if digits else None


class LatestWatcher:
    """Reads every node's `RUN/latest` every `interval` s in a thread of its own; each change
    becomes a `latest` event."""

    def __init__(self, history: History, nodes: dict[str, Mount], run: str,
                 interval: float = 0.2) -> None:
        self.history = history
        self.nodes = nodes
        self.run = run
        self.interval = interval
        self._stop = threading.Event()
        self._seen: dict[str, str | None] = {}
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self.reads = 0

    def __enter__(self) -> LatestWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for node_id, mount in list(self.nodes.items()):
                try:
                    link: str | None = os.readlink(mount / self.run / "latest")
                except OSError:
                    link = None
                self.reads += 1
                if node_id not in self._seen or self._seen[node_id] != link:
                    self._seen[node_id] = link
                    self.history.add("latest", "latest", {"node": node_id, "link": link})
            self._stop.wait(self.interval)


def read_step(step_dir: Path) -> tuple[str, dict[str, str]]:
    """A step's state and each file's xxh3-128 as read through the mount ("bad: ..." when it
    differs from the manifest's `user.tierfs.xxh3`, "error: ..." when it cannot be read)."""
    try:
        state = getxattr(step_dir, "user.tierfs.state")
        names = sorted(os.listdir(step_dir))
    except OSError as exc:
        return f"unreadable: {exc}", {}
    files = {}
    for name in names:
        try:
            found = file_hash(step_dir / name)
            recorded = getxattr(step_dir / name, "user.tierfs.xxh3")
        except OSError as exc:
            files[name] = f"error: {exc}"
            continue
        files[name] = found if found == recorded else f"bad: read {found}, manifest {recorded}"
    return state, files


class Workload:
    """The operations of a run, each recorded: saves and loads by the job, deletes and renames
    on a node's mount, and the reads that judge the end state."""

    def __init__(self, history: History, job: Job, nodes: dict[str, Mount],
                 node_ids: list[str], save_timeout: float) -> None:
        self.history = history
        self.job = job
        self.nodes = nodes
        self.node_ids = node_ids
        self.save_timeout = save_timeout

    def save(self, path: str, seed: int) -> bool:
        """A DCP save of every rank; ok only if every rank's dcp.save returned."""
        invoked = self.history.invoke("save", path=path, seed=seed)
        answers = self.job.collective(self.save_timeout + 120, op="save", path=path, seed=seed)
        ok = all(a["ok"] for a in answers)
        self.history.complete(
            invoked, ok, seconds=max(a["seconds"] for a in answers),
            commit_seconds=answers[0].get("commit_seconds"),
            states=[a.get("state") for a in answers],
            error="; ".join(sorted({a["error"].splitlines()[0][:300] for a in answers
                                    if not a["ok"]})))
        return ok

    def load(self, path: str, node: str, timeout: float = 180) -> bool:
        """Every rank loads its tensors from `node`'s mount (`RUN/latest` or a step)."""
        invoked = self.history.invoke("load", path=path, node=node)
        answers = self.job.collective(timeout, op="load", path=path,
                                      node=self.node_ids.index(node))
        ok = all(a["ok"] for a in answers)
        self.history.complete(
            invoked, ok, seconds=max(a["seconds"] for a in answers),
            ranks=[{"seeds": a["seeds"], "link": a["link"], "link_after": a["link_after"]}
                   for a in answers if a["ok"]],
            error="; ".join(sorted({a["error"].splitlines()[0][:300] for a in answers
                                    if not a["ok"]})))
        return ok

    def delete(self, node: str, path: str) -> bool:
        invoked = self.history.invoke("delete", path=path, node=node)
        try:
            shutil.rmtree(self.nodes[node] / path)
        except OSError as exc:
            self.history.complete(invoked, False, error=str(exc))
            return False
        self.history.complete(invoked, True)
        return True

    def rename(self, node: str, path: str, to: str) -> bool:
        invoked = self.history.invoke("rename", path=path, to=to, node=node)
        try:
            os.rename(self.nodes[node] / path, self.nodes[node] / to)
        except OSError as exc:
            self.history.complete(invoked, False, error=str(exc))
            return False
        self.history.complete(invoked, True)
        return True

    # -- the end state ------------------------------------------------------------------------

    def view(self, node: str, run: str) -> dict[str, Any]:
        """What one node shows of a run: its committed steps (path -> version), its other
        steps (path -> state) and its `latest`."""
        status = self.nodes[node].status()
        steps = [s for s in status["steps"] if s["path"].startswith(run + "/")
                 and s.get("kind", "dir") == "dir"]
        try:
            latest: str | None = os.readlink(self.nodes[node] / run / "latest")
        except OSError:
            latest = None
        return {"committed": {s["path"]: s["version"] for s in steps
                              if s["state"] == "committed"},
                "other": {s["path"]: s["state"] for s in steps if s["state"] != "committed"},
                "latest": latest}

    def settle(self, run: str, bound: float, since: float) -> float:
        """Wait until every node shows the same committed steps (and versions) and `latest`,
        none writing or incomplete; record it (`settled`) and return the seconds from `since`
        (a history time: the heal); at most `bound` s are waited beyond it."""
        deadline = time.monotonic() + bound - (self.history.now() - since) + 1
        views: dict[str, dict[str, Any]] = {}
        while True:
            views = {node: self.view(node, run) for node in self.node_ids}
            first = views[self.node_ids[0]]
            if all(v["committed"] == first["committed"] and v["latest"] == first["latest"]
                   and not v["other"] for v in views.values()):
                seconds = round(self.history.now() - since, 3)
                self.history.add("settled", "settled", {"seconds": seconds,
                                                        "latest": first["latest"],
                                                        "steps": first["committed"]})
                return seconds
            if time.monotonic() > deadline:
                self.history.add("settled", "settled", {"seconds": None, "views": views})
                return float("inf")
            time.sleep(0.25)

    def final_reads(self, run: str) -> None:
        """Every committed step of the run, read whole on every node (`verify`: the whole
        checkpoint, every rank's tensors, by one rank), and a load through `latest` on every
        node; each recorded as a `final` read."""
        paths = sorted({p for node in self.node_ids
                        for p in self.view(node, run)["committed"]})
        for index, node in enumerate(self.node_ids):
            for path in paths:
                invoked = self.history.invoke("final", path=path, node=node)
                answer = self.job.one(index % len(self.job.ranks), 180, op="verify", path=path,
                                      node=index)
                state, files = read_step(self.nodes[node] / path)
                self.history.complete(invoked, answer["ok"], seeds=answer.get("seeds", []),
                                      state=state, files=files, error=answer.get("error", ""))
            self.load(f"{run}/latest", node)
