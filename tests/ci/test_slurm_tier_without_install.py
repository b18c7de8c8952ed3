"""On a machine where Slurm could not be started, the slurm tier skips every test with the
install's one-line reason, and under CI only the excuse ci/run-tests.sh writes from
.cache/slurm.unavailable (`slurm/slurm: ...`) lets the run pass: an empty slurm tier fails CI.
The tier runs in a copy of the suite under tmp_path, whose `.cache/` has no Slurm (or says why),
so this checkout's Slurm does not matter."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIER = len(  # the tier's tests, each of which must skip
    [
        line
        for module in (ROOT / "tests" / "slurm").glob("test_*.py")
        for line in module.read_text(encoding="utf-8").splitlines()
        if line.startswith("def test_")
    ]
)


def copy_of_the_tier(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    (checkout / "tests").mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", checkout)
    shutil.copy2(ROOT / "tests" / "conftest.py", checkout / "tests")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "tests" / "support", checkout / "tests" / "support", ignore=ignore)
    shutil.copytree(ROOT / "tests" / "slurm", checkout / "tests" / "slurm", ignore=ignore)
    return checkout


def run_the_tier(checkout: Path, **env: str) -> tuple[int, str]:
    drop = ("CI", "RALPH_ALLOW_SKIP", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")
    environ = {k: v for k, v in os.environ.items() if k not in drop and "PYTEST" not in k}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "tests/slurm"],
        cwd=checkout,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("unavailable", [False, True], ids=["not-installed", "unavailable"])
def test_without_slurm_every_test_skips_with_the_installs_reason(
    tmp_path: Path, unavailable: bool
) -> None:
    checkout = copy_of_the_tier(tmp_path)
    reason = "slurm not started: run ci/install-slurm.sh start"
    if unavailable:
        (checkout / ".cache").mkdir()
        why = "slurmd did not start (see .cache/slurm/slurmd.log)"
        (checkout / ".cache" / "slurm.unavailable").write_text(why + "\n")
        reason = f"slurm unavailable here: {why}"
    code, output = run_the_tier(checkout)
    assert code == 0, output
    assert re.search(rf"^{TIER} skipped in ", output.splitlines()[-1]), output
    assert reason in output


def test_under_ci_the_skipped_tier_fails_the_run_unless_its_install_said_why(
    tmp_path: Path,
) -> None:
    checkout = copy_of_the_tier(tmp_path)
    code, output = run_the_tier(checkout, CI="true")
    assert code == 1, output
    assert re.search(rf"CI: the slurm tier skipped {TIER} test\(s\) that RALPH_ALLOW_SKIP", output)
    excuse = "slurm/slurm: slurmd did not start (see .cache/slurm/slurmd.log)"
    code, output = run_the_tier(checkout, CI="true", RALPH_ALLOW_SKIP=excuse)
    assert code == 0, output
    assert f"excused by RALPH_ALLOW_SKIP: {excuse}" in output
