"""Real checkpointing frameworks, run unmodified by tests/test_frameworks.py in a subprocess
(so that importing transformers or Lightning costs the test process nothing). Tiny models built
from a config in code, random data, no hub download (HF_HUB_OFFLINE=1). Each job prints one JSON
line with what the test checks.

    python tests/framework_jobs.py hf OUTPUT_DIR MAX_STEPS [resume|resume=PATH] [die-at=N]
                                   [rank=R/W port=P]  (DDP over gloo, OUTPUT_DIR on R's node)
                                   [each-node]  (save_on_each_node: every rank saves it all)
    python tests/framework_jobs.py lightning DIRPATH MAX_STEPS [CKPT_PATH]  (save_last=True)
    python tests/framework_jobs.py lightning-link DIRPATH MAX_STEPS [CKPT_PATH]  (save_last="link")
    python tests/framework_jobs.py deepspeed SAVE_DIR MAX_STEPS PORT [resume] [nowait] [tag=T]
                                   [rank=R/W]   (rank R of W, each rank's SAVE_DIR on its node)
    python tests/framework_jobs.py save RUN_DIR STEP...       # torch.save + safetensors
    python tests/framework_jobs.py load RUN_DIR STEP...       # torch.load(mmap) + safe_open
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

SAVE_EVERY = 2  # optimizer steps between checkpoints, in every job


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(seed))


def hf(output_dir: str, max_steps: int, resume: bool | str,
       die_at: int | None = None, rank: tuple[int, int] = (0, 1),
       port: str = "", each_node: bool = False) -> dict[str, Any]:
    """transformers' Trainer with save_steps and save_total_limit=2, resumable (`resume`: True
    for its own choice, the newest checkpoint-N, or a checkpoint's path). `die_at`: the
    process is killed (SIGKILL) in the middle of its save at that step, once the model, the
    optimizer and the scheduler are written and before its RNG state and trainer_state.json
    (a node's OOM killer, a job preempted). `rank`: this rank and the world size of a DDP
    job over gloo (rendezvous on `port`), one rank per node: rank 0 saves the checkpoint,
    every rank its own `rng_state_R.pth`; with `each_node` (`save_on_each_node`) every rank,
    each its node's first, saves the whole checkpoint and rotates the old ones."""
    if rank[1] > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank[0]),
                          WORLD_SIZE=str(rank[1]), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    data = [{"input_ids": row, "labels": row} for row in tokens(1)]

    class CountSteps(TrainerCallback):
        """How many optimizer steps this run made (fewer than max_steps when resumed)."""

        done = 0

        def on_step_end(self, *_args: Any, **_kwargs: Any) -> None:
            CountSteps.done += 1

    args = TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, save_steps=SAVE_EVERY, save_total_limit=2,
        per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=1000,
        disable_tqdm=True, save_on_each_node=each_node)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[CountSteps()])
    if die_at is not None:
        save_rng_state = Trainer._save_rng_state

        def dying(self: Trainer, output_dir: str | None) -> None:
            if self.state.global_step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            save_rng_state(self, output_dir)

        Trainer._save_rng_state = dying  # type: ignore[method-assign]
    trainer.train(resume_from_checkpoint=resume or None)
    return {"global_step": trainer.state.global_step, "steps_run": CountSteps.done}


