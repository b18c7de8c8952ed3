"""Secret masking proven over every file and stream ralph-run writes (issue 11, defect 1).

A secret goes into every field that can carry one: a `secrets:` value in the probe URL (a
refused probe's reason names its URL), an `sk-...` token in a checklist item (the state keeps
strikes and the current item by its text), both in a collector's output and in a step's
output. Two real loops each see a real death of the stand-in server (one with the human console
and -v, one with --json -v); then every operator command runs. Every file under the workdir
that ralph-run wrote and every captured stream is searched for both secrets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.e2e import AGENT_STEP, RalphRun, Scenario, runbook

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3t-value-of-api-key"
TOKEN = "sk-" + "Zq9" * 8  # an OpenAI-shaped key, masked whether or not `secrets:` names it
MASK = "****"
# What the test itself wrote into the workdir (the operator's input, and the agent's commits).
INPUTS = {"CHECKLIST.md", "PLAN.md"}


def _leaky_runbook() -> dict:
    document = runbook(variables={"api_key": SECRET})
    document["secrets"] = ["api_key"]
    document["metrics"] = {"textfile": "metrics/ralph.prom"}
    document["recorder"] = {  # the flight recorder keeps the server log under .ralph/recorder/
        "follow": f"echo server log {{{{ api_key }}}} {TOKEN}; exec sleep 600",
        "gpu": False,
    }
    probe = document["health"]["probes"][0]
    probe["http"]["url"] = "{{ base_url }}/models?api_key={{ api_key }}&token=" + TOKEN
    document["diagnostics"]["collect"].append(
        {"name": "leaky collector", "shell": f"echo collector {{{{ api_key }}}} {TOKEN}"}
    )
    document["loop"]["steps"].insert(
        1, {"name": "leaky step", "shell": f"echo step {{{{ api_key }}}} {TOKEN}"}
    )
    return document


def _start(scenario: Scenario, *flags: str) -> RalphRun:
    command = [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path), *flags]
    run = RalphRun([*command, "-e", json.dumps(scenario.facts)], scenario.workspace)
    scenario.runs.append(run)
    return run


def _die_during_the_agent(scenario: Scenario, run: RalphRun) -> str:
    """The server dies while the agent works; the run recovers and finishes: its streams."""
    run.wait_status(
        lambda s: s.get("phase") == AGENT_STEP and s.get("status") == "running", "agent step"
    )
    scenario.standin.trigger(die=True)
    assert run.wait(60) == 0, run.stderr
    return "".join(run.noise) + json.dumps(run.events) + run.stderr


def _written_files(workdir: Path) -> dict[str, str]:
    return {
        str(path.relative_to(workdir)): path.read_text(encoding="utf-8", errors="replace")
        for path in sorted(workdir.rglob("*"))
        if path.is_file() and ".git" not in path.parts and path.name not in INPUTS
    }


def test_no_secret_in_any_file_or_stream(scenario: Scenario) -> None:
    scenario.prepare([f"fix the leak of {TOKEN}"])
    scenario.runbook_path.write_text(yaml.safe_dump(_leaky_runbook(), sort_keys=False))
    (scenario.workspace / "metrics").mkdir()
    facts = ["-e", json.dumps(scenario.facts)]

    streams = {"human run": _die_during_the_agent(scenario, _start(scenario, "-v"))}
    with (scenario.workspace / "CHECKLIST.md").open("a") as checklist:
        checklist.write(f"- [ ] and again {TOKEN}\n")
    git = ["git", "-C", str(scenario.workspace)]
    subprocess.run([*git, "commit", "-qam", "one more item"], check=True)
    streams["json run"] = _die_during_the_agent(scenario, _start(scenario, "--json", "-v"))

    runbook_path = str(scenario.runbook_path)
    streams["status"] = scenario.command("status", str(scenario.workspace))
    streams["status --json"] = scenario.command("status", "--json", str(scenario.workspace))
    streams["deaths"] = scenario.command("deaths", runbook_path, *facts)
    streams["deaths --json"] = scenario.command("deaths", str(scenario.workspace), "--json")
    report = scenario.workspace / "report.html"
    streams["report"] = scenario.command("report", str(scenario.workspace), "-o", str(report))
    streams["--check"] = scenario.command(runbook_path, "--check", *facts)
    streams["--check --json"] = scenario.command(runbook_path, "--check", "--json", *facts)
    streams["diagnose"] = scenario.command("diagnose", runbook_path, *facts)
    scenario.standin.stop()  # a refused probe's detail names the URL, secret and all
    streams["probe"] = scenario.command("probe", runbook_path, *facts)
    streams["probe --json"] = scenario.command("probe", "--json", runbook_path, *facts)

    files = _written_files(scenario.workspace)
    assert {
        ".ralph/state.json",
        ".ralph/status.json",
        "logs/deaths.log",
        "logs/deaths.jsonl",
        "metrics/ralph.prom",
        "report.html",
    } <= set(files), sorted(files)
    everything = {**{f"stream {k}": v for k, v in streams.items()}, **files}
    leaks = [name for name, text in everything.items() if SECRET in text or TOKEN in text]
    assert not leaks, {name: everything[name][-2000:] for name in leaks}

    # The secrets were there to leak: each place shows the mask where the value would be.
    state = json.loads(files[".ralph/state.json"])
    assert "api_key=****" in state["last_death"]["reason"], state["last_death"]
    assert MASK in files[".ralph/status.json"]
    assert "api_key=****" in streams["status"]
    assert f"collector {MASK} {MASK}" in files["logs/deaths.log"]
    assert f"fix the leak of {MASK}" in files["logs/deaths.jsonl"]
    assert f"step {MASK} {MASK}" in streams["human run"] and f"step {MASK}" in streams["json run"]
    assert "api_key=****" in streams["human run"] and "api_key=****" in streams["json run"]
    assert "api_key=****" in streams["--check"] and "api_key=****" in streams["probe"]
    assert len(scenario.records("death")) == 2
