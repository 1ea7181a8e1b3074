"""Whether a committed step carries its saver's mark of a save completed.

Savers that mark the end of a save tell tierfs that a step is whole: DCP writes `.metadata`
last, HF Trainer `trainer_state.json` after the model, optimizer, scheduler and RNG state, and
Megatron-LM and DeepSpeed name the step in a tracker beside it (`tierfs.trackers`) once every
rank is done. A step without a marker commits once it is quiet, so a saver killed in the middle
of a save leaves a committed step without its saver's mark: in a directory whose older steps
carry a mark, a step committed by the quiet rules (`StepManifest.by_idle`; not one its saver
committed by a rename into place, `tierfs commit`...) that lacks it is *unfinished*.
`latest` never names it while an older finished step exists, and `tierfs status` says which
mark it lacks. Pure functions of the steps'
manifests (the same on every node) and of what the directory's tracker names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.fs.model.nodes import StepState


MARKS = (".metadata", "trainer_state.json")
TRACKER_MARK = "a tracker naming it"


def unfinished(steps: Iterable[StepState], tracked: int | None) -> dict[StepState, str]:
    """The committed steps of one directory that lack the mark their older steps carry, each
    with the mark it lacks (`tracked`: the step number the directory's tracker names now;
    the steps up to it were named by one of its versions)."""
    found: dict[StepState, str] = {}
    seen: list[str] = []  # the marks older steps carry, in the order first met
    for step in sorted(steps, key=lambda s: s.number if s.number is not None else -1):
        manifest = step.manifest
        if manifest is None or step.number is None:
            continue
        marks = [m for m in MARKS if manifest.entry(m) is not None]
        if tracked is not None and step.number <= tracked:
            marks.append(TRACKER_MARK)
        if seen and manifest.by_idle and not set(marks) & set(seen):
            found[step] = seen[0]
            continue
        seen += [m for m in marks if m not in seen]
    return found
