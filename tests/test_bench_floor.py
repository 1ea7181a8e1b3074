"""bench/fuse_floor.c and bench/pyfuse3_floor.py, the FUSE floors of the bench's many-file
rows, still build, mount and keep what is written to them (so that the references `make bench`
sets tierfs against cannot rot or quietly measure a file system that loses files)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import fuse_floor
from tests.conftest import mount_options

pytestmark = pytest.mark.fuse


@pytest.mark.parametrize("floor", ["c", "c --as-tierfs", "pyfuse3"])
def test_the_floor_keeps_a_step_of_files(tmp_path: Path, floor: str) -> None:
    program: Path | list[str] | None
    if floor.startswith("c"):
        built = fuse_floor.build(tmp_path)
        assert built is not None, "`make install` puts a compiler and libfuse3's headers here"
        program = [str(built), *floor.split()[1:]]
    else:
        program = [sys.executable, str(fuse_floor.PYTHON_FLOOR)]
    with fuse_floor.mounted(program, tmp_path / "mnt") as mountpoint:
        step = mountpoint / "run" / "step_1"
        step.mkdir(parents=True)
        for i in range(300):  # more than one READDIR page
            (step / f"t{i:03}.distcp").write_bytes(i.to_bytes(2, "little") * 2048)
        (step / "t000.distcp").write_bytes(b"shorter")  # truncated and written again
        listed = subprocess.run(["ls", "-l", str(step)], capture_output=True, text=True,
                                check=True).stdout.splitlines()
        assert len(listed) == 301  # "total" and every file once
        assert sorted(os.listdir(step)) == [f"t{i:03}.distcp" for i in range(300)]
        assert (step / "t000.distcp").read_bytes() == b"shorter"
        assert (step / "t299.distcp").read_bytes() == (299).to_bytes(2, "little") * 2048
        with pytest.raises(OSError) as raised:
            os.getxattr(step / "t001.distcp", "user.tierfs.state")
        # --as-tierfs answers extended attributes as tierfs does a name a file lacks; the
        # plain floor has none, and the kernel stops asking it
        assert raised.value.errno == (errno.ENODATA if "--as-tierfs" in floor
                                      else errno.EOPNOTSUPP)
        if "--as-tierfs" in floor:
            assert "default_permissions" in mount_options(mountpoint)
    assert not os.path.ismount(tmp_path / "mnt")
