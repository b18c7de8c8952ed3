"""Masking by a variable's name (issue 29, finding 12): a value passed as `-e other_key=...`,
which no `secrets:` lists, appeared in 9 files; `--check` printed notify URLs with their
credentials. Now a variable named like a secret (`*key`, `*token*`, `*password*`, `*secret*`)
is masked as a listed one is, and a URL's password or token is masked wherever it is written.
A real loop echoes the value in a step; every file and stream is searched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from support.e2e import RalphRun, Scenario, make_workspace, runbook

pytestmark = pytest.mark.timeout(120)

VALUE = "s3cr3tvalue"
PASSWORD = "hunter2hunter2"
URL_TOKEN = "ghp0a1b2c3d4e5f6"
INPUTS = {"CHECKLIST.md", "PLAN.md"}


def test_a_value_named_like_a_secret_and_url_credentials_are_masked(scenario: Scenario) -> None:
    scenario.prepare(["one item"])
    document = runbook()
    document["loop"]["steps"].insert(
        1, {"name": "talkative step", "shell": "echo step {{ other_key }} {{ hook }}"}
    )
    document["notify"] = {
        "to": [{"url": f"json://ops:{PASSWORD}@127.0.0.1:9/hook", "events": ["finished"]}],
        "deadman": f"https://{URL_TOKEN}@127.0.0.1:9/ping",
    }
    scenario.runbook_path.write_text(yaml.safe_dump(document, sort_keys=False))
    extra = {**scenario.facts, "other_key": VALUE, "hook": f"https://ops:{PASSWORD}@example.org/x"}
    facts = ["-e", json.dumps(extra)]
    runbook_path = str(scenario.runbook_path)

    command = [sys.executable, "-m", "ralph_runner", runbook_path, "-v", *facts]
    run = RalphRun(command, scenario.workspace)
    scenario.runs.append(run)
    assert run.wait(60) == 0, run.stderr
    streams = {"run -v": "\n".join(run.noise) + run.stderr}
    streams["--check"] = scenario.command(runbook_path, "--check", *facts)
    streams["--check --json"] = scenario.command(runbook_path, "--check", "--json", *facts)
    streams["status"] = scenario.command("status", "--json", str(scenario.workspace))

    files = {
        str(path.relative_to(scenario.workspace)): path.read_text("utf-8", errors="replace")
        for path in sorted(scenario.workspace.rglob("*"))
        if path.is_file() and ".git" not in path.parts and path.name not in INPUTS
    }
    assert ".ralph/state.json" in files, sorted(files)
    everything = {**{f"stream {k}": v for k, v in streams.items()}, **files}
    leaks = [
        name
        for name, text in everything.items()
        if VALUE in text or PASSWORD in text or URL_TOKEN in text
    ]
    assert not leaks, {name: everything[name][-2000:] for name in leaks}
    # they were there to leak: the mask stands where each was
    assert "step **** https://ops:****@example.org/x" in streams["run -v"]
    assert "json://ops:****@127.0.0.1:9/hook" in streams["--check"]
    assert "https://****@127.0.0.1:9/ping" in streams["--check"]


def test_a_count_named_like_tokens_is_not_masked(tmp_path: Path) -> None:
    """`max_tokens: 4096` is no secret: its value stays readable in --check."""
    scenario = Scenario(tmp_path)
    document = runbook(variables={"max_tokens": "4096", "prompt_token_budget": 2048})
    make_workspace(scenario.workspace, ["one item"])
    scenario.runbook_path.write_text(yaml.safe_dump(document, sort_keys=False))
    shown = scenario.command(str(scenario.runbook_path), "--check")
    assert "max_tokens: '4096'" in shown and "prompt_token_budget: 2048" in shown, shown


def test_a_placeholder_key_is_no_secret() -> None:
    """`api_key: EMPTY` (vLLM's docs) or `none` is what a local server takes where no key is
    checked: masking it would put `****` wherever the word appears, and hides nothing."""
    from ralph_runner.durable.redaction import secret_named

    for placeholder in ("EMPTY", "none", "dummy", "not-needed"):
        assert not secret_named("api_key", placeholder), placeholder
    assert secret_named("api_key", "s3cr3tvalue")
    assert secret_named("hf_token", "hf_notaplaceholder")


ENV_KEY = "envk3y-from-the-environment"  # named WANDB_API_KEY: masked
ENV_PAT = "envp4t-from-the-environment"  # GITHUB_PAT, read through lookup('env'): masked
PLAIN = "plain-setting-value"  # RALPH_PLAIN_SETTING: no secret's name, shown


def test_a_value_read_from_a_secret_named_environment_variable_is_masked(
    scenario: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`{{ env.WANDB_API_KEY }}` and `lookup('env', 'GITHUB_PAT')` printed in clear (issue 37):
    echoed by a step and a death's collector, in a -v run with a death, neither is anywhere."""
    from support.e2e import AGENT_STEP

    monkeypatch.setenv("WANDB_API_KEY", ENV_KEY)
    monkeypatch.setenv("GITHUB_PAT", ENV_PAT)
    monkeypatch.setenv("RALPH_PLAIN_SETTING", PLAIN)
    scenario.prepare(["one item"])
    document = runbook()
    echo = (
        "echo {} {{{{ env.WANDB_API_KEY }}}} {{{{ lookup('env', 'GITHUB_PAT') }}}}"
        " {{{{ env.RALPH_PLAIN_SETTING }}}}"
    )
    document["loop"]["steps"].insert(1, {"name": "env step", "shell": echo.format("step")})
    document["diagnostics"]["collect"].append({"name": "env", "shell": echo.format("collector")})
    scenario.runbook_path.write_text(yaml.safe_dump(document, sort_keys=False))
    command = [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path), "-v"]
    run = RalphRun([*command, "-e", json.dumps(scenario.facts)], scenario.workspace)
    scenario.runs.append(run)
    run.wait_status(
        lambda s: s.get("phase") == AGENT_STEP and s.get("status") == "running", "agent step"
    )
    scenario.standin.trigger(die=True)
    assert run.wait(60) == 0, run.stderr
    streams = {"run -v": "\n".join(run.noise) + run.stderr}
    streams["status"] = scenario.command("status", "--json", str(scenario.workspace))
    files = {
        str(path.relative_to(scenario.workspace)): path.read_text("utf-8", errors="replace")
        for path in sorted(scenario.workspace.rglob("*"))
        if path.is_file() and ".git" not in path.parts and path.name not in INPUTS
    }
    assert {".ralph/state.json", ".ralph/status.json", "logs/deaths.log"} <= set(files)
    everything = {**{f"stream {k}": v for k, v in streams.items()}, **files}
    leaks = [name for name, text in everything.items() if ENV_KEY in text or ENV_PAT in text]
    assert not leaks, {name: everything[name][-2000:] for name in leaks}
    assert f"step **** **** {PLAIN}" in streams["run -v"]
    assert f"collector **** **** {PLAIN}" in files["logs/deaths.log"]


def test_environment_names_that_look_secret() -> None:
    from ralph_runner.durable.redaction import env_secret_named

    for name in ("WANDB_API_KEY", "HF_TOKEN", "GITHUB_PAT", "PGPASSWORD", "AWS_SECRET", "PAT"):
        assert env_secret_named(name, "s3cr3tvalue"), name
    for name in ("HOME", "PATH", "MAX_TOKENS", "PATTERN"):
        assert not env_secret_named(name, "s3cr3tvalue"), name
    assert not env_secret_named("OPENAI_API_KEY", "EMPTY")  # vLLM's placeholder
    assert not env_secret_named("USE_KEYRING", "true")  # a switch
