"""DCP's `.metadata` read without torch (`fs.model.dcp_metadata`), against what torch's own
save writes and its own load does: the files a checkpoint consists of (a multi-node commit
waits for them), and the order a load opens them in (the read-ahead of a restore follows it)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tierfs.fs.model import dcp_metadata

pytestmark = pytest.mark.core


def test_the_shards_and_the_order_a_load_opens_them_in(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A state dict saved with 4 writer threads: DCP spreads its tensors over 4 files by size,
    so the order of the state dict, which its load follows, is not the order of the files'
    names (`__0_0` first, as `ls` and `cp -r` go): `load_order` is the load's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    state = {f"layer{i}.weight": torch.randn(100 * (i % 3 + 1), 10) for i in range(8)}
    state["step"] = 5  # a non-tensor entry, stored as bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a save in one process, no process group
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=4))
        opened: list[str] = []
        create_stream = filesystem.FileSystem.create_stream

        def noting(self: filesystem.FileSystem, path: str | Path, mode: str) -> object:
            opened.append(Path(path).name)
            return create_stream(self, path, mode)

        monkeypatch.setattr(filesystem.FileSystem, "create_stream", noting)
        dcp.load({name: torch.empty_like(value) if isinstance(value, torch.Tensor) else 0
                  for name, value in state.items()},
                 storage_reader=dcp.FileSystemReader(tmp_path))
    data = (tmp_path / ".metadata").read_bytes()
    shards = [name for name in opened if name != ".metadata"]
    assert dcp_metadata.shard_files(data) == {f"__0_{i}.distcp" for i in range(4)}
    assert dcp_metadata.load_order(data) == shards
    assert shards != sorted(shards)  # else this test would show nothing


def test_metadata_that_is_not_dcps_is_refused(tmp_path: Path) -> None:
    for data in (b"", b"not a pickle", b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x05."):
        with pytest.raises(dcp_metadata.MetadataError):
            dcp_metadata.load_order(data)
