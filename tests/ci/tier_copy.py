"""A tier's tests run in a copy of the suite under tmp_path, whose `.cache/` has none of this
checkout's installs (or says why one could not happen): what a fresh machine without them sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def count_tests(folder: str) -> int:
    """How many tests the tier's folder defines (each must skip where its install is missing)."""
    return sum(
        line.startswith("def test_")
        for module in (ROOT / "tests" / folder).glob("test_*.py")
        for line in module.read_text(encoding="utf-8").splitlines()
    )


def copy_of_the_tier(tmp_path: Path, folder: str) -> Path:
    """The suite's machinery and one tier's folder, nothing else, under tmp_path/checkout."""
    checkout = tmp_path / "checkout"
    (checkout / "tests").mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", checkout)
    shutil.copy2(ROOT / "tests" / "conftest.py", checkout / "tests")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "tests" / "support", checkout / "tests" / "support", ignore=ignore)
    shutil.copytree(ROOT / "tests" / folder, checkout / "tests" / folder, ignore=ignore)
    return checkout


def run_the_tier(checkout: Path, folder: str, timeout: float = 120, **env: str) -> tuple[int, str]:
    """pytest on the copy's tier, outside this run's CI settings unless `env` gives them."""
    drop = (
        "CI",
        "RALPH_ALLOW_SKIP",
        "RALPH_EVERY_TIER",
        "PYTEST_XDIST_WORKER",
        "PYTEST_XDIST_WORKER_COUNT",
    )
    environ = {k: v for k, v in os.environ.items() if k not in drop and "PYTEST" not in k}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, f"tests/{folder}"],
        cwd=checkout,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr
