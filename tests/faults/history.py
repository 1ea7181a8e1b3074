"""The history of a fault run, in the manner of Jepsen: every operation's invocation and its
outcome, every fault applied and healed, and what each node's `latest` named over time, each
with the time it happened (seconds since the run began). The checker (tests/faults/checker.py)
judges a history; a failing run's history is written next to its counts, so it can be read
(and the run replayed from its seed).

Event kinds:
    invoke  an operation began:        {"op": "save", "path", "seed"} / "load" / "delete" /
                                        "rename" {"path", "to"}
    ok      it returned success:       the same fields and its results
    fail    it returned an error:      the same fields and "error"
    nemesis a fault applied or healed: {"op": "start"/"stop", "fault": "...", "cut": [nodes]}
    latest  a node's `latest` seen:    {"node", "link"} (None: no latest)
    settled every node agreed again:   {"seconds": time from the heal, "latest": ..., "steps"}
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Event:
    time: float
    kind: str  # invoke, ok, fail, nemesis, latest, settled
    op: str
    value: dict[str, Any] = field(default_factory=dict)
    id: int = 0  # pairs an invoke with its outcome


class History:
    """Events in the order they happened; safe to add to from several threads."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._next_id = 0

    def now(self) -> float:
        return round(time.monotonic() - self._start, 3)

    def add(self, kind: str, op: str, value: dict[str, Any] | None = None, id: int = 0
            ) -> Event:
        with self._lock:
            event = Event(self.now(), kind, op, dict(value or {}), id)
            self.events.append(event)
            return event

    def invoke(self, op: str, **value: Any) -> Event:
        with self._lock:
            self._next_id += 1
            event = Event(self.now(), "invoke", op, value, self._next_id)
            self.events.append(event)
            return event

    def complete(self, invoked: Event, ok: bool, **value: Any) -> Event:
        return self.add("ok" if ok else "fail", invoked.op, {**invoked.value, **value},
                        invoked.id)

    def dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(json.dumps(asdict(e), sort_keys=True)
                                  for e in self.events) + "\n")

    @classmethod
    def load(cls, path: Path) -> History:
        history = cls()
        history.events = [Event(**json.loads(line)) for line in path.read_text().splitlines()
                          if line.strip()]
        return history
