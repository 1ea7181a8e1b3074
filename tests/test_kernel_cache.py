"""What the kernel keeps of a mount's answers (fs.tree.kernel_cache), counted with its
`fuse_request_send` tracepoint: a settled entry and its attributes are kept for
SETTLED_TIMEOUT, so a listed step is read back, and listed again, without a LOOKUP or a
GETATTR per file once the old one-second timeout has passed."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.conftest import FuseRequestTrace, MountFactory, wait_until
from tierfs.fs.tree.kernel_cache import CHANGING_TIMEOUT

pytestmark = pytest.mark.fuse

FILES = 100


def run(*command: str) -> tuple[subprocess.Popen[bytes], bytes]:
    """`command`, run to its end: the process (its pid names its requests) and its output."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, command
    return process, out


@pytest.mark.parametrize("passthrough", [True, False], ids=["relay", "daemon"])
def test_a_listed_step_is_read_and_listed_again_without_a_request_per_file(
        mounts: MountFactory, fuse_trace: FuseRequestTrace, passthrough: bool) -> None:
    mnt = mounts.mount(*([] if passthrough else ["--no-passthrough"]))
    step = mnt / "run/step_1"
    step.mkdir(parents=True)
    for i in range(FILES):
        (step / f"t{i:03}").write_bytes(b"x" * 100)
    (step / ".metadata").write_bytes(b"m")
    wait_until(lambda: (mnt.step("run/step_1") or {}).get("state") == "committed")
    subprocess.run(["ls", "-l", str(step)], check=True, capture_output=True)
    # What is tested is time passing: entries given with the one-second timeout would have
    # expired by now, and each file would cost a LOOKUP (and `ls -l` a GETATTR) again.
    time.sleep(CHANGING_TIMEOUT + 0.5)
    names = [str(step / f"t{i:03}") for i in range(FILES)]
    fuse_trace.start()
    try:
        cat, read_back = run("cat", *names)
        ls, listing = run("ls", "-l", str(step))
    finally:
        fuse_trace.stop()
    assert read_back == b"x" * 100 * FILES
    assert len(listing.splitlines()) == FILES + 1  # "total", every file
    read = fuse_trace.requests(cat.pid)
    assert read.count("FUSE_OPEN") == FILES, read[:20]
    assert read.count("FUSE_LOOKUP") == 0 and read.count("FUSE_GETATTR") == 0, read[:20]
    listed = fuse_trace.requests(ls.pid)
    assert "FUSE_READDIRPLUS" in listed
    assert listed.count("FUSE_LOOKUP") + listed.count("FUSE_GETATTR") <= 2, listed[:20]
