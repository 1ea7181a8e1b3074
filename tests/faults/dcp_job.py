"""One rank of the fault suite's training job: a gloo process group that lives for the whole
test and saves and loads real DCP checkpoints on command, so torch is imported once.

    python dcp_job.py RANK WORLD PORT ROOT [ROOT ...]

ROOT i is node i's mount; this rank saves into ROOT[RANK % len(ROOT)] (its node). Every rank
reads the same commands, one JSON object per line on its stdin, and answers each on stdout
with one JSON line carrying the command's id:

    {"op": "save", "id": N, "path": "run/step_10", "seed": S}
        dcp.save of this rank's tensors for seed S into its node's ROOT/path (a collective:
        every rank's answer is the save's outcome; an error names what failed), then reads
        `user.tierfs.state` of the step on its node at once:
        -> {"id": N, "ok": true, "state": "committed", "seconds": 1.2}
           {"id": N, "ok": false, "error": "...", "seconds": 20.4}
    {"op": "load", "id": N, "path": "run/latest", "node": M}
        dcp.load of this rank's tensors from ROOT[M]/path (`latest` resolved as it is read:
        the link is read before and after), each tensor compared with every seed's, and the
        step directories the files it opened (`.metadata`, shards) really were in:
        -> {"id": N, "ok": true, "seeds": [S] (the seeds the tensors match; one seed, or
            the step was mixed or wrong), "link": "step_10", "link_after": "step_10",
            "read_from": ["step_10"] (one step, or the load mixed two)}
           {"id": N, "ok": false, "error": "..."}
    {"op": "verify", "id": N, "path": "run/step_10", "node": M}
        the whole checkpoint (every rank's tensors) loaded by this rank alone (`no_dist`)
        from ROOT[M]/path: -> {"id": N, "ok": true, "seeds": [...]} or an error
    {"op": "quit"}

The tensors are a function of (rank, seed): `shared.step` is the seed, so a load tells which
save it read, and tensors of two saves read together show as two seeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

SHARD_FLOATS = 128 * 1024  # 512 KiB of float32 per rank and tensor


def state_for(rank: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * seed + rank)
    return {f"rank{rank}.weight": torch.randn(SHARD_FLOATS, generator=generator),
            f"rank{rank}.optim": torch.randn(SHARD_FLOATS, generator=generator),
            "shared.step": torch.tensor([seed])}


def seeds_of(loaded: dict[str, torch.Tensor], ranks: list[int]) -> list[int]:
    """The seeds the loaded tensors are of: one when the load is whole and right."""
    seed = int(loaded["shared.step"][0])
    found = {seed}
    for rank in ranks:
        expected = state_for(rank, seed)
        for key in (f"rank{rank}.weight", f"rank{rank}.optim"):
            if not torch.equal(loaded[key], expected[key]):
                found.add(-1)  # not this seed's bytes: mixed with another save, or wrong
    return sorted(found)


class SaveFailed(Exception):
    """A save's error, with how long its `finish` (the commit, rank 0) took."""

    def __init__(self, error: CheckpointException, commit_seconds: float | None) -> None:
        super().__init__(_describe(error))
        self.commit_seconds = commit_seconds


def _describe(error: CheckpointException) -> str:
    """What each failing rank raised (DCP's exception only names the ranks)."""
    failures = getattr(error, "failures", {}) or {}  # rank -> (exception, traceback)
    return "; ".join(f"rank {rank}: {type(pair[0]).__name__}: {pair[0]}"
                     for rank, pair in sorted(failures.items())) or repr(error)


def emit(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


class TimedWriter(FileSystemWriter):
    """The plain writer; it times `finish` (rank 0 writes and renames `.metadata` there: the
    call tierfs commits the step in, and bounds by `--commit-timeout`)."""

    finish_seconds: float | None = None

    def finish(self, metadata, results) -> None:  # type: ignore[no-untyped-def]
        started = time.monotonic()
        try:
            super().finish(metadata, results)
        finally:
            TimedWriter.finish_seconds = round(time.monotonic() - started, 3)


class TracedReader(FileSystemReader):
    """The plain reader; it notes the step directory each file it opens really is in (the
    kernel's path of the open file, `latest` resolved), so that a load whose `.metadata` and
    shards came from two steps shows (the steps' layouts are alike: DCP loads them)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.read_from: set[str] = set()
        create_stream = self.fs.create_stream

        @contextlib.contextmanager
        def traced(path: str, mode: str) -> Iterator[Any]:
            with create_stream(path, mode) as stream:
                real = os.readlink(f"/proc/self/fd/{stream.fileno()}")
                self.read_from.add(os.path.basename(os.path.dirname(real)))
                yield stream

        self.fs.create_stream = traced  # type: ignore[method-assign]


class Rank:
    def __init__(self, rank: int, world: int, roots: list[str]) -> None:
        self.rank = rank
        self.world = world
        self.roots = roots
        self.home = roots[rank % len(roots)]

    def save(self, command: dict[str, Any]) -> dict[str, Any]:
        path = os.path.join(self.home, command["path"])
        os.makedirs(path, exist_ok=True)
        TimedWriter.finish_seconds = None
        try:
            dcp.save(state_for(self.rank, command["seed"]),
                     storage_writer=TimedWriter(path, thread_count=2))
        except CheckpointException as exc:
            raise SaveFailed(exc, TimedWriter.finish_seconds) from exc
        try:
            state = os.getxattr(path, "user.tierfs.state").decode()
        except OSError as exc:
            state = f"unreadable: {exc}"
        return {"state": state, "commit_seconds": TimedWriter.finish_seconds}

    def load(self, command: dict[str, Any]) -> dict[str, Any]:
        path = os.path.join(self.roots[command["node"]], command["path"])
        before = link(path)
        template = state_for(self.rank, 0)
        restored = {key: torch.zeros_like(value) for key, value in template.items()}
        reader = TracedReader(path)
        dcp.load(restored, storage_reader=reader)
        return {"seeds": seeds_of(restored, [self.rank]), "link": before,
                "link_after": link(path), "read_from": sorted(reader.read_from)}

    def verify(self, command: dict[str, Any]) -> dict[str, Any]:
        path = os.path.join(self.roots[command["node"]], command["path"])
        restored: dict[str, torch.Tensor] = {}
        for rank in range(self.world):
            restored.update({k: torch.zeros_like(v) for k, v in state_for(rank, 0).items()})
        dcp.load(restored, storage_reader=FileSystemReader(path), no_dist=True)
        return {"seeds": seeds_of(restored, list(range(self.world)))}

    def serve(self) -> None:
        emit(id=0, ok=True, ready=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            if command["op"] == "quit":
                return
            started = time.monotonic()
            try:
                answer = {"ok": True, **getattr(self, command["op"])(command)}
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported
                text = (_describe(exc) if isinstance(exc, CheckpointException)
                        else f"{type(exc).__name__}: {exc}")
                answer = {"ok": False, "error": text[:2000],
                          "commit_seconds": getattr(exc, "commit_seconds", None),
                          "trace": traceback.format_exc()[-3000:]}
            emit(id=command["id"], seconds=round(time.monotonic() - started, 3), **answer)


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Rank(rank, world, sys.argv[4:]).serve()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
