"""The mutation guard (ci/mutation_guard.py, ci/mutations.yaml): a break whose tests still pass
fails it, and so does a break whose text is not in its file, a baseline that fails, or a skip.

Each case runs the real guard on a small checkout of its own (a git repository under tmp_path:
one rule, one test), so a case takes seconds; the last checks the shipped list against this
checkout without running it (CI runs it whole)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[2]
GUARD = ROOT / "ci" / "mutation_guard.py"


def load_guard() -> ModuleType:
    """ci/mutation_guard.py as a module (ci/ is no package: the guard is a script)."""
    spec = importlib.util.spec_from_file_location("mutation_guard", GUARD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mutation_guard = load_guard()

RULE = "def strikes_before_skip():\n    return 3\n"
IMPORT = "from rule import strikes_before_skip\n\n\n"
CATCHING = IMPORT + "def test_three():\n    assert strikes_before_skip() == 3\n"
BLIND = IMPORT + "def test_some():\n    assert strikes_before_skip() > 0\n"  # > 0: 4 passes


def checkout(tmp_path: Path, test: str = CATCHING) -> Path:
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "rule.py").write_text(RULE)
    (root / "test_rule.py").write_text(test)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def guard(root: Path, *breaks: dict[str, object]) -> subprocess.CompletedProcess[str]:
    listed = root.parent / "breaks.yaml"
    listed.write_text(yaml.safe_dump({"breaks": list(breaks)}))
    return subprocess.run(
        [sys.executable, str(GUARD), "--root", str(root), "--list", str(listed), "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )


def a_break(find: str = "return 3", replace: str = "return 4") -> dict[str, object]:
    return {
        "name": "strikes one late",
        "file": "rule.py",
        "find": find,
        "replace": replace,
        "tests": ["test_rule.py"],
    }


def test_a_break_its_test_catches_passes_the_guard(tmp_path: Path) -> None:
    done = guard(checkout(tmp_path), a_break())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "caught strikes one late: 1 test(s) failed" in done.stdout
    assert "1 of 1 breaks caught" in done.stdout


def test_a_break_that_survives_fails_the_guard(tmp_path: Path) -> None:
    done = guard(checkout(tmp_path, BLIND), a_break())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL strikes one late: survived: 1 test(s) passed" in done.stdout
    assert "0 of 1 breaks caught" in done.stdout


def test_a_text_not_in_its_file_fails_the_guard_before_any_test(tmp_path: Path) -> None:
    done = guard(checkout(tmp_path), a_break(find="return 5"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL strikes one late: its text is not found in rule.py: 'return 5'" in done.stdout
    assert "baseline" not in done.stdout  # nothing ran


def test_a_break_that_only_breaks_the_import_is_no_catch(tmp_path: Path) -> None:
    """A syntax error fails collection, not a test: it proves nothing of the test's claim."""
    done = guard(checkout(tmp_path), a_break(replace="return (("))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL strikes one late: not a test failure (pytest exit 2)" in done.stdout


def test_a_failing_baseline_fails_the_guard(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    (root / "rule.py").write_text(RULE.replace("3", "2"))
    done = guard(root, a_break(find="return 2"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL baseline: the named tests must pass unmodified" in done.stdout


def test_a_skipped_test_in_the_baseline_fails_the_guard(tmp_path: Path) -> None:
    skipping = "import pytest\n\n\ndef test_three():\n    pytest.skip('not here')\n"
    done = guard(checkout(tmp_path, skipping), a_break())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "baseline: 0 passed, 0 failed, 1 skipped" in done.stdout


def test_a_list_with_a_missing_key_is_exit_2_with_where(tmp_path: Path) -> None:
    entry = a_break()
    del entry["tests"]
    done = guard(checkout(tmp_path), entry)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "breaks.yaml: breaks.0.tests: Field required" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_shipped_list_has_15_breaks_each_found_once_with_tests_that_exist() -> None:
    listed = mutation_guard.load(ROOT / "ci" / "mutations.yaml")
    assert len(listed.breaks) >= 15
    assert len({b.name for b in listed.breaks}) == len(listed.breaks)
    for item in listed.breaks:
        assert mutation_guard.text_problem(ROOT, item) is None, item.name
        for test in item.tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).is_file(), test
            assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), test
