"""Issue 19 on the real vLLM, with runbooks/vllm-local.yaml's probes as shipped: a hang is found
within the 29 s bound also before the agent's request generates, and a long prefill (no token
counter moves for its whole length), a long generation and a queue behind one are no death.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
from real_helpers import SERVED_NAME, Engine, LongGeneration, wait_until
from test_real_loops import (
    AGENT_STEP,
    HANG_BOUND,
    LOAD_MARGIN,
    RUN_TIMEOUT,
    STALL_AFTER,
    WATCH,
    Loop,
)

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]
PREFILL_TOKENS = 8000  # ~70 s on the slow model here, in 32 steps of 2-4 s (16,000: 175 s)
GENERATION_SECONDS = 35  # longer than the 29 s hang bound: a generation that long is no death


def standin_agent(engine: Engine) -> list[str]:
    agent = [sys.executable, "-m", "ralph_runner.standin.agent", "--url", engine.url]
    return [*agent, "--model", SERVED_NAME, "--timeout", "120", "--"]


def curl(engine: Engine, path: str, body: dict, max_time: float, timing: Path) -> str:
    """A curl of the engine whose total time lands in `timing`; a cut by --max-time is done.
    The body goes through a file, kept beside the timings for a look after a failure."""
    data = timing.with_name(f"body-{len(list(timing.parent.glob('body-*')))}.json")
    data.write_text(json.dumps(body))
    command = ["curl", "-sS", "-f", "--max-time", f"{max_time:g}", "-o", "/dev/null"]
    command += ["-w", "%{time_total}\\n", "-H", "content-type: application/json"]
    command += ["-d", f"@{data}", f"{engine.url}{path}"]
    return f"{{ {shlex.join(command)} >>{shlex.quote(str(timing))} || [ $? = 28 ]; }}"


def test_a_hang_before_the_agents_request_is_found_within_the_bound(
    healthy_engine: Engine, tmp_path: Path
) -> None:
    """SIGSTOP of EngineCore while the agent is still thinking (no request in flight): the
    gauges freeze at 0 running, so the idle canary of the next watch check goes unanswered."""
    agent = f"sleep 20 && {shlex.join(standin_agent(healthy_engine))}"
    loop = Loop(tmp_path, healthy_engine, ["before one"], think=None, agent=agent)
    loop.run.wait_agent(1, timeout=120)
    old_group = [p.pid for p in healthy_engine.processes()]
    healthy_engine.signal_engine(signal.SIGSTOP)
    stopped_at = time.monotonic()
    death = loop.run.wait_event("death", timeout=HANG_BOUND + LOAD_MARGIN + 30)
    found_after = time.monotonic() - stopped_at
    print(f"hang before the request found after {found_after:.1f} s (bound {HANG_BOUND} s)")
    assert found_after <= HANG_BOUND + LOAD_MARGIN, f"hang found after {found_after:.1f} s"
    assert death["fault"] == "idle engine not answering", death
    assert loop.finish() == 0, loop.run.events[-5:]
    assert loop.marks() == ["x"] and loop.strikes() == {}
    assert healthy_engine.pgid not in (None, old_group[0]), "the server was not restarted"


def test_a_long_prefill_and_a_long_generation_are_no_death(
    healthy_engine: Engine, tmp_path: Path
) -> None:
    """The agent sends an 8,000-token prompt (its prefill outlasts stall_after several times
    over, and no token counter moves until it ends), then generates for 35 s, then does its
    item: with the shipped probes, no death and no strike."""
    timing = tmp_path / "curl-seconds"
    prefill = {"model": SERVED_NAME, "prompt": [5] * PREFILL_TOKENS, "max_tokens": 1}
    generate = {"model": SERVED_NAME, "prompt": "go", "max_tokens": 40000, "ignore_eos": True}
    agent = " && ".join(
        [
            curl(healthy_engine, "/completions", prefill, 400, timing),
            curl(healthy_engine, "/completions", generate, GENERATION_SECONDS, timing),
            shlex.join(standin_agent(healthy_engine)),
        ]
    )
    loop = Loop(tmp_path, healthy_engine, ["long prompt"], think=None, agent=agent)
    run = loop.run
    try:
        code = run.wait(RUN_TIMEOUT + 300)
    finally:
        run.kill()
    seconds = [float(line) for line in timing.read_text().split()] if timing.exists() else []
    print(f"prefill {seconds[:1]} s, generation {seconds[1:2]} s (stall_after {STALL_AFTER} s)")
    assert code == 0, (run.events[-5:], run.stderr[-2000:])
    assert not run.of("death") and not run.of("strike"), run.events
    assert seconds and seconds[0] >= 2 * STALL_AFTER, (
        f"the prefill was too short to prove it: {seconds}"
    )
    assert len(seconds) == 2 and seconds[1] >= GENERATION_SECONDS - 5, seconds
    steps = run.of("step-done", step=AGENT_STEP)
    assert [s["ok"] for s in steps] == [True]


def test_busy_engine_is_no_death(healthy_engine: Engine, tmp_path: Path) -> None:
    """--max-num-seqs 1 and a long generation in flight: the agent's request waits in the queue
    for longer than stall_after + watch, the canary is never sent; tokens move, so no death.
    On the 8-layer model: the tiny one's 30,000 tokens took 6 s on a quiet machine, and the
    queue ended before the checks could see it (a CI rehearsal)."""
    loop_items = ["busy one", "busy two"]
    with LongGeneration(healthy_engine.url, max_tokens=30000) as busy:
        loop = Loop(tmp_path, healthy_engine, loop_items, think=None)
        loop.run.wait_agent(1, timeout=120)

        def queued() -> bool:
            assert busy.error is None, f"the long generation failed: {busy.error!r}"
            return healthy_engine.metrics().get("vllm:num_requests_waiting", 0) >= 1

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
