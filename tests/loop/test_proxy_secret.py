"""The agent proxy's secret stays secret (issue 37, lower findings): the shipped runbooks put its
URL on the agent's command line (demo.yaml's `--url`, aider.yaml's `--openai-api-base`), where
every local user reads it (`ps`), and an agent's error that printed the URL put the token in
the death record's output tail and the death log. Now the URL rides in the agent's environment
and the token is masked wherever ralph-run writes; the proxy compares it in constant time."""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest
import yaml
from support.e2e import AGENT_STEP, Scenario
from support.standin import wait_for

from ralph_runner.durable import redaction

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PROXY_URL = re.compile(r"127\.0\.0\.1:\d+/([A-Za-z0-9_-]{24})/v1")  # a token, not ****


def _demo_agent_step() -> dict[str, object]:
    """runbooks/demo.yaml's agent step as shipped, thinking 3 s instead of 0.3, after saying
    its URL (as agents do in their banners and errors)."""
    demo = yaml.safe_load((ROOT / "runbooks" / "demo.yaml").read_text())
    step = next(s for s in demo["loop"]["steps"] if s.get("name") == "run the agent")
    shell = step["shell"].replace("--sleep 0.3", "--sleep 3")
    step["shell"] = f'echo "agent at ${{RALPH_BASE_URL:-its --url}}" && {shell}'
    return {**step, "name": AGENT_STEP}


def _command_lines(workdir: Path) -> list[str]:
    """Every command line of the processes working in `workdir` (not other tests' agents)."""
    return [
        " ".join(process.info["cmdline"] or [])
        for process in psutil.process_iter(["cmdline", "cwd"])
        if process.info["cwd"] == str(workdir)
    ]


def _once_the_agent_runs(workdir: Path) -> list[str]:
    """The command lines in `workdir` once the demo's agent is among them, else none."""
    lines = _command_lines(workdir)
    return lines if any("ralph_runner.standin.agent" in line for line in lines) else []


def test_the_token_is_neither_in_ps_nor_in_the_death_record(scenario: Scenario) -> None:
    """The demo's agent, through the proxy, says its URL; the server dies during its step. No
    process's command line held the token meanwhile; the death record's output tail shows the
    URL with the token masked, and no file or stream of ralph-run's holds it."""
    scenario.prepare(["add the road"])
    document = yaml.safe_load(scenario.runbook_path.read_text())
    document["loop"]["proxy"] = True
    document["loop"]["steps"][1] = _demo_agent_step()
    scenario.runbook_path.write_text(yaml.safe_dump(document, sort_keys=False))
    run = scenario.start()
    run.wait_status(lambda s: s.get("phase") == AGENT_STEP, "the agent step")
    # the step's phase is written before its shell starts the agent: look until the agent runs
    lines = wait_for(lambda: _once_the_agent_runs(scenario.workspace), what="the demo's agent")
    seen = [line for line in lines if PROXY_URL.search(line)]
    scenario.standin.trigger(die=True)
    run.wait(90)

    assert seen == [], "the proxy's token on a command line"
    deaths = scenario.records("death")
    assert deaths, run.stderr
    tail = str(deaths[0].get("step", {}).get("output_tail", ""))
    assert re.search(r"agent at http://127\.0\.0\.1:\d+/\*\*\*\*/v1", tail), tail
    everything = scenario.death_log() + run.stderr + str(scenario.records()) + str(run.events)
    assert not PROXY_URL.search(everything), PROXY_URL.search(everything)


def test_a_secret_registered_later_is_masked_by_an_older_redactor() -> None:
    """The console's redactor is made before the proxy starts: it masks the token too."""
    older = redaction.Redactor(["hunter22"])
    token = "Zq3" * 8
    redaction.register(token)
    assert (
        older.text(f"http://127.0.0.1:9/{token}/v1 hunter22") == "http://127.0.0.1:9/****/v1 ****"
    )
