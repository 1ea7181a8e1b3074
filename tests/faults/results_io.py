"""What every fault test shares: quick or full run, and where its counts go.

`TIERFS_FAULTS=full` selects the full run; anything else (the default) the quick sample that
`make test` runs. Each test writes its counts to `tests/faults/results/<name>.json` and prints
them, so a run's figures can be quoted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FULL = os.environ.get("TIERFS_FAULTS", "quick") == "full"
RESULTS = Path(__file__).with_name("results")


def pick(quick: Any, full: Any) -> Any:
    return full if FULL else quick


def write_results(name: str, counts: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    document = {"name": name, "mode": "full" if FULL else "quick", **counts}
    (RESULTS / f"{name}.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"\n{name}: {json.dumps(document, sort_keys=True)}")


def flip_byte(path: str | os.PathLike[str], offset: int) -> None:
    """Flip every bit of one byte of a file in place (a corruption of its stored bytes)."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        assert len(byte) == 1, f"{path} has no byte {offset}"
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)
