"""The import layers of docs/architecture.md ("Imports") hold: `lint-imports` (import-linter)
checks the contracts in pyproject.toml's [tool.importlinter]. A package imports only the layers
below it, so no package imports itself back through others; the stand-in imports nothing else."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_imports_only_the_layers_below_it() -> None:
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("no import-linter: pip install -e '.[test]' installs it")
    script = Path(sys.executable).parent / "lint-imports"
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]
    )
    linted = subprocess.run(
        [*command, "--no-cache", "--no-logo"],  # --no-cache: no .import_linter_cache/ left here
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert "0 broken" in linted.stdout
