"""A multi-process DCP job for the tests: every rank saves its own tensors into one step
directory with the plain FileSystemWriter over gloo, then every rank loads them back and checks
them. Run as `python tests/dcp_ranks.py RANK WORLD PORT STEP_DIR [--at-once]`: STEP_DIR is this
rank's path to the step, on whichever mount the rank's node has. Before loading, each rank
waits until its own mount shows the step committed (on a cluster, the commit happens on rank
0's node); with --at-once it loads right after the barrier that follows the save."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


def state_for(rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return {f"rank{rank}.weight": torch.randn(256, 512, generator=generator),
            f"rank{rank}.bias": torch.randn(512, generator=generator),
            "shared.step": torch.tensor([42])}


def main() -> None:
    rank, world, port, step_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dcp.save(state_for(rank), storage_writer=FileSystemWriter(step_dir, thread_count=2))
        dist.barrier()
        deadline = time.monotonic() + 60
        while "--at-once" not in sys.argv and \
                os.getxattr(step_dir, "user.tierfs.state") != b"committed":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{step_dir} did not commit")
            time.sleep(0.05)
        restored = {k: torch.zeros_like(v) for k, v in state_for(rank).items()}
        dcp.load(restored, storage_reader=FileSystemReader(step_dir))
        for key, value in state_for(rank).items():
            assert torch.equal(restored[key], value), key
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
