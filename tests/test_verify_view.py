"""`tierfs verify` for a person, from the daemon's reply alone (no mount): the report, the one
line a failed check ends with, and the warnings for files short of their copies. Real checks
through mounts are in test_verify and test_cluster_verify."""

from __future__ import annotations

from typing import Any

import pytest

from tierfs.fs.lifecycle.verify import StepReport, TierReport
from tierfs.mount_helper import verify_view

pytestmark = pytest.mark.core


def step(path: str, *tiers: TierReport, **more: Any) -> dict[str, Any]:
    """A step of the daemon's reply, as `tierfs verify --json` prints it."""
    return StepReport(path, 1, 2, 3 << 20, list(tiers), **more).as_dict()


def test_a_good_check_ends_with_no_failure_and_says_so() -> None:
    steps = [step("run/step_1", TierReport("ram", good=2), TierReport("s3", good=2))]
    assert verify_view.failure(steps, repair=False) is None
    assert verify_view.warnings(steps) == []
    assert verify_view.format_verify(steps).splitlines() == [
        "run/step_1 v1: 2 files, 3.0 MiB", "  ram: 2 good", "  s3: 2 good",
        "1 steps, 2 copies checked: every copy good"]


def test_a_lost_file_is_the_failure_before_any_bad_copy() -> None:
    steps = [step("run/step_1", TierReport("node1", bad=["a"])),
             step("run/step_2", TierReport("ram", good=1), lost={"b": ["node2"]})]
    assert verify_view.failure(steps, repair=True) == (
        "verify: 1 file of run/step_2 has no reachable copy: b (last held by node2)")
    assert verify_view.format_verify(steps).splitlines()[-1] == (
        "2 steps, 2 copies checked: FILES WITH NO REACHABLE COPY")


def test_the_first_bad_copy_not_repaired_is_the_failure_and_counts_the_rest() -> None:
    steps = [step("run/step_1", TierReport("node1", good=1, bad=["a"], missing=["b"]),
                  TierReport("s3", error="access denied"))]
    assert verify_view.failure(steps, repair=True) == (
        "verify: run/step_1 on node1: 1 bad (a) and 1 missing (b), no good copy to repair "
        "from (and 1 more)")
    unchecked = [step("run/step_1", TierReport("s3", error="access denied"))]
    assert verify_view.failure(unchecked, repair=False) == "verify: run/step_1 on s3: access denied"


def test_files_short_of_copies_are_warnings_not_failures() -> None:
    steps = [step("run/step_1", TierReport("ram", good=2), short={"model.pt": 1}, wanted=2)]
    assert verify_view.failure(steps, repair=False) is None
    assert verify_view.warnings(steps) == [
        "1 file of run/step_1 has fewer than 2 copies reachable (K + 1, at most one per node) "
        "and none in the persistent tier: model.pt (1 copy)"]
    assert verify_view.format_verify(steps).endswith(
        "every file reachable, some with fewer than K + 1 copies")
