"""The shipped agent recipes load, validate and render (`--check`), with no agent installed.

The real binaries run them in test_agents_loop.py; this keeps a broken recipe from passing
unnoticed on a machine without the agents.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from agent_helpers import RECIPES, agent_steps
from support.e2e import make_workspace
from support.standin import ROOT, python_env

EXPECTED = {  # what each rendered step must say (README, "Agents")
    "opencode": ["opencode run --model vllm/qwen3-coder --title", "-f CHECKLIST.md --"],
    "codex": ["codex exec --skip-git-repo-check", 'wire_api="responses"', "-m qwen3-coder"],
    "aider": ["aider --model openai/qwen3-coder", "--edit-format whole --yes-always"],
    "claude": ["claude -p --model qwen3-coder", '--allowedTools "Bash Read Edit Write Glob Grep"'],
}


def check(runbook: dict, tmp_path: Path) -> str:
    """--check from a workdir the run would accept: a git repository with its CHECKLIST.md."""
    path = tmp_path / "runbook.yaml"
    path.write_text(yaml.safe_dump(runbook, sort_keys=False))
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(path), "--check"],
        cwd=make_workspace(tmp_path / "work", ["an item"]),
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("agent", sorted(EXPECTED))
def test_the_recipe_renders_the_agents_command(agent: str, tmp_path: Path) -> None:
    runbook = {
        "name": f"{agent} recipe",
        "vars": {"base_url": "http://127.0.0.1:8000/v1", "model": "qwen3-coder"},
        "checklist": {"path": "CHECKLIST.md"},
        "prompt": "Do it, commit: {{ item.text }}",
        "loop": {"steps": agent_steps(agent)},
    }
    plan = " ".join(check(runbook, tmp_path).split())  # --check folds long lines
    for expected in EXPECTED[agent]:
        assert expected in plan, plan


def test_the_opencode_provider_template_is_json_with_env_placeholders() -> None:
    config = json.loads((RECIPES / "opencode.json").read_text())
    provider = config["provider"]["vllm"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == "{env:RALPH_BASE_URL}"
    assert list(provider["models"]) == ["{env:RALPH_MODEL}"]
    vllm = (ROOT / "runbooks" / "vllm.yaml").read_text()
    assert 'OPENCODE_CONFIG: "{{ runbook_dir }}/agents/opencode.json"' in vllm
