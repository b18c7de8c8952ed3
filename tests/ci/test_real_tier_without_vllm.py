"""The README's test command is green on a machine without vLLM: the real tier's tests skip with
the install's one-line reason, and the `[stand-in]` halves of test_real_faithful.py, which need
no engine, still run. They used to error: tests/real/conftest.py started the real vLLM whenever
a `[vllm]` item was collected, skipped or not (issue 31, item 15).

The tier runs in a copy of the suite under tmp_path, whose `.cache/` has no vLLM (or says it is
unavailable), so what this checkout has installed does not matter.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def copy_of_the_real_tier(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    (checkout / "tests").mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", checkout)
    shutil.copy2(ROOT / "tests" / "conftest.py", checkout / "tests")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "tests" / "support", checkout / "tests" / "support", ignore=ignore)
    shutil.copytree(ROOT / "tests" / "real", checkout / "tests" / "real", ignore=ignore)
    return checkout


def run_the_tier(checkout: Path, **env: str) -> tuple[int, str]:
    drop = ("CI", "RALPH_ALLOW_SKIP", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")
    environ = {k: v for k, v in os.environ.items() if k not in drop and "PYTEST" not in k}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/real"]
    done = subprocess.run(
        command, cwd=checkout, env={**environ, **env}, capture_output=True, text=True, timeout=300
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("unavailable", [False, True], ids=["not-installed", "unavailable"])
def test_without_vllm_the_real_tier_skips_with_its_reason_and_the_stand_in_halves_run(
    tmp_path: Path, unavailable: bool
) -> None:
    checkout = copy_of_the_real_tier(tmp_path)
    reason = "real vLLM not installed: run ci/install-vllm.sh"
    if unavailable:
        (checkout / ".cache").mkdir()
        (checkout / ".cache" / "vllm-venv.unavailable").write_text("no wheel for this CPU\n")
        reason = "real vLLM unavailable here: no wheel for this CPU"
    code, output = run_the_tier(checkout)
    assert code == 0, output
    assert not re.search(r"\berrors?\b", output.splitlines()[-1]), output
    summary = output.splitlines()[-1]
    assert re.match(r"7 passed, \d+ skipped in ", summary), output  # the 7 [stand-in] halves
    assert reason in output
    assert "faithful.py::test_chat_stream_chunks[stand-in]" not in output  # neither error nor skip


def test_under_ci_the_skipped_tier_fails_the_run_unless_it_is_allowed(tmp_path: Path) -> None:
    checkout = copy_of_the_real_tier(tmp_path)
    code, output = run_the_tier(checkout, CI="true")
    assert code == 1, output
    assert re.search(r"CI: the real tier skipped \d+ test\(s\) that RALPH_ALLOW_SKIP", output)
    code, output = run_the_tier(checkout, CI="true", RALPH_ALLOW_SKIP="real/vllm: no vLLM here")
    assert code == 0, output
    assert "excused by RALPH_ALLOW_SKIP: real/vllm: no vLLM here" in output
