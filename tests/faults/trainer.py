"""A training process for the fault tests: imports torch once, then saves and loads DCP
checkpoints on command, each in a fresh forked child, so that the test can kill the daemon, or
the training process itself, at any moment of a save without paying torch's import again.

Protocol (one JSON object per line): the test writes commands on stdin, this process answers
on stdout. Every command carries an id, and every event answering it carries the same id
(`{"event": "ready", "id": 0}` first, once torch is imported).

    {"op": "save", "id": N, "path": P, "seed": S, "mib": M, "pause": bool}
        -> {"event": "child", "pid": PID}           the forked child that runs the save
        -> {"event": "start"}                        dcp.save is called now
        -> {"event": "shards"}                       every shard is written, .metadata is next
           (with "pause": the child waits here for a line "go" on stdin)
        -> {"event": "done", "ok": true, "files": {name: xxh3-128}}   read back right after
           or {"event": "done", "ok": false, "error": "..."}
    {"op": "load", "id": N, "path": P, "seed": S, "mib": M}
        -> {"event": "child", "pid": PID}
        -> {"event": "done", "ok": bool, "error": "..."}   dcp.load and compare every tensor
    {"op": "quit"}

The events of a command come in this order, always: the child writes every one of them itself,
its own pid first, so no other process can write between them (a `child` event written by this
process would race the child's `start`, and could reach the test after it). Only when the child
is killed does this process add a last {"event": "done", "ok": false, "killed": true}, after
the child is gone; a child killed right after its own `done` so leaves a second `done`.

The state is a deterministic function of (seed, mib): a few tensors of about M MiB in all, so a
step that committed can be loaded and compared tensor by tensor with what was saved.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


def state_for(seed: int, mib: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    floats = max(1024, int(mib * (1 << 20) / 4))
    return {"model.embed": torch.randn(floats // 2, generator=generator),
            "model.layer.weight": torch.randn(floats // 4, generator=generator),
            "optim.exp_avg": torch.randn(floats // 4, generator=generator),
            "step": torch.tensor([seed])}


def emit(**message: object) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class SignallingWriter(FileSystemWriter):
    """The plain FileSystemWriter; it only says when the shards are done (and may wait there)
    so that a test can crash the daemon between the last shard and `.metadata`."""

    def __init__(self, path: str, pause: bool, command_id: int) -> None:
        super().__init__(path, thread_count=2, sync_files=True)
        self._pause = pause
        self._id = command_id

    def finish(self, metadata, results) -> None:  # type: ignore[no-untyped-def]
        emit(event="shards", id=self._id)
        if self._pause:
            sys.stdin.readline()  # "go"
        super().finish(metadata, results)


def hash_dir(path: str) -> dict[str, str]:
    found = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            found[name] = xxhash.xxh3_128_hexdigest(f.read())
    return found


def save(command: dict) -> None:  # type: ignore[type-arg]
    state = state_for(command["seed"], command["mib"])
    os.makedirs(command["path"], exist_ok=True)
    emit(event="start", id=command["id"])
    dcp.save(state, storage_writer=SignallingWriter(command["path"], command.get("pause", False),
                                                    command["id"]))
    emit(event="done", id=command["id"], ok=True, files=hash_dir(command["path"]))


def load(command: dict) -> None:  # type: ignore[type-arg]
    expected = state_for(command["seed"], command["mib"])
    restored = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(restored, storage_reader=FileSystemReader(command["path"]))
    wrong = [k for k, v in expected.items() if not torch.equal(restored[k], v)]
    emit(event="done", id=command["id"], ok=not wrong,
         error=f"tensors differ: {wrong}" if wrong else "")


def in_child(command: dict) -> None:  # type: ignore[type-arg]
    """Run one command in a forked child: a kill of the training process kills only it."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            emit(event="child", id=command["id"], pid=os.getpid())
            (save if command["op"] == "save" else load)(command)
        except BaseException as exc:  # noqa: BLE001 - reported to the test, then exit
            emit(event="done", id=command["id"], ok=False, error=f"{type(exc).__name__}: {exc}",
                 trace=traceback.format_exc()[-2000:])
            code = 1
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        emit(event="done", id=command["id"], ok=False,
             error=f"killed by signal {os.WTERMSIG(status)}", killed=True)


def main() -> None:
    torch.set_num_threads(1)
    emit(event="ready", id=0)
    for line in sys.stdin:
        line = line.strip()
        if not line or line == "go":
            continue
        command = json.loads(line)
        if command["op"] == "quit":
            break
        in_child(command)


if __name__ == "__main__":
    main()
