"""The nemesis: applies faults of the network (tests/faults/network.py) to a running cluster and
records each in the history, with the nodes it cuts off (what the checker excuses a failed
load or a `latest` moving back for), and heals them all at once.

A fault may be applied at once or a given time later from a timer thread, so that it lands in
the middle of an operation (a save, a delete); `join()` waits for the ones scheduled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tests.faults.history import History
from tests.faults.network import Fault, Network


class Nemesis:
    def __init__(self, network: Network, history: History) -> None:
        self.network = network
        self.history = history
        self._ids = 0
        self._active: list[int] = []
        self._timers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.errors: list[BaseException] = []

    def apply(self, make: Callable[[], Fault], cut: list[str]) -> None:
        """Apply the fault `make()` builds; `cut`: the nodes whose links it cuts (none for
        delay, loss and rate limits, which only degrade them)."""
        with self._lock:
            fault = make()
            self._ids += 1
            self._active.append(self._ids)
            self.history.add("nemesis", "start", {"fault": f"{fault.kind} {fault.detail}",
                                                  "fault_id": self._ids, "cut": sorted(cut)})

    def later(self, seconds: float, make: Callable[[], Fault], cut: list[str]) -> None:
        """Apply the fault `seconds` from now, from a thread (errors kept for `join`)."""
        def fire() -> None:
            try:
                self.apply(make, cut)
            except BaseException as exc:  # noqa: BLE001 - re-raised by join()
                self.errors.append(exc)

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def join(self) -> None:
        for timer in self._timers:
            timer.join()
        self._timers.clear()
        if self.errors:
            raise self.errors[0]

    def heal(self) -> float:
        """Heal every fault (waiting for scheduled ones first); the history time of the heal."""
        self.join()
        with self._lock:
            self.network.heal()
            healed = self.history.now()
            for fault_id in self._active:
                self.history.add("nemesis", "stop", {"fault_id": fault_id})
            self._active.clear()
            return healed

    @property
    def active(self) -> bool:
        return bool(self._active)
