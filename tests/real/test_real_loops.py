"""Real Ralph loops through `ralph-run runbooks/vllm-local.yaml` against the real vLLM.

The runbook is the shipped one, unchanged: only `-e` points it at the session's engine and
replaces the agent. The agent step is ralph-run's stand-in agent (one chat completion, tick,
commit), preceded by a long generation of its own (`think`, as a real agent spends minutes in
its calls), so a fault can land while the agent's own request is in flight. The think lasts a
stated time (curl's --max-time, on a request for more tokens than that time gives), not a
number of tokens: a faster CPU must not end it before the test has seen it and struck.
Each test: the fault is found and recorded (with vLLM's own log lines), the server recovered
through the start script, the item retried without a strike, exit 0, and no process left: the
old server's whole group (the Worker orphaned by a killed EngineCore included) is gone.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from e2e_helpers import RalphRun, make_workspace
from real_helpers import RUNBOOK, SERVED_NAME, Engine, LongGeneration, gone, wait_until

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

AGENT_STEP = "run the agent"
# The agent's own long call: time to see it generate, and hit it. While the CPU engine
# generates, this process's polls came up to 10.5 s apart (measured): the think outlasts that.
THINK_SECONDS = 25
THINK_TOKENS = 30000  # more than THINK_SECONDS of the tiny model gives (max-model-len 32768)
STALL_AFTER = 15  # runbooks/vllm-local.yaml's, as shipped
# runbooks/vllm-local.yaml's hang bound: watch + stall_after + 2 x probe timeout + interval.
WATCH = 3  # runbooks/vllm-local.yaml's health.watch
HANG_BOUND = WATCH + STALL_AFTER + 2 * 5 + 1
LOAD_MARGIN = 15  # s on top of a stated bound: two shared cores, other tests running
RUN_TIMEOUT = 420  # s for a whole loop, one cold restart included


def agent_command(engine: Engine, think: bool) -> str:
    """The `agent` variable: raw shell, the prompt appended by the runbook."""
    standin = [sys.executable, "-m", "ralph_runner.standin.agent", "--url", engine.url]
    standin += ["--model", SERVED_NAME, "--timeout", "120", "--"]
    agent = shlex.join(standin)
    if not think:
        return agent
    body = {"model": SERVED_NAME, "prompt": "think", "max_tokens": THINK_TOKENS}
    body["ignore_eos"] = True
    curl = ["curl", "-sS", "-f", "--max-time", str(THINK_SECONDS), "-o", "/dev/null"]
    curl += ["-H", "content-type: application/json", "-d", json.dumps(body)]
    # Done, or cut off by --max-time (curl's exit 28): the agent goes on; any other error ends it.
    return f"{shlex.join([*curl, f'{engine.url}/completions'])} || [ $? = 28 ] && {agent}"


class Loop:
    """One `ralph-run runbooks/vllm-local.yaml --json` in a fresh git workspace."""

    def __init__(
        self, root: Path, engine: Engine, items: list[str], think: bool, agent: str | None = None
    ) -> None:
        self.workspace = make_workspace(root / "work", items)
        self.engine = engine
        facts = {**engine.facts, "agent": agent or agent_command(engine, think)}
        command = [sys.executable, "-m", "ralph_runner", str(RUNBOOK), "--json"]
        self.run = RalphRun([*command, "-e", json.dumps(facts)], self.workspace)

    def wait_agent_generating(self, iteration: int) -> None:
        """Until the agent step of `iteration` runs and the engine generates for it.

        Asked of the processes, not of /metrics: while the CPU engine generates, its API server
        gets so little of the two cores that a scrape can wait until the generation is over.
        Only the engine's CPU is read: a look at the agent's sockets waited 60 s in vain in a
        CI rehearsal (two of this process's polls were 10.5 s apart, measured). During the
        agent step nothing but the agent's requests keeps the engine busy, and the status read
        after the look says that step is still the one running."""
        self.run.wait_agent(iteration, timeout=120)
        wait_until(self.engine_working, 60, "the engine to work on the agent's request")
        status = self.run.status()
        where = (status["iteration"], status["phase"])
        assert where == (iteration, AGENT_STEP), f"the think ended before the check: {status}"

    def engine_working(self) -> bool:
        """VLLM::EngineCore burns most of a core: it runs the model."""
        with contextlib.suppress(psutil.Error):
            return self.engine.engine_core().cpu_percent(interval=0.5) > 50
        return False

    def finish(self) -> int:
        try:
            return self.run.wait(RUN_TIMEOUT)
        finally:
            self.run.kill()

    def marks(self) -> list[str]:
        text = (self.workspace / "CHECKLIST.md").read_text(encoding="utf-8")
        return [line[3] for line in text.splitlines() if line.startswith("- [")]

    def records(self, kind: str) -> list[dict[str, Any]]:
        path = self.workspace / "logs" / "vllm-deaths.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        return [record for record in lines if record["event"] == kind]

    def strikes(self) -> dict[str, int]:
        state = json.loads((self.workspace / ".ralph" / "state.json").read_text())
        return {item: n for item, n in state.get("strikes", {}).items() if n}

    def attempts_of(self, item: str) -> list[int]:
        """The strikes each iteration on `item` started with."""
        return [event["attempts"] for event in self.run.of("iteration", item=item)]

    def agents_left(self) -> list[int]:
        """The agent step's processes (curl, the stand-in agent) still alive."""
        found = psutil.process_iter(["cmdline", "status"])
        return [
            p.pid
            for p in found
            if self.engine.url in " ".join(p.info["cmdline"] or [])
            and p.info["status"] != psutil.STATUS_ZOMBIE
        ]


def collector(record: dict[str, Any], name: str) -> str:
    (found,) = [c for c in record["collectors"] if c["name"] == name]
    return found["output"]


def ran_steps(loop: Loop) -> list[str]:
    """The recovery steps that ran (their `when:` held), in order."""
    (recovery,) = loop.records("recovery")
    return [step["name"] for step in recovery["steps"] if not step["skipped"]]


def assert_recovered_cleanly(loop: Loop, old_group: list[int], item: str) -> dict[str, Any]:
    """Exit 0, every item done, one death recovered, no strike, the old server's group gone."""
    code = loop.finish()
    assert code == 0, f"exit {code}: {loop.run.events[-5:]} {loop.run.stderr[-2000:]}"
    assert loop.marks() == ["x", "x"]
    (death,) = loop.records("death")
    (recovery,) = loop.records("recovery")
    assert recovery["recovered"] is True, recovery
    assert loop.strikes() == {}, "a death cost the item a strike"
    assert loop.attempts_of(item)[-1] == 0 and len(loop.attempts_of(item)) == 2
    assert loop.engine.pgid not in (None, old_group[0]), "the server was not restarted"
    assert wait_until(lambda: not gone(old_group), 15, "the old server's group to end")
    assert not loop.agents_left(), loop.agents_left()
    return death


def test_busy_engine_is_no_death(slow_engine: Engine, tmp_path: Path) -> None:
    """--max-num-seqs 1 and a long generation in flight: the agent's request waits in the queue
    for longer than stall_after + watch, the canary is never sent; tokens move, so no death.
    On the 8-layer model: the tiny one's 30,000 tokens took 6 s on a quiet machine, and the
    queue ended before the checks could see it (a CI rehearsal)."""
    loop_items = ["busy one", "busy two"]
    with LongGeneration(slow_engine.url, max_tokens=30000) as busy:
        loop = Loop(tmp_path, slow_engine, loop_items, think=False)
        loop.run.wait_agent(1, timeout=120)

        def queued() -> bool:
            assert busy.error is None, f"the long generation failed: {busy.error!r}"
            return slow_engine.metrics().get("vllm:num_requests_waiting", 0) >= 1

        wait_until(queued, 30, "the agent's request to queue behind the long generation")
        queued_at = time.monotonic()
        # stall_after + watch + a confirm round: several watch checks see only a queue.
        wait_until(lambda: time.monotonic() - queued_at > STALL_AFTER + WATCH + 2, 60, "a queue")
        assert loop.run.status()["phase"] == AGENT_STEP, "the agent was not kept waiting"
        assert not loop.run.of("death"), loop.run.of("death")
        assert busy.error is None and busy.chunks > 0
    code = loop.finish()
    assert code == 0, f"exit {code}: {loop.run.events[-5:]} {loop.run.stderr[-2000:]}"
    assert loop.marks() == ["x", "x"]
    assert not loop.run.of("death") and loop.records("death") == []
    assert loop.strikes() == {}
    assert not loop.agents_left()


def test_engine_hang_during_the_agents_call(healthy_engine: Engine, tmp_path: Path) -> None:
    """SIGSTOP of VLLM::EngineCore while the agent's request generates, in iteration 2 (with
    vllm.yaml's `every: 10` completion probe, not due): /health and /metrics keep answering,
    the counters stop; the progress probe finds it within its bound, recovery stops the hung
    group (death.hung) and starts a new server."""
    loop = Loop(tmp_path, healthy_engine, ["hang one", "hang two"], think=True)
    loop.wait_agent_generating(iteration=2)
    old_group = [p.pid for p in healthy_engine.processes()]
    healthy_engine.signal_engine(signal.SIGSTOP)
    stopped_at = time.monotonic()
    death = loop.run.wait_event("death", timeout=HANG_BOUND + LOAD_MARGIN + 30)
    found_after = time.monotonic() - stopped_at
    assert found_after <= HANG_BOUND + LOAD_MARGIN, f"hang found after {found_after:.1f} s"
    assert loop.run.of("watch", step=AGENT_STEP, killed=True), "the watch did not stop the agent"
    record = assert_recovered_cleanly(loop, old_group, "hang two")
    assert death["phase"] == record["phase"] == "during-step", record["phase"]
    reasons = {p["reason"] for p in record["probes"] if not p["ok"]}
    assert reasons == {"stalled"}, record["probes"]
    assert ran_steps(loop) == ["stop the hung server", "start vLLM"]
    processes = collector(record, "vLLM processes")
    assert "VLLM::EngineCore" in processes and " T" in processes, processes


def test_engine_killed_during_the_agents_call(healthy_engine: Engine, tmp_path: Path) -> None:
    """kill -9 of VLLM::EngineCore while the agent's request generates: the request gets vLLM's
    500, the API server exits 0, its Worker outlives it for seconds; the death record holds
    vLLM's EngineDeadError lines, the start script clears the orphan and starts a new server."""
    loop = Loop(tmp_path, healthy_engine, ["kill one", "kill two"], think=True)
    loop.wait_agent_generating(iteration=1)
    old_group = [p.pid for p in healthy_engine.processes()]
    healthy_engine.signal_engine(signal.SIGKILL)
    record = assert_recovered_cleanly(loop, old_group, "kill one")
    errors = collector(record, "vLLM errors")
    assert "EngineDeadError" in errors, errors
    assert "EngineDeadError" in collector(record, "vLLM log (last 60 lines)")
    assert ran_steps(loop) == ["start vLLM"], "a dead engine is no hung one"
