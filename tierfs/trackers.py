"""Tracker files: the small files savers write beside their steps to say which one to resume
from. DeepSpeed's `latest` holds a tag (`global_step200`); Megatron-LM's
`latest_checkpointed_iteration.txt` holds an iteration number (`200`); a run directory's own
`latest` file holds either. Both are loose files (no step number of their own).

A tracker in a tier must never name a step that tier lacks, or a job restarting from it there
fails: the uploader holds a tracker's version until the step it names is in the store (the
store keeps the previous version meanwhile), and the replicator holds its copy to a peer until
that peer holds the step. Here: the names and what a tracker's content names; the file system
resolves that in the tracker's directory (`OtherTiers.tracked_step`). No imports beyond the
standard library: the uploader, the replicator and the file system all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

TRACKER_NAMES = frozenset({"latest", "latest_universal", "latest_checkpointed_iteration.txt"})
MAX_BYTES = 4096  # a longer file is not a tracker


@dataclass(frozen=True)
class TrackedStep:
    """The step a tracker's version names, in its directory: the step's number, whether this
    node committed it (so this node's uploader will put it in the store), and whether its
    committed version is in the persistent tier."""

    number: int
    made_here: bool
    persisted: bool


def is_tracker_name(path: str) -> bool:
    return path.rpartition("/")[2] in TRACKER_NAMES


def named_step(content: bytes) -> str | int | None:
    """What a tracker's content names: a step number (`200`, Megatron-LM) or a directory name
    (`global_step200`, DeepSpeed); None for anything else (Megatron-LM's `release`, a text
    that is no name). Whether a name is a step's is for the caller's step pattern."""
    try:
        text = content.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if text.isascii() and text.isdigit():
        return int(text)
    if not text or "/" in text or text in (".", "..") or len(content) > MAX_BYTES:
        return None
    return text
