"""A multi-process DCP job for the tests: every rank saves its own tensors into one step
directory with the plain FileSystemWriter over gloo, then every rank loads them back and checks
them. Run as `python tests/dcp_ranks.py RANK WORLD PORT STEP_DIR [options]`: STEP_DIR is this
rank's path to the step, on whichever mount the rank's node has. Before loading, each rank
waits until its own mount shows the step committed (on a cluster, the commit happens on rank
0's node); with --at-once it loads right after the barrier that follows the save.

Options for jobs that save and resume as separate runs: `--seed N` makes the tensors of step N
(each step's differ); `--save-only` and `--load-only` do half the job (a load checks the
tensors of `--seed`, so a resume from `latest` shows which step it read);
`--extra-mib N` adds a tensor of N MiB to each rank's shard; `--pause-after-write` has this
rank print "written" once its shard is written (closed), and
wait for a line on stdin before the save goes on (the test does something to the cluster in
between: the commit on rank 0's node cannot happen before the save goes on); if that save then
fails, the rank prints how long after the go-ahead it failed. `--pause-before-write` has it
print "writing" and wait for that line before it writes its shard."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


def state_for(rank: int, seed: int = 0, extra_mib: int = 0) -> dict[str, torch.Tensor]:
    """Each rank's tensors (`extra_mib`: one more of that many MiB, for large shards)."""
    generator = torch.Generator().manual_seed(1000 * (seed + 1) + rank)
    state = {f"rank{rank}.weight": torch.randn(256, 512, generator=generator),
             f"rank{rank}.bias": torch.randn(512, generator=generator),
             "shared.step": torch.tensor([42 + seed])}
    if extra_mib:
        state[f"rank{rank}.extra"] = torch.randn(extra_mib << 18, generator=generator)
    return state


class PausingWriter(FileSystemWriter):
    """The plain writer, which tells the test when this rank's files are written and waits
    for its go-ahead (stdin) before the save goes on."""

    resumed_at: float | None = None  # time.monotonic() of the go-ahead

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        future = super().write_data(plan, planner)
        future.wait()
        print("written", flush=True)
        sys.stdin.readline()
        PausingWriter.resumed_at = time.monotonic()
        return future


class PausingFirstWriter(FileSystemWriter):
    """The plain writer, which tells the test when this rank is about to write its files and
    waits for its go-ahead (stdin) before it does."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        print("writing", flush=True)
        sys.stdin.readline()
        return super().write_data(plan, planner)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world"):
        parser.add_argument(name, type=int)
    parser.add_argument("port")
    parser.add_argument("step_dir")
    parser.add_argument("--at-once", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-only", action="store_true")
    parser.add_argument("--load-only", action="store_true")
    parser.add_argument("--pause-after-write", action="store_true")
    parser.add_argument("--pause-before-write", action="store_true")
    parser.add_argument("--extra-mib", type=int, default=0)
    args = parser.parse_args()
    rank, step_dir = args.rank, args.step_dir
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        if not args.load_only:
            writer = (PausingWriter if args.pause_after_write
                      else PausingFirstWriter if args.pause_before_write
                      else FileSystemWriter)(step_dir, thread_count=2)
            try:
                dcp.save(state_for(rank, args.seed, args.extra_mib), storage_writer=writer)
            except BaseException:
                if PausingWriter.resumed_at is not None:
                    # how long the saver's call blocked, without the process's teardown
                    took = time.monotonic() - PausingWriter.resumed_at
                    print(f"the save failed {took:.2f} s after it went on", file=sys.stderr,
                          flush=True)
                raise
            dist.barrier()
        if not args.save_only:
            deadline = time.monotonic() + 60
            while not (args.at_once or args.load_only) and \
                    os.getxattr(step_dir, "user.tierfs.state") != b"committed":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{step_dir} did not commit")
                time.sleep(0.05)
            expected = state_for(rank, args.seed, args.extra_mib)
            restored = {k: torch.zeros_like(v) for k, v in expected.items()}
            dcp.load(restored, storage_reader=FileSystemReader(step_dir))
            for key, value in expected.items():
                assert torch.equal(restored[key], value), key
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
