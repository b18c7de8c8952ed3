"""CI requires every tier (issue 42, "CI holes"): under RALPH_EVERY_TIER=1 (ci/run-tests.sh) a
tier that the run selects and that ran no test (all deselected, never collected) fails the run,
where it used to vanish from the table of the tiers and leave CI green; `tests/run` fails when
one of its two parts selects nothing (pytest's 5 was read as 0); and ci/run-tests.sh excuses a
skip only by an install's own `.unavailable` statement, not by words in its output.

Each case runs the real tier machinery (tests/conftest.py, tests/support/) or the real script in
a small checkout under tmp_path with tiers of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.tiers import TIERS, selected_tiers

ROOT = Path(__file__).resolve().parents[2]
PASSING = "def test_it():\n    pass\n"


def small_checkout(tmp_path: Path, tiers: dict[str, str]) -> Path:
    """The tier machinery and one passing test per folder given ({"real": "test_x.py"})."""
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", root)
    shutil.copy2(ROOT / "tests" / "conftest.py", root / "tests")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "tests" / "support", root / "tests" / "support", ignore=ignore)
    for folder, module in tiers.items():
        (root / "tests" / folder).mkdir(exist_ok=True)
        (root / "tests" / folder / module).write_text(PASSING)
    return root


def environment(**extra: str) -> dict[str, str]:
    drop = ("CI", "RALPH_ALLOW_SKIP", "RALPH_EVERY_TIER")
    kept = {k: v for k, v in os.environ.items() if k not in drop and "PYTEST" not in k}
    return {**kept, **extra}


def pytest_in(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=environment(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tiers_a_mark_expression_selects() -> None:
    assert selected_tiers("") == list(TIERS)
    assert selected_tiers("unit or system") == ["unit", "system"]
    rest = selected_tiers("not unit and not system")
    assert "unit" not in rest and "system" not in rest and "real" in rest and "agents" in rest


def test_a_selected_tier_with_no_test_fails_under_every_tier(tmp_path: Path) -> None:
    root = small_checkout(tmp_path, {"loop": "test_loop.py"})  # the system tier only
    done = pytest_in(root, "-m", "unit or system", CI="true", RALPH_EVERY_TIER="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "CI: the unit tier ran no test (none collected, or all deselected)" in done.stdout
    assert "the system tier ran no test" not in done.stdout


def test_a_tier_whose_tests_are_all_deselected_fails_and_is_no_exit_5(tmp_path: Path) -> None:
    root = small_checkout(tmp_path, {"docker": "test_compose.py"})
    done = pytest_in(root, "-m", "docker", "-k", "nothing_matches", CI="true", RALPH_EVERY_TIER="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "CI: the docker tier ran no test (none collected, or all deselected)" in done.stdout
    # without RALPH_EVERY_TIER the same run is pytest's "nothing selected", as before
    assert pytest_in(root, "-m", "docker", "-k", "nothing_matches").returncode == 5


def test_every_selected_tier_that_ran_passes(tmp_path: Path) -> None:
    root = small_checkout(tmp_path, {"loop": "test_loop.py"})
    (root / "tests" / "loop" / "test_templating.py").write_text(PASSING)  # a unit module
    done = pytest_in(root, "-m", "unit or system", CI="true", RALPH_EVERY_TIER="1")
    assert done.returncode == 0, done.stdout + done.stderr


def test_tests_run_fails_when_one_part_selects_nothing(tmp_path: Path) -> None:
    """Only unit and system tests here: the second part (the install tiers) selects nothing."""
    root = small_checkout(tmp_path, {"loop": "test_loop.py"})
    (root / "tests" / "loop" / "test_templating.py").write_text(PASSING)
    shutil.copy2(ROOT / "tests" / "run", root / "tests" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pytest").write_text(f'#!/bin/sh\nexec {sys.executable} -m pytest "$@"\n')
    (bin_dir / "pytest").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(
        ["bash", "tests/run", "-p", "no:cacheprovider"],
        cwd=root,
        env=environment(PATH=path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 5, done.stdout + done.stderr
    assert "2 passed" in done.stdout and "2 deselected" in done.stdout  # then nothing: 5


def run_tests_script(root: Path, tmp_path: Path) -> str:
    """ci/run-tests.sh in `root`, its venv, pip and tests/run stand-ins: what it exported."""
    (root / "ci").mkdir(exist_ok=True)
    shutil.copy2(ROOT / "ci" / "run-tests.sh", root / "ci" / "run-tests.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(
        "#!/bin/sh\nmkdir -p .venv/bin && printf '#!/bin/sh\\nexit 0\\n' >.venv/bin/pip"
        " && chmod +x .venv/bin/pip\n"
    )
    (bin_dir / "python3").chmod(0o755)
    run = root / "tests" / "run"
    run.write_text(
        '#!/bin/sh\necho "ALLOW=$RALPH_ALLOW_SKIP"; echo "EVERY=$RALPH_EVERY_TIER CI=$CI"\n'
    )
    run.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(
        ["bash", "ci/run-tests.sh"],
        cwd=root,
        env=environment(PATH=path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_ci_excuses_only_from_an_installs_own_unavailable_statement(tmp_path: Path) -> None:
    root = small_checkout(tmp_path, {})
    cache = root / ".cache"
    (cache / "agents").mkdir(parents=True)
    # words in an install's output excuse nothing ...
    (cache / "install-vllm.out").write_text("vllm tier: failed, exited, could not, skipped\n")
    (cache / "install-docker.out").write_text("install-docker: no docker daemon answers\n")
    # ... its statement does, for what it names
    (cache / "llamacpp.unavailable").write_text("llamacpp tier: skipped: no compiler\n")
    (cache / "agents" / "codex.unavailable").write_text("install-agents: codex (npm not found)\n")
    said = run_tests_script(root, tmp_path)
    allow = next(line for line in said.splitlines() if line.startswith("ALLOW="))
    entries = {entry.split(":", 1)[0] for entry in allow.removeprefix("ALLOW=").split(";")}
    expected = {"llamacpp/llama.cpp", "agents/codex"}
    # this machine's own sshd and promtool statements are not in the copy: none
    assert entries == expected, said
    assert "llamacpp tier: skipped: no compiler" in allow
    assert "EVERY=1 CI=true" in said
