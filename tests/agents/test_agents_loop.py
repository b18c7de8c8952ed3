"""opencode, codex and aider, the real binaries, drive a real ralph-run loop on the stand-in.

Each test runs one agent through the shipped recipe against the scripted stand-in and checks
what an operator would look at: the exit code, the checklist, the commits, the work tree, the
death records, the strikes, and that no process of the run is left. Faults are set when the
run's own state says the agent is at work (its first request moved the stand-in's token
counters), never after a sleep.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

import pytest
import yaml
from agent_helpers import RECIPES, AgentScenario, ended, wait_all_gone
from support.standin import ROOT, START_SCRIPT, cmdline_of, wait_for

AGENTS = ["opencode", "codex", "aider"]
# What each agent leaves in the repository besides its work (README, "Agents")
OWN_FILES = {
    "opencode": set(),  # and .git/opencode, its project id, inside .git
    "codex": set(),
    "aider": {".aider.chat.history.md", ".aider.input.history", ".aider.tags.cache.v4"},
}
OURS = {".git", ".ralph", "logs", "PLAN.md", "CHECKLIST.md", "hello.txt"}
ITEM = "create hello.txt saying hello"
SLOW = 5  # tokens per second: every answer takes seconds to stream
SCRIPT = {"items": [{"match": "hello.txt", "files": {"hello.txt": "hello\n"}}]}

# Each test drives a real agent: the tier's tests that need its install (tests/support/tiers.py).
pytestmark = [pytest.mark.agents, pytest.mark.timeout(300)]

MakeScenario = Callable[[str], AgentScenario]


def assert_item_done(scenario: AgentScenario, run, code: int) -> None:
    """Exit 0, the item ticked, its file written, all of it committed, no strike."""
    assert code == 0, (run.events, run.stderr)
    assert scenario.marks() == ["x"], scenario.checklist()
    assert (scenario.workspace / "hello.txt").read_text() == "hello\n"
    assert scenario.commits()[0] == f"done: {ITEM}", scenario.commits()
    assert scenario.dirty() == ""
    assert not run.of("strike") and not run.of("skip"), run.events
    assert scenario.state()["strikes"] == {}


@pytest.mark.parametrize("agent", AGENTS)
def test_the_agent_does_the_item_and_commits(agent_scenario: MakeScenario, agent: str) -> None:
    scenario = agent_scenario(agent).prepare_agent([ITEM], SCRIPT)
    run = scenario.start()
    code = run.wait(240)

    assert_item_done(scenario, run, code)
    assert scenario.records("death") == []
    left = {path.name for path in scenario.workspace.iterdir()} - OURS
    assert left == OWN_FILES[agent]
    assert (scenario.workspace / ".git" / "opencode").exists() == (agent == "opencode")
    scenario.assert_nothing_left()


@pytest.mark.parametrize("agent", AGENTS)
def test_a_hang_during_the_agents_call_kills_its_whole_tree(
    agent_scenario: MakeScenario, agent: str
) -> None:
    scenario = agent_scenario(agent).prepare_agent([ITEM], SCRIPT)
    scenario.standin.trigger(tokens_per_second=SLOW)  # the agent is in its call for seconds
    run = scenario.start()
    scenario.wait_agent_asked()
    scenario.wait_agent_running(run.process.pid)
    tree = scenario.agent_tree(run.process.pid)
    session = scenario.step_session(run.process.pid)
    hung = time.time()
    scenario.standin.trigger(hang=True)

    killed = run.wait_event("step-done", timeout=60, step=scenario.step, killed=True)
    # watch 0.5 s + 2 rounds x probe timeout 2 s + interval 0.2 s, then the kill; room for load
    assert killed["time"] - hung < 15
    wait_all_gone([*tree, *session], 10)
    death = run.wait_event("death")
    assert death["phase"] == "during-step"

    assert_item_done(scenario, run, run.wait(240))  # retried after recovery: done
    (record,) = scenario.records("death")
    assert (record["phase"], record["item"]["text"]) == ("during-step", ITEM)
    assert [e["item"] for e in run.of("retry")] == [ITEM]
    scenario.assert_nothing_left()


@pytest.mark.parametrize("agent", AGENTS)
def test_a_death_during_the_agents_call_is_recorded_and_retried_without_a_strike(
    agent_scenario: MakeScenario, agent: str
) -> None:
    scenario = agent_scenario(agent).prepare_agent([ITEM], SCRIPT)
    # The agent's first request (every agent's prompt is longer than this) kills the server the
    # way vLLM's engine dies; the restarted server is healthy.
    scenario.standin.trigger(die_on_prompt_chars=500)
    run = scenario.start()

    death = run.wait_event("death", timeout=120)
    # The watch usually sees it first; an agent that gives up at once is seen at post-step.
    assert death["phase"] in ("during-step", "post-step"), death
    assert_item_done(scenario, run, run.wait(240))
    (record,) = scenario.records("death")
    assert record["item"]["text"] == ITEM
    (recovery,) = scenario.records("recovery")
    assert recovery["recovered"] is True
    assert [e["item"] for e in run.of("iteration")] == [ITEM, ITEM]
    scenario.assert_nothing_left()


def start_vllm_yaml(scenario: AgentScenario, **extra: object):
    """runbooks/vllm.yaml, unchanged, with only its vars pointed at the stand-in."""
    start_vllm = scenario.root / "start_vllm.sh"  # the seed's idempotent start script
    standin = scenario.standin
    start_vllm.write_text(
        f"#!/bin/bash\nSCRIPT={scenario.script} PYTHON={sys.executable} HEALTH_TIMEOUT=1"
        f" exec {START_SCRIPT} {standin.port} {standin.state_dir}\n"
    )
    start_vllm.chmod(0o755)
    scenario.runbook_path = ROOT / "runbooks" / "vllm.yaml"
    facts = {"base_url": standin.url, "model": standin.model, "start_vllm": str(start_vllm)}
    return scenario.start(**facts, **extra)


def test_runbooks_vllm_yaml_as_shipped_drives_opencode(agent_scenario: MakeScenario) -> None:
    scenario = agent_scenario("opencode").prepare_agent([ITEM], SCRIPT)
    run = start_vllm_yaml(scenario)

    assert_item_done(scenario, run, run.wait(240))
    assert not run.of("death")
    scenario.assert_nothing_left()


def test_runbooks_vllm_local_yaml_as_shipped_drives_opencode(agent_scenario: MakeScenario) -> None:
    """runbooks/vllm-local.yaml, unchanged (its default agent line is opencode's), with only its
    vars pointed at the stand-in: opencode finds its provider (agents/opencode.json) and does
    the item (issue 21: "Model not found: vllm/qwen3-coder" before)."""
    scenario = agent_scenario("opencode").prepare_agent([ITEM], SCRIPT)
    standin = scenario.standin
    start_vllm = scenario.root / "start_vllm.sh"  # start | stop | status, as vllm-local's own
    start_vllm.write_text(
        "#!/bin/bash\n"
        f'case "$1" in\n'
        f"  start) SCRIPT={scenario.script} PYTHON={sys.executable} HEALTH_TIMEOUT=1"
        f" exec {START_SCRIPT} {standin.port} {standin.state_dir} ;;\n"
        '  *) echo "stand-in: $1" ;;\n'
        "esac\n"
    )
    start_vllm.chmod(0o755)
    scenario.runbook_path = ROOT / "runbooks" / "vllm-local.yaml"
    facts = {
        "port": standin.port,
        "model": standin.model,
        "start_vllm": str(start_vllm),
        "vllm_dir": str(standin.state_dir),
    }
    run = scenario.start(**facts)

    assert_item_done(scenario, run, run.wait(240))
    assert not run.of("death")
    (step,) = run.of("step-done", step="run the agent")
    assert step["ok"], step
    scenario.assert_nothing_left()


def test_runbooks_vllm_yaml_finds_an_engine_hang_during_opencodes_call(
    agent_scenario: MakeScenario,
) -> None:
    """vLLM's engine hang (/health, /v1/models, /metrics 200; the stream stops) while opencode
    waits for its answer: vllm.yaml's progress probe sees the counters stop, the watch kills
    opencode, the start script replaces the hung server, the item is retried and done."""
    scenario = agent_scenario("opencode").prepare_agent([ITEM], SCRIPT)
    scenario.standin.trigger(tokens_per_second=SLOW)
    run = start_vllm_yaml(scenario, stall_after=3)
    scenario.wait_agent_asked()
    tree = scenario.agent_tree(run.process.pid)
    scenario.standin.trigger(engine_hang=True)

    killed = run.wait_event("step-done", timeout=90, step="run opencode", killed=True)
    wait_all_gone(tree, 10)
    death = run.wait_event("death")
    assert death["phase"] == "during-step"
    assert "stalled" in death["reason"], death
    assert_item_done(scenario, run, run.wait(240))
    assert killed["seconds"] < 300  # the watch, not the step's timeout
    scenario.assert_nothing_left()


def test_aiders_housekeeping_is_no_strike(agent_scenario: MakeScenario) -> None:
    """A plain aider line (not the recipe: no --no-gitignore): aider leaves its .aider* files in
    the repo and would append `.aider*` to .gitignore, uncommitted; the work is still done."""
    scenario = agent_scenario("aider").prepare_agent([ITEM], SCRIPT, recipe=False)
    run = scenario.start()
    code = run.wait(240)

    assert_item_done(scenario, run, code)
    assert (scenario.workspace / ".aider.chat.history.md").exists()
    assert (scenario.workspace / ".aider.tags.cache.v4").is_dir()
    # ralph-run put `.aider*` in .git/info/exclude first, so aider saw it ignored and left
    # .gitignore alone, and its files never show in `git status`
    assert ".aider*" in (scenario.workspace / ".git" / "info" / "exclude").read_text()
    assert not (scenario.workspace / ".gitignore").exists()
    scenario.assert_nothing_left()


def test_opencode_dies_with_a_killed_ralph_run(agent_scenario: MakeScenario) -> None:
    """kill -9 of ralph-run while opencode runs a tool: opencode, the tool's shell and its
    child all end within 1 s."""
    scenario = agent_scenario("opencode")
    script = {"items": [{**SCRIPT["items"][0], "shell": "sleep 60"}]}
    scenario.prepare_agent([ITEM], script)
    run = scenario.start()
    sleeping = wait_for(lambda: scenario.working_in("sleep 60"), 120, "opencode's tool running")
    tree = scenario.agent_tree(run.process.pid)
    assert {p.pid for p in sleeping} <= {p.pid for p in tree}  # opencode -> bash -> sleep
    assert not any(ended(p) for p in tree)

    killed = time.monotonic()
    run.process.send_signal(signal.SIGKILL)
    wait_all_gone(tree, 5)
    seconds = time.monotonic() - killed
    run.process.wait(10)
    print(f"opencode's tree ({len(tree)} processes) ended {seconds:.3f} s after kill -9")
    assert seconds <= 1.0, f"opencode's tree took {seconds:.2f} s to end"
    scenario.assert_nothing_left()


IDLE = 5  # s: the recipe's 120, shortened so that the test waits seconds, not minutes


def test_opencode_stopped_mid_call_is_killed_by_its_idle_timeout(
    agent_scenario: MakeScenario,
) -> None:
    """The real opencode stopped (SIGSTOP of its whole tree: no output, no CPU) once its first
    request was answered, the server idle and healthy: the recipe's idle_timeout kills it as
    stalled within idle_timeout + a few seconds, tree and all; a strike, no death; the retry
    does the item (issue 17: a stalled client waited for the whole step timeout)."""
    scenario = agent_scenario("opencode").prepare_agent([ITEM], SCRIPT)
    (task,) = yaml.safe_load((RECIPES / "opencode.yaml").read_text())
    assert task["idle_timeout"] == 120  # as shipped
    task["idle_timeout"] = IDLE
    recipe = scenario.root / "opencode-idle.yaml"
    recipe.write_text(yaml.safe_dump([task], sort_keys=False))
    book = yaml.safe_load(scenario.runbook_path.read_text())
    for step in book["loop"]["steps"]:
        if step.get("include", "").endswith("opencode.yaml"):
            step["include"] = str(recipe)
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    run = scenario.start()
    scenario.wait_agent_asked()
    scenario.wait_agent_running(run.process.pid)
    tree = scenario.agent_tree(run.process.pid)
    assert any("opencode" in " ".join(cmdline_of(p)) for p in tree), tree
    for process in tree:
        process.suspend()
    stopped = time.time()

    ended_step = run.wait_event("step-done", timeout=IDLE + 60, step="run opencode", ok=False)
    assert ended_step.get("stalled") is True, ended_step
    assert ended_step["time"] - stopped <= IDLE + 5, ended_step["time"] - stopped
    wait_all_gone(tree, 10)
    (strike,) = run.of("strike") or [run.wait_event("strike")]
    assert "stalled" in strike["reason"], strike
    assert run.wait(240) == 0, (run.events, run.stderr)
    assert scenario.marks() == ["x"] and not run.of("death")
    scenario.assert_nothing_left()