def lightning(dirpath: str, max_steps: int, ckpt_path: str | None,
              save_last: bool | str | None = None, keep: int = -1) -> dict[str, Any]:
    """A Lightning Trainer whose ModelCheckpoint keeps every checkpoint (or the newest `keep`),
    resumable; the step it started from (`start_step`: 0 unless it resumed)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    started: list[int] = []

    class StartStep(Callback):
        def on_train_start(self, trainer: L.Trainer, *_args: Any) -> None:
            started.append(trainer.global_step)

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=generator),
                                          torch.randn(64, 1, generator=generator))
    trainer = L.Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
        callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=SAVE_EVERY,
                                   save_top_k=keep, save_last=save_last), StartStep()])
    trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=4),
                ckpt_path=ckpt_path)
    return {"global_step": trainer.global_step, "start_step": started[0]}


def deepspeed_job(save_dir: str, max_steps: int, port: str, resume: bool,
                  wait: bool = True, tag: str | None = None,
                  rank: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """DeepSpeed's engine on CPU (gloo, ZeRO stage 1; `rank`: this rank and the world size,
    one by default), `save_checkpoint(save_dir)`
    every SAVE_EVERY steps: `global_stepN/` with model and optimizer states, then, on rank 0,
    its own `latest` file naming the tag; resumed by `load_checkpoint(save_dir)`, which reads
    that file.

    DeepSpeed calls its checkpoint engine's `commit()` right before rank 0 writes `latest`.
    Here that call lasts until tierfs committed the step (by its idle rule), as a barrier
    with slower ranks on other nodes or an engine that waits for durability lasts: the
    `latest` file comes after the commit, which tierfs's own `latest` link must not stand
    in the way of. Not `wait`: DeepSpeed's own engine, which goes on at once (saves
    as fast as training goes). `tag`: `save_checkpoint(save_dir, tag=f"{tag}{step}")`, a
    custom tag (no step name) instead of DeepSpeed's `global_stepN`."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank[0]),
                      WORLD_SIZE=str(rank[1]), LOCAL_RANK="0")
    import deepspeed

    # One rank: DeepSpeed's shared-memory all-reduce op (for several ranks on one host) is
    # never used, and building it costs a minute of C++ compile on a fresh machine.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    class CommitAfterTierfs(TorchCheckpointEngine):
        def commit(self, info: Any) -> bool:
            step_dir = os.path.join(info.save_dir, info.tag)
            deadline = time.monotonic() + 60
            while os.getxattr(step_dir, "user.tierfs.state") != b"committed":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{step_dir} did not commit")
                time.sleep(0.05)
            return super().commit(info)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "steps_per_print": 10**6}
    engine, _optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)
    if wait:
        engine.checkpoint_engine = CommitAfterTierfs(engine._config)

    def weights() -> list[float]:
        return torch.cat([p.detach().flatten() for p in engine.module.parameters()]).tolist()

    result: dict[str, Any] = {"loaded_step": None, "saved": {}}
    if resume:
        path, _client_state = engine.load_checkpoint(save_dir)
        if path is not None:
            result.update(loaded_step=engine.global_steps, weights_at_load=weights())
    generator = torch.Generator().manual_seed(engine.global_steps)
    while engine.global_steps < max_steps:
        x = torch.randn(4, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        if engine.global_steps % SAVE_EVERY == 0:
            engine.save_checkpoint(save_dir, tag=None if tag is None
                                   else f"{tag}{engine.global_steps}")
            result["saved"][str(engine.global_steps)] = weights()
    return result | {"global_step": engine.global_steps}


def state_for(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"weight": torch.randn(128, 64, generator=generator),
            "bias": torch.randn(64, generator=generator)}


def save(run_dir: Path, steps: list[int]) -> dict[str, Any]:
    """A plain loop: mkdir step_N, torch.save and safetensors save_file into it."""
    from safetensors.torch import save_file

    for step in steps:
        step_dir = run_dir / f"step_{step}"
        step_dir.mkdir(parents=True)
        torch.save({"model": state_for(step), "step": step}, step_dir / "model.pt")
        save_file(state_for(step), str(step_dir / "model.safetensors"))
    return {"saved": steps}


def load(run_dir: Path, steps: list[int]) -> dict[str, Any]:
    """Read every step back (torch.load with mmap, safetensors safe_open) and compare."""
    from safetensors import safe_open

    for step in steps:
        step_dir = run_dir / f"step_{step}"
        expected = state_for(step)
        loaded = torch.load(step_dir / "model.pt", mmap=True, weights_only=True)
        assert loaded["step"] == step
        with safe_open(str(step_dir / "model.safetensors"), framework="pt") as tensors:
            for name, tensor in expected.items():
                assert torch.equal(loaded["model"][name], tensor), (step, name)
                assert torch.equal(tensors.get_tensor(name), tensor), (step, name)
    return {"loaded": steps}


def main(argv: list[str]) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a hub
    job, where, *rest = argv
    if job == "hf":
        options = dict(o.partition("=")[::2] for o in rest[1:])
        resume = options.get("resume")
        rank, world = options.get("rank", "0/1").split("/")
        result = hf(where, int(rest[0]), True if resume == "" else resume or False,
                    int(options["die-at"]) if "die-at" in options else None,
                    (int(rank), int(world)), options.get("port", ""), "each-node" in options)
    elif job in ("lightning", "lightning-link"):
        keep = next((int(o[5:]) for o in rest[1:] if o.startswith("keep=")), -1)
        ckpt = next((o for o in rest[1:] if not o.startswith("keep=")), None)
        result = lightning(where, int(rest[0]), ckpt,
                           "link" if job == "lightning-link" else True, keep)
    elif job == "deepspeed":
        tag = next((o[4:] for o in rest[2:] if o.startswith("tag=")), None)
        rank, world = next((o[5:] for o in rest[2:] if o.startswith("rank=")), "0/1").split("/")
        result = deepspeed_job(where, int(rest[0]), rest[1], "resume" in rest[2:],
                               "nowait" not in rest[2:], tag, (int(rank), int(world)))
    elif job == "save":
        result = save(Path(where), [int(s) for s in rest])
    elif job == "load":
        result = load(Path(where), [int(s) for s in rest])
    else:
        raise SystemExit(f"unknown job {job!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
