"""Unmodified torch.save/torch.load and torch.distributed.checkpoint through a real mount."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tests.conftest import Mount, getxattr, run_dcp_ranks

pytestmark = [pytest.mark.frameworks, pytest.mark.filterwarnings("ignore::UserWarning")]


def make_training_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(torch.randn(32, 64)).square().mean()
    loss.backward()
    optimizer.step()  # Adam now has exp_avg / exp_avg_sq state
    return model, optimizer


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:  # type: ignore[type-arg]
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def assert_state_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_state_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            assert_state_equal(x, y)
    else:
        assert a == b


def test_torch_save_and_load_model_and_optimizer(mnt: Mount) -> None:
    model, optimizer = make_training_state()
    path = mnt / "run/model_step_100.pt"
    path.parent.mkdir()
    torch.save(flat_state(model, optimizer), path)
    assert_state_equal(flat_state(model, optimizer), torch.load(path, weights_only=True))
    assert len(getxattr(path, "user.tierfs.xxh3")) == 32


@pytest.mark.parametrize("thread_count", [1, 4])
def test_dcp_save_and_load(mnt: Mount, thread_count: int) -> None:
    model, optimizer = make_training_state()
    step_dir = mnt / "run/step_100"
    state = flat_state(model, optimizer)
    dcp.save(state, storage_writer=FileSystemWriter(step_dir, thread_count=thread_count))
    assert getxattr(step_dir, "user.tierfs.state") == "committed"
    assert os.readlink(mnt / "run/latest") == "step_100"
    fresh_model, fresh_optimizer = make_training_state(seed=1)
    restored = flat_state(fresh_model, fresh_optimizer)
    dcp.load(restored, storage_reader=FileSystemReader(mnt / "run/latest"))
    assert_state_equal(state["model"], restored["model"])
    step = mnt.step("run/step_100")
    assert step["files"] == len(os.listdir(step_dir)) >= 2


def test_dcp_async_save(mnt: Mount) -> None:
    model, optimizer = make_training_state()
    state = flat_state(model, optimizer)
    future = dcp.async_save(state, storage_writer=FileSystemWriter(mnt / "step_3"))
    future.result()
    assert getxattr(mnt / "step_3", "user.tierfs.state") == "committed"
    restored = flat_state(*make_training_state(seed=2))
    dcp.load(restored, storage_reader=FileSystemReader(mnt / "step_3"))
    assert_state_equal(state["model"], restored["model"])


def test_two_process_dcp_into_one_mount(mnt: Mount) -> None:
    step_dir = mnt / "job/step_20"
    run_dcp_ranks([step_dir, step_dir], timeout=180)
    names = os.listdir(step_dir)
    assert ".metadata" in names
    assert {name.split("_")[2] for name in names if name.endswith(".distcp")} == {"0", "1"}
    assert getxattr(step_dir, "user.tierfs.state") == "committed"
