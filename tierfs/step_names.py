"""Names shared by the daemon and the command line, in a module that imports nothing (the
command line must start without trio): the default step-directory pattern, and how a message
lists a few names out of many."""

from __future__ import annotations

from collections.abc import Iterable

# What trainers name their step directories: step_100, step-100, global_step100 (DeepSpeed),
# checkpoint-500 (HF Trainer), iter_0000100 (Megatron-LM), ckpt_7, 100 (Orbax); not run11,
# layer_3, mp_rank_00 or v2.
DEFAULT_STEP_PATTERN = r"^(?:(?:(?:global_)?step|checkpoint|ckpt|iter(?:ation)?)[-_]?)?([0-9]+)$"


def some_names(names: Iterable[str], most: int = 5) -> str:
    """The first `most` of `names` in order, for a message: `a, b, c and 4 more`."""
    ordered = sorted(names)
    more = len(ordered) - most
    return ", ".join(ordered[:most]) + (f" and {more} more" if more > 0 else "")
