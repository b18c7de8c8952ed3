"""CI excuses a skip per test, by what its reason says is missing, and requires each install tier
to have run the tests that need its install (issue 31, item 16).

It used to excuse a whole tier for any install failure: npm failing (opencode, codex) excused
aider's tests too, and a tier counted as having run when only the tests that need nothing ran
(test_real_faithful.py's `[stand-in]` halves, the agents' recipes).

Each case runs in a copy of the suite's tier logic under tmp_path (tests/conftest.py,
tests/support/, tests/agents' helpers) with small tiers of its own: `tests/agents/` with one test
per agent that needs its binary (agent_helpers.require, as test_agents_loop.py) and one that needs
nothing, `tests/real/` with a `[stand-in]` and a `[vllm]` half. The agents case runs the real
ci/install-agents.sh (npm made to fail) and ci/run-tests.sh, whose tests/run runs that tier.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("opencode", "codex", "aider")

AGENTS_TIER = """
import pytest
from agent_helpers import require


@pytest.mark.agents  # needs the agent's binary, as test_agents_loop.py's tests
@pytest.mark.parametrize("agent", ["opencode", "codex", "aider"])
def test_the_agent_runs(agent):
    assert require(agent).exists()


def test_the_recipe_renders():  # needs nothing, as test_recipes.py
    pass
"""

REAL_TIER = """
import os
import pytest


@pytest.fixture(params=["stand-in", pytest.param("vllm", marks=pytest.mark.real)])
def target(request):
    if request.param == "vllm" and not os.environ.get("FAKE_VLLM"):
        pytest.skip("real vLLM not installed: run ci/install-vllm.sh")
    return request.param


def test_chat_stream_chunks(target):
    assert target in ("stand-in", "vllm")
"""


def write_script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n", encoding="utf-8")
    path.chmod(0o755)


def checkout_with_small_tiers(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    (checkout / "tests" / "agents").mkdir(parents=True)
    (checkout / "tests" / "real").mkdir()
    (checkout / "ci").mkdir()
    shutil.copy2(ROOT / "pyproject.toml", checkout)
    shutil.copy2(ROOT / "tests" / "conftest.py", checkout / "tests")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "tests" / "support", checkout / "tests" / "support", ignore=ignore)
    for name in ("conftest.py", "agent_helpers.py"):
        shutil.copy2(ROOT / "tests" / "agents" / name, checkout / "tests" / "agents")
    (checkout / "tests" / "agents" / "test_agents.py").write_text(AGENTS_TIER)
    (checkout / "tests" / "real" / "test_faithful.py").write_text(REAL_TIER)
    return checkout


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("CI", "RALPH_ALLOW_SKIP", "RALPH_EVERY_TIER", "FAKE_VLLM")
    env = {k: v for k, v in os.environ.items() if k not in drop and "PYTEST" not in k}
    return {**env, **extra}


def pytest_in(checkout: Path, *args: str, **env: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    done = subprocess.run(
        command, cwd=checkout, env=clean_env(**env), capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout + done.stderr


def install_agents_with_npm_failing(checkout: Path, tmp_path: Path, aider: bool) -> str:
    """ci/install-agents.sh, run in the copy with an npm that fails; aider "installed" (a venv
    whose python says the pinned version, a pip that puts an `aider` in place) or not (a pip
    that fails). Its one line, in .cache/install-agents.out as .ci/run leaves it."""
    shutil.copy2(ROOT / "ci" / "install-agents.sh", checkout / "ci" / "install-agents.sh")
    venv = checkout / ".cache" / "aider-venv" / "bin"
    write_script(venv / "python", "echo 0.86.2")
    put = f"touch {venv / 'aider'} && chmod +x {venv / 'aider'}"
    write_script(checkout / "ci" / "pip-install.sh", put if aider else "exit 1")
    write_script(tmp_path / "bin" / "npm", "echo 'npm ERR! network unreachable' >&2; exit 1")
    env = clean_env(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", "ci/install-agents.sh"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = done.stdout.strip().splitlines()[-1]
    (checkout / ".cache" / "install-agents.out").write_text(done.stdout)
    return line


def run_the_gate(checkout: Path, tmp_path: Path) -> tuple[int, str]:
    """ci/run-tests.sh in the copy: its venv and pip steps succeed (stand-ins), its tests/run
    runs the small agents tier; the other installs said they were ready."""
    shutil.copy2(ROOT / "ci" / "run-tests.sh", checkout / "ci" / "run-tests.sh")
    for install in ("vllm", "llamacpp", "docker", "browser"):
        (checkout / ".cache" / f"install-{install}.out").write_text(f"{install} tier: ready\n")
    write_script(
        tmp_path / "bin" / "python3",
        "mkdir -p .venv/bin && printf '#!/bin/sh\\nexit 0\\n' >.venv/bin/pip"
        " && chmod +x .venv/bin/pip",
    )
    pytest = f"{sys.executable} -m pytest -q -p no:cacheprovider"
    write_script(checkout / "tests" / "run", f'echo "RALPH_ALLOW_SKIP=$RALPH_ALLOW_SKIP"\n'
                 f"exec {pytest} -m agents tests/agents")  # fmt: skip
    env = clean_env(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", "ci/run-tests.sh"], cwd=checkout, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


# What npm failing leaves out: its agents (claude has its own npm step, which fails too).
NPM_AGENTS = {"agents/opencode", "agents/codex", "agents/claude"}


def excused_names(output: str) -> set[str]:
    line = next(x for x in output.splitlines() if x.startswith("RALPH_ALLOW_SKIP="))
    value = line.removeprefix("RALPH_ALLOW_SKIP=")
    names = {entry.split(":", 1)[0].strip() for entry in value.split(";")}
    return {name for name in names if name.startswith("agents/")}  # not this machine's sshd's


def test_npm_failing_excuses_the_npm_agents_tests_and_aiders_run(tmp_path: Path) -> None:
    checkout = checkout_with_small_tiers(tmp_path)
    line = install_agents_with_npm_failing(checkout, tmp_path, aider=True)
    assert "could not: opencode codex (npm install" in line, line
    code, output = run_the_gate(checkout, tmp_path)
    assert code == 0, output
    assert excused_names(output) == NPM_AGENTS, output
    assert "2 passed, 2 skipped" in output, output  # aider's test and the recipe ran
    assert "needing its install: ran 1" in output, output  # aider's
    # Each skip carries the install's own line, after what is missing.
    assert f"opencode not installed at .cache/agents/node_modules/.bin/opencode: {line}" in output


def test_npm_failing_does_not_excuse_a_missing_aider(tmp_path: Path) -> None:
    """npm failed, and aider is missing although its install did not say it could not (here
    its pip failed, but its statement, .cache/agents/aider.unavailable, is taken away; its
    output still says "failed"): aider's test is not excused."""
    checkout = checkout_with_small_tiers(tmp_path)
    line = install_agents_with_npm_failing(checkout, tmp_path, aider=False)
    assert "aider (pip install aider-chat" in line, line
    (checkout / ".cache" / "agents" / "aider.unavailable").unlink()
    code, output = run_the_gate(checkout, tmp_path)
    assert code == 1, output
    assert excused_names(output) == NPM_AGENTS, output
    assert "CI: the agents tier skipped 1 test(s) that RALPH_ALLOW_SKIP does not excuse" in output
    assert "(aider not installed at .cache/aider-venv/bin/aider: " in output, output


