"""DCP's `.metadata` read without torch (`fs.model.dcp_metadata`), against what torch's own
save writes: the files a checkpoint consists of (a multi-node commit waits for them)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tierfs.fs.model import dcp_metadata

pytestmark = pytest.mark.core


def test_the_shards_a_dcp_save_wrote_are_read_from_its_metadata(tmp_path: Path) -> None:
    """A state dict saved with 4 writer threads (DCP spreads its tensors over 4 files) and a
    non-tensor entry: every file the save wrote, and no other, is named."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"layer{i}.weight": torch.randn(100 * (i % 3 + 1), 10) for i in range(8)}
    state["step"] = 5  # stored as bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a save in one process, no process group
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=4))
    written = {p.name for p in tmp_path.iterdir() if p.name != ".metadata"}
    assert written == {f"__0_{i}.distcp" for i in range(4)}
    assert dcp_metadata.shard_files((tmp_path / ".metadata").read_bytes()) == written


def test_metadata_that_is_not_dcps_is_refused() -> None:
    """Empty, not a pickle, or a pickle of something else (the number 5)."""
    for data in (b"", b"not a pickle", b"\x80\x04K\x05."):
        with pytest.raises(dcp_metadata.MetadataError):
            dcp_metadata.shard_files(data)
