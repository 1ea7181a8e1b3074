"""Whether a committed step can be read whole right now; `latest` names only such steps.

A file of a committed step is *reachable* when this node holds it in RAM, the persistent tier
holds the step (or held it and was seen to lack other files of it since), or a peer that may be
up holds a verified copy (its holders as the cluster's records say; `Liveness.may_be_up`: a
node whose lease ended moments ago counts until its lease is known dead, so an etcd outage that
ends every lease at once moves nothing). A committed step with a file that is reachable nowhere
is *incomplete*: its state says so, `latest` skips it, `tierfs status` names each such file,
its last holders and since when, and the daemon logs it once. It is whole again (and named by
`latest` again) as soon as a holder of its files comes back or a copy is found.

`latest` is resolved at every path lookup through it and a step may have thousands of files,
so the answer for a step is kept for FRESH seconds, and computed again at once when the live
members change (`Liveness.generation`) or the step is committed again (a new manifest).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierfs import manifest as mf

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import StepState
    from tierfs.fs.model.ports import Liveness

log = logging.getLogger(__name__)

FRESH = 1.0  # seconds an answer is kept while the members do not change
SHOWN = 20  # lost files named per step in `tierfs status`; the rest are counted


@dataclass(frozen=True)
class LostFile:
    """A file of a committed step that no tier can give now."""

    name: str
    holders: tuple[str, ...]  # the nodes that held it last (none: each lost its copy)
    writer: str | None  # the node that wrote it, if the cluster's records said
    store_lost: bool = False  # the store held it, and was seen to lack it since
    cut_off: tuple[str, ...] = ()  # holders that are up but that this node cannot reach

    def why(self) -> str:
        if self.cut_off:
            return f"held by {', '.join(self.cut_off)}, up but not reachable from this node"
        if self.store_lost and not self.holders:
            return "the persistent tier held it and no longer does"
        if not self.holders:
            return "no node holds it any more (its holders lost their copies)"
        if self.writer is not None and self.holders == (self.writer,):
            return f"lost with {self.writer} before its copies were made"
        return "lost with " + ", ".join(self.holders)

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "holders": list(self.holders), "why": self.why()}


@dataclass(frozen=True)
class Loss:
    """The files of an incomplete step, and since when it is (wall clock, ns)."""

    files: tuple[LostFile, ...]
    since_ns: int

    def as_dict(self) -> dict[str, object]:
        return {"files": len(self.files), "since_ns": self.since_ns,
                "shown": [f.as_dict() for f in self.files[:SHOWN]]}

    def summary(self) -> str:
        """`__1_0.distcp: lost with node1 before its copies were made` (and how many more)."""
        first = self.files[0]
        more = f" and {len(self.files) - 1} more" if len(self.files) > 1 else ""
        return f"{first.name}: {first.why()}{more}"


@dataclass
class _Answer:
    manifest: mf.StepManifest
    generation: int
    until: float
    loss: Loss | None


class Recoverability:
    """Which committed steps are whole (see the module docstring). `peers_of(step, name)`:
    the other nodes holding that file of the step's committed version."""

    def __init__(self, node_id: str, peers_of: Callable[[StepState, str], set[str]],
                 liveness: Liveness | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id = node_id
        self._peers_of = peers_of
        self._liveness = liveness
        self._clock = clock
        self._answers: weakref.WeakKeyDictionary[StepState, _Answer] = \
            weakref.WeakKeyDictionary()

    def loss(self, step: StepState, *, fresh: bool = False) -> Loss | None:
        """Why the committed step cannot be read whole now (None: it can, or it is not
        committed); `fresh`: not from an answer kept (who holds its files just changed)."""
        if not step.committed:
            return None
        manifest = step.manifest
        generation = self._liveness.generation if self._liveness is not None else 0
        now = self._clock()
        answer = self._answers.get(step)
        if (not fresh and answer is not None and answer.manifest is manifest
                and answer.generation == generation and now < answer.until):
            return answer.loss
        lost = self._lost_files(step)
        before = answer.loss if answer is not None and answer.manifest is manifest else None
        loss = None
        if lost:
            loss = Loss(lost, before.since_ns if before is not None else time.time_ns())
            if before is None:
                log.error("%s v%d is incomplete: %d files are reachable on no node and in no "
                          "store (%s); `latest` skips it until a holder returns",
                          manifest.path, manifest.version, len(lost), loss.summary())
        elif before is not None:
            log.warning("%s v%d is whole again: every file is reachable", manifest.path,
                        manifest.version)
        self._answers[step] = _Answer(manifest, generation, now + FRESH, loss)
        return loss

    def whole(self, step: StepState) -> bool:
        return self.loss(step) is None

    def _lost_files(self, step: StepState) -> tuple[LostFile, ...]:
        if step.persisted or step.in_ram:
            return ()
        reachable = (self._liveness.may_be_up if self._liveness is not None
                     else _anyone)
        up = self._liveness.is_up if self._liveness is not None else _anyone
        lost = []
        for entry in step.manifest.files:
            if entry.name in step.resident:
                continue
            if step.store_lacking and entry.name not in step.store_lacking:
                continue  # the store lost other files of the step, not this one
            holders = self._peers_of(step, entry.name)
            if not any(reachable(peer) for peer in holders):
                lost.append(LostFile(entry.name, tuple(sorted(holders)),
                                     step.file_writers.get(entry.name),
                                     entry.name in step.store_lacking,
                                     tuple(sorted(h for h in holders if up(h)))))
        return tuple(lost)


def _anyone(_node: str) -> bool:
    """Without a cluster, every holder a step names counts as reachable."""
    return True