def test_with_aider_failing_too_each_agent_is_excused_by_its_own_failure(tmp_path: Path) -> None:
    checkout = checkout_with_small_tiers(tmp_path)
    install_agents_with_npm_failing(checkout, tmp_path, aider=False)
    code, output = run_the_gate(checkout, tmp_path)
    assert code == 0, output
    assert excused_names(output) == {f"agents/{agent}" for agent in AGENTS} | NPM_AGENTS, output
    assert "1 passed, 3 skipped" in output, output


def test_a_tier_whose_only_ran_tests_are_stand_in_halves_fails_under_ci(tmp_path: Path) -> None:
    checkout = checkout_with_small_tiers(tmp_path)
    # The [vllm] halves are not run (deselected here; a conftest that dropped them when the
    # engine is missing would do the same): no skip, and only the [stand-in] halves ran.
    code, output = pytest_in(checkout, "tests/real", "-k", "stand-in", CI="true", FAKE_VLLM="1")
    assert code == 1, output
    assert (
        "CI: the real tier ran no test that needs its install (1 ran that need nothing)" in output
    )
    # The same without CI is green, and so is CI where the [vllm] half ran.
    code, output = pytest_in(checkout, "tests/real", "-k", "stand-in", FAKE_VLLM="1")
    assert code == 0, output
    code, output = pytest_in(checkout, "tests/real", CI="true", FAKE_VLLM="1")
    assert code == 0, output
    assert "needing its install: ran 1" in output, output
    # The agents tier where only the recipe ran, the same.
    code, output = pytest_in(checkout, "tests/agents", "-k", "recipe", CI="true")
    assert code == 1, output
    assert "CI: the agents tier ran no test that needs its install" in output


def test_a_skip_is_excused_only_by_an_entry_naming_what_it_lacks(tmp_path: Path) -> None:
    checkout = checkout_with_small_tiers(tmp_path)
    for allow, excused in [
        ("real/vllm: no wheel for this CPU", True),
        ("real/vLLM: no wheel for this CPU", True),  # any case
        ("real: no wheel for this CPU", False),  # a whole tier is no longer excused
        ("agents/vllm: no wheel for this CPU", False),  # another tier's
        ("real/ci: the install said nothing", False),  # "ci" is in the reason's tail only
    ]:
        code, output = pytest_in(checkout, "tests/real", CI="true", RALPH_ALLOW_SKIP=allow)
        assert code == (0 if excused else 1), (allow, output)
        if excused:
            assert "excused by RALPH_ALLOW_SKIP: real/" in output, output
            assert "needing its install: ran 0" in output, output
        else:
            assert "CI: the real tier skipped 1 test(s) that RALPH_ALLOW_SKIP does not" in output
