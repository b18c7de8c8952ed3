"""Hangs found in any step within the stated bound, busy never a death: the watch and the
progress probe against a real HTTP server that answers like vLLM (engine_helpers.Engine), and
runbooks/vllm.yaml end to end (its agent, docker and start script as programs on PATH)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml
from engine_helpers import Engine
from support.e2e import AGENT_STEP, Scenario, make_workspace
from support.faithful import Stream, long_request
from support.http_post import post_command
from support.standin import ROOT, cmdline_of, process_gone, python_env, wait_for

from ralph_runner import probes
from ralph_runner.liveness.health import GRACE, Health, ProbeSpec
from ralph_runner.liveness.step_watch import Watch
from ralph_runner.process.connection import for_host

RALPH = [sys.executable, "-m", "ralph_runner"]
MARGIN = 1.0  # scheduling slack on a loaded 2-core machine
# stall_after twice MARGIN: a stall found at twice (or half) its moment falls outside the bounds
# asserted below (ci/mutations.yaml breaks it so), not inside their slack
WATCH, STALL_AFTER, TIMEOUT, FAILURES, INTERVAL = 0.2, 2.0, 0.5, 2, 0.1


def bound(watch: float, stall_after: float, timeout: float, failures: int, interval: float):
    """The README's detection bound for a hang during a step."""
    rounds = watch + math.ceil(stall_after / watch) * watch
    return rounds + failures * (timeout + GRACE) + (failures - 1) * interval


BOUND = bound(WATCH, STALL_AFTER, TIMEOUT, FAILURES, INTERVAL)


@pytest.fixture
def engine():
    with Engine() as scripted:
        yield scripted


@pytest.fixture
def health(engine):
    progress = probes.KINDS["progress"].Params.model_validate(
        {
            "metrics": engine.metrics_url,
            "completion": {"url": engine.url, "model": "m"},
            "stall_after": STALL_AFTER,
        }
    )
    models = probes.KINDS["http"].Params.model_validate({"url": f"{engine.url}/models"})
    checked = Health(
        [
            ProbeSpec("engine progress", "progress", progress, timeout=TIMEOUT),
            ProbeSpec("models", "http", models, timeout=TIMEOUT),
        ],
        failures_before_dead=FAILURES,
        interval=INTERVAL,
        connection=for_host({}),
    )
    yield checked
    checked.close()


def found_within(watch: Watch, limit: float) -> float:
    """Seconds until the watch declares a death (it cancels the step); fails past `limit`."""
    started = time.monotonic()
    assert watch.cancel.wait(limit), f"no death within {limit:.1f} s"
    return time.monotonic() - started


def failing(watch: Watch) -> list[tuple[str, str | None, str]]:
    assert watch.rounds is not None
    return [(r.name, r.reason, r.detail) for r in watch.rounds[-1] if not r.ok]


def test_a_busy_engine_is_no_death_over_many_watch_rounds(engine, health):
    """Long generations, a full queue: a canary would wait forever. Tokens move: alive."""
    health.check(1)  # ensure_alive at the start of the step
    engine.busy(tokens_per_second=20, running=1, waiting=8)
    with Watch(health, WATCH, iteration=1) as watch:
        assert not watch.cancel.wait(3 * STALL_AFTER)
        scrapes = engine.metrics_scrapes
    assert scrapes >= 8  # many rounds, well past stall_after
    assert engine.completions == 1  # only the idle start check's canary
    alive, rounds = health.check(1)  # post-step
    assert alive, rounds


def test_a_hang_with_the_agents_request_active_is_stalled_after_stall_after(engine, health):
    health.check(1)
    engine.busy(tokens_per_second=50, running=1, waiting=0)  # the agent's answer streams...
    with Watch(health, WATCH, iteration=1) as watch:
        wait_for(lambda: engine.metrics_scrapes >= 3, 10, "watch rounds seeing tokens")
        engine.hang()  # ...and the engine stops mid-answer, its request still active
        seconds = found_within(watch, BOUND + MARGIN)
    print(f"hang with a request active: death after {seconds:.2f} s (bound {BOUND:.2f} s)")
    assert seconds >= STALL_AFTER  # never before stall_after without a token
    ((name, reason, detail),) = failing(watch)
    assert (name, reason) == ("engine progress", "stalled")
    assert detail.startswith("no token for ") and " s while 1 request active (bound " in detail


def test_an_idle_hang_is_stalled_within_the_bound(engine, health):
    """Nothing active, the canary unanswered: the engine answered one before, so the stall clock
    runs from its first unanswered canary (the gauges lag a long first prefill chunk), and the
    hang is found within the same bound as one with work active."""
    health.check(1)
    with Watch(health, WATCH, iteration=1) as watch:
        wait_for(lambda: engine.completions >= 2, 10, "a watch round's canary")
        engine.hang()  # nothing active: the gauges say idle, the engine answers nothing
        seconds = found_within(watch, BOUND + MARGIN)
    print(f"idle hang: death after {seconds:.2f} s (bound {BOUND:.2f} s)")
    assert seconds < BOUND + MARGIN
    ((name, reason, detail),) = failing(watch)
    assert (name, reason) == ("engine progress", "stalled")
    assert detail.startswith("idle engine did not answer a 1-token request within ")


