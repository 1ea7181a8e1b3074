"""Names shared by the daemon and the command line, in a module that imports nothing (the
command line must start without trio): the default step-directory and file-step patterns, and
how a message lists a few names out of many."""

from __future__ import annotations

from collections.abc import Iterable

# What trainers name their step directories: step_100, step-100, global_step100 (DeepSpeed),
# checkpoint-500 (HF Trainer), iter_0000100 (Megatron-LM), ckpt_7, 100 (Orbax); not run11,
# layer_3, mp_rank_00 or v2.
DEFAULT_STEP_PATTERN = r"^(?:(?:(?:global_)?step|checkpoint|ckpt|iter(?:ation)?)[-_]?)?([0-9]+)$"
# What single-file checkpoints are named (file steps, outside any step directory): the number
# right before the checkpoint extension, after a separator or a step word: epoch=0-step=5.ckpt
# (Lightning: step 5; -v1 is its suffix for a name in use), model_1000.pt, ckpt-500.safetensors,
# step_100.pt, checkpoint-7.bin, iter_0000100.pt; not last.ckpt, last-v1.ckpt, run11.pt,
# config.json or latest_checkpointed_iteration.txt.
CHECKPOINT_EXTENSIONS = r"\.(?:ckpt|pt|pth|bin|safetensors|pkl|pickle|h5|npz|npy|msgpack|tar)$"
DEFAULT_FILE_STEP_PATTERN = (
    r"^(?:.*[-_=])?(?:(?:global_)?step|checkpoint|ckpt|iter(?:ation)?|model)?[-_=]?"
    r"([0-9]+)(?:-v[0-9]+)?" + CHECKPOINT_EXTENSIONS)
# DeepSpeed's step directories (its default tag, `global_step100`): DeepSpeed writes and reads
# its own `latest` FILE beside them, so a directory holding one never shows tierfs's virtual
# `latest` link (a link there would make DeepSpeed's `open("latest", "w")` fail with EISDIR).
DEEPSPEED_STEP = r"^global_step[0-9]+$"


def some_names(names: Iterable[str], most: int = 5) -> str:
    """The first `most` of `names` in order, for a message: `a, b, c and 4 more`."""
    ordered = sorted(names)
    more = len(ordered) - most
    return ", ".join(ordered[:most]) + (f" and {more} more" if more > 0 else "")
