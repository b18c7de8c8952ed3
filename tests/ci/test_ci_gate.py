"""CI proves what it says: `.ci/run`'s last step (ci/run-tests.sh) runs the README's test command
verbatim and fails the run when any part of it fails. Under `set -e` a failing `python3 -m venv`
or `pip install` in a `&&` chain used to stop the chain but not the script, which exited 0 with
no test run (issue 31, item 14).

Each case runs the real script in a copy of the checkout's layout under tmp_path, with
python3, pip and tests/run replaced by stand-ins on PATH and in place that succeed or fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "ci" / "run-tests.sh"


def readme_test_command() -> str:
    """The README's second command: the line after `# 2. the tests`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"^# 2\. the tests\n(.+)$", text, re.MULTILINE)
    assert found, "README.md has no '# 2. the tests' command"
    return found[1]


def write_script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n", encoding="utf-8")
    path.chmod(0o755)


def run_gate(tmp_path: Path, *, venv: int, pip: int, tests: int) -> tuple[int, str, list[str]]:
    """ci/run-tests.sh in a copy under tmp_path: `python3 -m venv` exits `venv` (and, when it
    succeeds, makes a .venv/bin/pip that exits `pip`), tests/run exits `tests`. Its exit code,
    its output, and which of the three ran, in order."""
    checkout = tmp_path / "checkout"
    (checkout / "ci").mkdir(parents=True)
    shutil.copy2(GATE, checkout / "ci" / "run-tests.sh")
    # every tier's install went fine
    for install in ("vllm", "llamacpp", "agents", "docker", "browser"):
        (checkout / ".cache").mkdir(exist_ok=True)
        (checkout / ".cache" / f"install-{install}.out").write_text(f"{install} tier: ready\n")
    log = tmp_path / "calls.log"
    pip_body = f'echo "pip $*" >>{log}; exit {pip}'
    write_script(
        tmp_path / "bin" / "python3",
        f'echo "python3 $*" >>{log}\n'
        f"[ {venv} = 0 ] || exit {venv}\n"
        f"mkdir -p .venv/bin && printf '%s\\n' '#!/usr/bin/env bash' '{pip_body}' >.venv/bin/pip"
        " && chmod +x .venv/bin/pip",
    )
    write_script(checkout / "tests" / "run", f'echo "tests/run $*" >>{log}; exit {tests}')
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CI", "RALPH_ALLOW_SKIP", "RALPH_EVERY_TIER")
    }
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        ["bash", str(checkout / "ci" / "run-tests.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, done.stdout + done.stderr, [call.split()[0] for call in calls]


def test_the_gate_runs_the_readmes_test_command_verbatim_and_ci_calls_it() -> None:
    command = readme_test_command()
    lines = GATE.read_text(encoding="utf-8").splitlines()
    assert any(line.startswith(f"{command} || ") for line in lines), (
        f"ci/run-tests.sh does not run the README's second command verbatim: {command}"
    )
    # Called on a line of its own, under `set -e`, so its exit code stops .ci/run.
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "set -euo pipefail" in ci
    assert "ci/run-tests.sh" in ci.splitlines()


@pytest.mark.parametrize(
    ("venv", "pip", "tests", "ran"),
    [
        (1, 0, 0, ["python3"]),  # the venv cannot be made
        (0, 1, 0, ["python3", "pip"]),  # pip cannot install the test extra
        (0, 0, 1, ["python3", "pip", "tests/run"]),  # a test fails
    ],
    ids=["venv-fails", "pip-fails", "tests-fail"],
)
def test_any_failure_in_the_test_command_fails_ci(
    tmp_path: Path, venv: int, pip: int, tests: int, ran: list[str]
) -> None:
    code, output, calls = run_gate(tmp_path, venv=venv, pip=pip, tests=tests)
    assert code != 0, f"CI exited 0 although a step failed:\n{output}"
    assert calls == ran


def test_the_gate_is_green_when_every_step_is(tmp_path: Path) -> None:
    code, output, calls = run_gate(tmp_path, venv=0, pip=0, tests=0)
    assert code == 0, output
    assert calls == ["python3", "pip", "tests/run"]
    excused = next(line for line in output.splitlines() if line.startswith("ci: skips excused: "))
    # every tier's install said it was ready (this machine's sshd or promtool may be missing)
    assert not any(
        f"{tier}/" in excused for tier in ("real", "llamacpp", "agents", "docker", "browser")
    )