def test_a_dead_engine_is_a_status_death_at_once(engine, health):
    health.check(1)
    with Watch(health, WATCH, iteration=1) as watch:
        engine.completion_status = 500  # EngineDeadError: every generation answers 500
        found_within(watch, WATCH + FAILURES * (TIMEOUT + GRACE) + INTERVAL + MARGIN)
    ((name, reason, detail),) = failing(watch)
    assert (name, reason) == ("engine progress", "status")
    assert "EngineCore encountered an issue" in detail


# runbooks/vllm.yaml, for real: the agent, docker and the start script are programs on PATH


def program(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    path.chmod(0o755)


def test_vllm_runbook_stops_a_hung_container_and_retries_the_item(tmp_path, engine):
    """A hang during the agent's call in an iteration where no iteration-counted probe is due
    (there are none): found by the watch, the agent's tree killed, `docker stop` before the
    start script, the item retried without a strike, exit 0."""
    work = make_workspace(tmp_path / "work", ["first item", "second item"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    program(  # the agent: its second call hangs the engine while it waits for the answer
        bin_dir,
        "opencode",
        f"""\
        echo opencode >> {calls}
        if [ "$(grep -c '^opencode' {calls})" = 2 ]; then
            {post_command(f"{engine.root_url}/admin/hang")}
            exec sleep 300
        fi
        sed -i '0,/- \\[ \\]/s//- [x]/' CHECKLIST.md && git commit -qam "agent: done"
        """,
    )
    program(bin_dir, "docker", f'echo "docker $*" >> {calls}\n')
    program(  # the seed's idempotent start script: a restarted engine is a working one
        bin_dir,
        "start_vllm.sh",
        f"""\
        echo start >> {calls}
        {post_command(f"{engine.root_url}/admin/resume")}
        """,
    )
    extra = {
        "base_url": engine.url,
        "model": "m",
        "start_vllm": str(bin_dir / "start_vllm.sh"),
        "gpu_sched": "true",
        "stall_after": 5,
    }
    env = python_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    done = subprocess.run(
        [*RALPH, str(ROOT / "runbooks/vllm.yaml"), "--json", "-e", json.dumps(extra)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"vllm.yaml run with one hang: {time.monotonic() - started:.1f} s")

    (death,) = [e for e in events if e["event"] == "death"]
    assert death["phase"] == "during-step" and "stalled" in death["reason"]
    killed = [e for e in events if e["event"] == "step-done" and e.get("killed")]
    assert [e["step"] for e in killed] == ["run opencode"]
    print(f"vllm.yaml: the hung agent step killed after {killed[0]['seconds']:.1f} s")
    assert killed[0]["seconds"] < 5 + 5 + 2 * 5 + 1 + MARGIN  # the bound, not the 300 s timeout
    # (the flight recorder's `docker logs -f` follows the log meanwhile: not part of the story)
    lines = [c for c in calls.read_text().splitlines() if not c.startswith("docker logs -f")]
    stop, start = lines.index("docker stop -t 10 vllm-spark-head"), lines.index("start")
    assert lines[:2] == ["opencode", "opencode"] and stop < start  # stopped, then started
    outcomes = [e["event"] for e in events if e["event"] in ("done", "retry", "strike", "skip")]
    assert outcomes == ["done", "retry", "done"]
    assert "- [ ]" not in (work / "CHECKLIST.md").read_text()
    records = (work / "logs/vllm-deaths.jsonl").read_text().splitlines()
    recovery = json.loads(records[-1])
    assert recovery["recovered"] and [s["name"] for s in recovery["steps"]] == [
        "stop the hung container",
        "start vLLM",
    ]
    assert engine.admin_calls == ["hang", "resume"]


# the stand-in, end to end: a real loop, the stand-in agent, the start script


ITEMS = ["add the road", "add the car", "add the controls"]


def progress_probes(stall_after: float) -> list[dict]:
    """The vllm.yaml way, scaled: progress in every check, the fast endpoint, and a costly
    completion probe counted in iterations (due in the first iteration only)."""
    return [
        {
            "name": "engine progress",
            "progress": {
                "metrics": "{{ base_url | regex_replace('/v1/?$', '') }}/metrics",
                "completion": {"url": "{{ base_url }}", "model": "{{ model }}"},
                "stall_after": stall_after,
            },
            "timeout": 1,
        },
        {"name": "models endpoint", "http": {"url": "{{ base_url }}/models"}, "timeout": 1},
        {
            "name": "can generate",
            "completion": {"url": "{{ base_url }}", "model": "{{ model }}"},
            "timeout": 1,
            "every": 10,
        },
    ]


def use_probes(scenario: Scenario, probes_: list[dict], **health: float) -> None:
    data = yaml.safe_load(scenario.runbook_path.read_text())
    data["health"].update(probes=probes_, **health)
    scenario.runbook_path.write_text(yaml.safe_dump(data, sort_keys=False))


def calling(agent: psutil.Process, port: int) -> bool:
    """The agent holds a connection to the server: its call is in flight."""
    try:
        return any(
            c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == port
            for c in agent.net_connections("tcp")
        )
    except psutil.Error:
        return False


def test_a_standin_engine_hang_during_the_agents_call_is_found_and_recovered(scenario):
    stall_after, watch, interval = 2.0, 0.5, 0.2
    scenario.prepare(
        ITEMS,
        agent_sleep="1.5 if iteration == 2 else 0.1",
        agent_timeout=120,  # only the watch can end the hung call in time
        after_agent="echo agent finished",  # bash stays the agent's parent: a process tree
        step_timeout=60,
    )
    use_probes(scenario, progress_probes(stall_after), watch=watch, interval=interval)
    run = scenario.start()

    run.wait_agent(2)
    scenario.standin.trigger(busy=16, tokens_per_second=2)  # the agent's 16 tokens: 8 s
    old_pid = scenario.standin.pid
    agents = scenario.wait_agent_tree()
    (agent,) = [p for p in agents if cmdline_of(p)[1:3] == ["-m", "ralph_runner.standin.agent"]]
    wait_for(lambda: calling(agent, scenario.standin.port), 20, "the agent's call in flight")
    before = scenario.standin.target().tokens()
    wait_for(lambda: scenario.standin.target().tokens() > before, 10, "the answer streaming")
    hung = time.time()
    scenario.standin.admin("engine_hang").raise_for_status()

    killed = run.wait_event("step-done", step=AGENT_STEP, killed=True, timeout=30)
    limit = bound(watch, stall_after, 1, 2, interval)
    print(f"stand-in hang during the agent's call: killed after {killed['time'] - hung:.2f} s")
    assert stall_after <= killed["time"] - hung < limit + MARGIN
    for process in agents:
        wait_for(lambda pid=process.pid: process_gone(pid), 5, f"agent process {process.pid}")
    assert run.wait(60) == 0, run.stderr

    (record,) = scenario.records("death")
    assert (record["phase"], record["iteration"]) == ("during-step", 2)
    assert record["item"]["text"] == ITEMS[1]
    first_failing = next(p for p in record["probes"] if not p["ok"])
    assert (first_failing["name"], first_failing["reason"]) == ("engine progress", "stalled")
    (recovery,) = scenario.records("recovery")
    assert recovery["recovered"] is True
    assert process_gone(old_pid) and scenario.standin.pid != old_pid  # the script replaced it
    assert [e["item"] for e in run.of("retry")] == [ITEMS[1]]
    assert not run.of("strike") and not run.of("skip")
    assert scenario.marks() == ["x"] * len(ITEMS)
    scenario.assert_nothing_left()


def test_a_busy_standin_is_no_death(scenario):
    """--max-num-seqs 1, long generations, a second request waiting: the agent's calls take
    seconds with no death, though a completion probe would have timed out behind them."""
    scenario.prepare(ITEMS[:2], agent_timeout=60, step_timeout=60, after_agent="echo finished")
    use_probes(scenario, progress_probes(2.0)[:2], watch=0.3, interval=0.1)
    scenario.standin.stop()
    scenario.standin.start(HEALTH_TIMEOUT="1", MAX_NUM_SEQS="1", TOKENS_PER_SECOND="5")
    scenario.standin.trigger(busy=16)  # the agent's answer: its max_tokens, 3.2 s
    target = scenario.standin.target()
    run = scenario.start()

    run.wait_agent(1)
    (agent,) = [
        p
        for p in scenario.wait_agent_tree()
        if cmdline_of(p)[1:3] == ["-m", "ralph_runner.standin.agent"]
    ]
    wait_for(lambda: calling(agent, scenario.standin.port), 20, "the agent's call in flight")
    other = Stream(f"{target.url}/chat/completions", long_request(target, max_tokens=20))
    waiting = wait_for(
        lambda: target.metrics()["vllm:num_requests_waiting"] >= 1, 30, "a waiting line"
    )
    assert run.wait(90) == 0, run.stderr
    assert other.wait().error is None
    assert waiting and not run.of("death") and not scenario.records()
    agent_steps = [e for e in run.of("step-done") if e["step"] == AGENT_STEP]
    assert len(agent_steps) == 2 and all(e["ok"] for e in agent_steps)
    assert max(e["seconds"] for e in agent_steps) > 2.0  # busy for longer than stall_after
    scenario.assert_nothing_left()
