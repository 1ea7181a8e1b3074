"""A training job's checkpoint I/O, run by tests/test_other_users.py as an unprivileged user:
`python tests/user_job.py RUN_DIR` saves with torch.save and with DCP's FileSystemWriter into
step directories under RUN_DIR, waits for the DCP step to commit, loads both back and compares.
Prints "ok" and the uid it ran as."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(128, 256, generator=generator), "step": torch.tensor([100])}


def wait_committed(step_dir: str) -> None:
    deadline = time.monotonic() + 60
    while os.getxattr(step_dir, "user.tierfs.state") != b"committed":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{step_dir} did not commit")
        time.sleep(0.05)


def main() -> None:
    run_dir = sys.argv[1]
    os.makedirs(run_dir, exist_ok=True)
    plain = os.path.join(run_dir, "step_100")
    os.makedirs(plain)
    torch.save(state(), os.path.join(plain, "model.pt"))
    loaded = torch.load(os.path.join(plain, "model.pt"))
    assert all(torch.equal(loaded[k], v) for k, v in state().items())
    step_dir = os.path.join(run_dir, "step_200")
    dcp.save(state(), storage_writer=FileSystemWriter(step_dir, thread_count=2))
    wait_committed(step_dir)
    restored = {k: torch.zeros_like(v) for k, v in state().items()}
    dcp.load(restored, storage_reader=FileSystemReader(step_dir))
    assert all(torch.equal(restored[k], v) for k, v in state().items())
    print(f"ok uid={os.getuid()}", flush=True)


if __name__ == "__main__":
    main()
