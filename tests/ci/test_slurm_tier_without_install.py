"""On a machine where Slurm could not be started, the slurm tier skips every test with the
install's one-line reason, and under CI only the excuse ci/run-tests.sh writes from
.cache/slurm.unavailable (`slurm/slurm: ...`) lets the run pass: an empty slurm tier fails CI.
The tier runs in a copy of the suite under tmp_path, whose `.cache/` has no Slurm (or says why),
so this checkout's Slurm does not matter."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tier_copy import copy_of_the_tier, count_tests, run_the_tier

TIER = count_tests("slurm")  # the tier's tests, each of which must skip


@pytest.mark.parametrize("unavailable", [False, True], ids=["not-installed", "unavailable"])
def test_without_slurm_every_test_skips_with_the_installs_reason(
    tmp_path: Path, unavailable: bool
) -> None:
    checkout = copy_of_the_tier(tmp_path, "slurm")
    reason = "slurm not started: run ci/install-slurm.sh start"
    if unavailable:
        (checkout / ".cache").mkdir()
        why = "slurmd did not start (see .cache/slurm/slurmd.log)"
        (checkout / ".cache" / "slurm.unavailable").write_text(why + "\n")
        reason = f"slurm unavailable here: {why}"
    code, output = run_the_tier(checkout, "slurm")
    assert code == 0, output
    assert re.search(rf"^{TIER} skipped in ", output.splitlines()[-1]), output
    assert reason in output


def test_under_ci_the_skipped_tier_fails_the_run_unless_its_install_said_why(
    tmp_path: Path,
) -> None:
    checkout = copy_of_the_tier(tmp_path, "slurm")
    code, output = run_the_tier(checkout, "slurm", CI="true")
    assert code == 1, output
    assert re.search(rf"CI: the slurm tier skipped {TIER} test\(s\) that RALPH_ALLOW_SKIP", output)
    excuse = "slurm/slurm: slurmd did not start (see .cache/slurm/slurmd.log)"
    code, output = run_the_tier(checkout, "slurm", CI="true", RALPH_ALLOW_SKIP=excuse)
    assert code == 0, output
    assert f"excused by RALPH_ALLOW_SKIP: {excuse}" in output
