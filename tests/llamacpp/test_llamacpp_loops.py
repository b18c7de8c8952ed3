"""Real Ralph loops through `ralph-run runbooks/llama-cpp.yaml` against the real llama-server.

The runbook is the shipped one, unchanged: only `-e` points it at the session's server and
replaces the agent with ralph-run's stand-in (one chat completion, tick, commit), whose attempt
a test hits starts with a long generation of its own through the loop's proxy (a real agent's
minutes-long call). Each test prints its detection time (bench/results/ holds the numbers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from llamacpp_helpers import (
    FAILURES,
    FLOOR,
    INTERVAL,
    LOAD_MARGIN,
    SERVER,
    STALL_BOUND,
    WATCH,
    Loop,
    Poller,
    Server,
    agent_command,
    collector,
    longest_silence,
    tokens_of,
    wait_until,
)
from support.standin import free_port

pytestmark = pytest.mark.timeout(600)

AGENT_STEP = "run the agent"
GRACE = 0.25  # s a round may overrun (docs/hangs.md, "The detection bound")


def wait_generating(loop: Loop, iteration: int) -> None:
    """Until the agent step of `iteration` runs and its long call holds the slot."""
    loop.run.wait_agent(iteration, timeout=120)
    wait_until(loop.server.processing, 60, "the agent's long call to hold the slot", every=0.1)
    status = loop.run.status()
    where = (status["iteration"], status["phase"])
    assert where == (iteration, AGENT_STEP), f"the long call ended before the fault: {status}"


def assert_recovered_cleanly(loop: Loop, before: int) -> dict:
    """Exit 0, both items done, one death recovered, no strike, a new server serving and the
    old one gone, no agent process left."""
    code = loop.finish()
    assert code == 0, f"exit {code}: {loop.run.events[-5:]} {loop.run.stderr[-2000:]}"
    assert loop.marks() == ["x", "x"]
    deaths = loop.records("death")
    assert len(deaths) == 1, [(d["phase"], d.get("fault")) for d in deaths]
    (recovery,) = loop.records("recovery")
    assert recovery["recovered"] is True, recovery
    assert loop.strikes() == {}, "a death cost the item a strike"
    assert loop.server.replaced(before), ("the server was not restarted", before)
    assert wait_until(lambda: not loop.agents_left(), 15, "the agent's processes to end")
    return deaths[0]


def test_a_killed_server_is_found_within_watch_plus_one_second(
    healthy_server: Server, tmp_path: Path
) -> None:
    """kill -9 of llama-server while the agent's call generates: nothing listens; the watch's
    next round and its confirming round (`interval` later) are refused (or the call fails at
    once, and the post-step check's are). Found within watch + interval (+ the rounds'
    grace), recovered by the start script, no strike."""
    agent = agent_command(healthy_server, 1, tmp_path / "calls")
    loop = Loop(tmp_path, healthy_server, ["kill one", "kill two"], agent)
    wait_generating(loop, 1)
    before = healthy_server.process().pid
    os.kill(before, signal.SIGKILL)
    killed_at = time.monotonic()
    loop.run.wait_event("death", timeout=30)
    found_after = time.monotonic() - killed_at
    bound = WATCH + INTERVAL
    print(f"\nllama-server killed: found after {found_after:.2f} s (watch + interval: {bound} s)")
    assert found_after <= bound + FAILURES * GRACE + 0.5, f"found after {found_after:.2f} s"
    death = assert_recovered_cleanly(loop, before)
    # the watch finds it, or the agent's call fails at once and the post-step check does
    assert death["phase"] in ("during-step", "post-step"), death["phase"]
    assert death["fault"] == "server gone", death["fault"]
    assert loop.ran_steps() == ["start llama-server"]


def test_a_stopped_server_is_found_within_the_documented_bound(
    healthy_server: Server, tmp_path: Path
) -> None:
    """SIGSTOP of llama-server mid-generation, as a generation stalled inside the engine
    (llama.cpp #27388): /metrics and the slot give nothing. The progress probe reads the
    unanswered /metrics as the work it saw waiting with no engine step, busy within the hang
    bound, then stalled: found within the runbook's documented bound (17 s); recovery kills
    (death.hung: only SIGKILL ends a stalled generation) and starts a new server."""
    agent = agent_command(healthy_server, 2, tmp_path / "calls")
    loop = Loop(tmp_path, healthy_server, ["stop one", "stop two"], agent)
    wait_generating(loop, 2)
    before = healthy_server.process().pid
    os.kill(before, signal.SIGSTOP)
    stopped_at = time.monotonic()
    loop.run.wait_event("death", timeout=STALL_BOUND + 30)
    found_after = time.monotonic() - stopped_at
    print(f"\nllama-server stopped: found after {found_after:.2f} s (bound {STALL_BOUND} s)")
    assert found_after <= STALL_BOUND + LOAD_MARGIN, f"found after {found_after:.2f} s"
    assert loop.run.of("watch", step=AGENT_STEP, killed=True), "the watch did not stop the agent"
    death = assert_recovered_cleanly(loop, before)
    assert {p["reason"] for p in death["probes"] if not p["ok"]} == {"stalled"}, death["probes"]
    assert death["fault"] == "engine stalled with work waiting", death["fault"]
    assert loop.ran_steps() == ["kill the hung server", "start llama-server"]
    process = collector(death, "llama-server process")
    assert f"{before} T" in " ".join(process.split()), process


def test_a_long_prompt_behind_a_long_generation_on_one_slot_is_no_death(
    healthy_server: Server, tmp_path: Path
) -> None:
    """The agent's attempt starts a long generation and, once it holds the one slot, sends a
    long prompt (deferred: llamacpp:requests_deferred 1) that is read in batches of seconds
    once the generation ends; no token counter moves until it is read. Busy is never dead:
    0 deaths, both items done, no strike, however late /health and /metrics answer (the
    slowest of each printed)."""
    words = "def main():\n    return 0\n" * 1200
    size = tokens_of(healthy_server, words)
    prompt_file = tmp_path / "long-prompt.json"
    prompt_file.write_text(json.dumps({"model": "tiny", "max_tokens": 1, "prompt": words}))
    holding = f"{healthy_server.root_url}/metrics | grep -q '^llamacpp:requests_processing [1-9]'"
    long_prompt = (
        f"until curl -sS {holding}; do sleep 0.1; done; "
        f"curl -sS -f --max-time 300 -o {tmp_path / 'answer.json'}"
        f" -H 'content-type: application/json' -d @{prompt_file}"
        ' "$RALPH_BASE_URL/completions"; wait'
    )
    agent = agent_command(healthy_server, 1, tmp_path / "calls", long_prompt, tokens=300)
    read_before = healthy_server.metrics()["llamacpp:prompt_tokens_total"]
    loop = Loop(tmp_path, healthy_server, ["busy one", "busy two"], agent)
    health = Poller(f"{healthy_server.root_url}/health")
    metrics = Poller(f"{healthy_server.root_url}/metrics", every=0.5)
    with health, metrics:
        code = loop.finish()
    print(
        f"\nlong prompt ({size} tokens) behind a long generation, one slot: slowest /health"
        f" {health.slowest:.2f} s, slowest /metrics {metrics.slowest:.2f} s"
    )
    assert code == 0, f"exit {code}: {loop.run.events[-5:]} {loop.run.stderr[-2000:]}"
    assert loop.records("death") == [], [d["fault"] for d in loop.records("death")]
    assert loop.marks() == ["x", "x"] and loop.strikes() == {}
    read = healthy_server.metrics()["llamacpp:prompt_tokens_total"] - read_before
    assert size > 8000 and read >= size, (size, read)  # the long prompt was read
    # ... after it waited for the slot (deferred), and read in silence longer than the hang
    # bound's floor: the case this test claims, not a prompt that happened to be quick
    seen = metrics.samples()
    deferred = max(values.get("llamacpp:requests_deferred", 0) for _, values in seen)
    assert deferred >= 1, f"the long prompt was never deferred ({len(seen)} looks at /metrics)"
    silence = longest_silence(seen)
    assert silence > FLOOR, f"the longest silence, {silence:.1f} s, is within the floor"
    timings = json.loads((tmp_path / "answer.json").read_text())["timings"]
    assert timings["prompt_n"] >= 8000 and timings["prompt_ms"] > FLOOR * 1000, timings


def test_the_first_start_while_loading_is_a_start_not_a_death(tmp_path: Path) -> None:
    """ralph-run's first check finds a llama-server that is still loading its model (every
    endpoint answers 503 "Loading model"): a server not serving yet. The run records a `start`
    (no death), its start step waits for that server (not its own: no pid file), and the loop
    goes on. The load is made long by throttling the real server's CPU from its exec on
    (SIGSTOP/SIGCONT, as a cgroup quota on a busy box would) until the run has said it starts."""
    server = Server(tmp_path / "state", free_port())
    command = [str(SERVER), "--host", "127.0.0.1", "--port", str(server.port), "--metrics"]
    command += ["--model", str(server.model), "--alias", "tiny", *server.args.split()]
    throttled = threading.Event()
    throttled.set()
    with (tmp_path / "server.log").open("wb") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    throttler = threading.Thread(target=throttle, args=(child, throttled), daemon=True)
    throttler.start()
    try:
        with httpx.Client(timeout=30) as client:
            wait_until(lambda: status_of(client, f"{server.root_url}/health") == 503, 60, "503")
        agent = agent_command(server, None, tmp_path / "calls")
        loop = Loop(tmp_path, server, ["load one", "load two"], agent)
        started = loop.run.wait_event("start", timeout=60)
        throttled.clear()
        print(f"\nfirst check found the server loading: {started.get('reason')}")
        code = loop.finish()
        assert code == 0, f"exit {code}: {loop.run.events[-5:]} {loop.run.stderr[-2000:]}"
        assert "Loading model" in str(started.get("reason")), started
        assert loop.records("death") == []
        (start,) = loop.records("start")
        assert start["recovered"] is True, start
        assert loop.marks() == ["x", "x"] and loop.strikes() == {}
        assert child.poll() is None, "the start step replaced the server it should have waited for"
    finally:
        throttled.clear()
        throttler.join(5)
        child.kill()
        child.wait(10)


def throttle(child: subprocess.Popen[bytes], throttled: threading.Event) -> None:
    """The child runs 2 ms in every 100 while `throttled` is set, then freely."""
    while throttled.is_set() and child.poll() is None:
        child.send_signal(signal.SIGCONT)
        time.sleep(0.002)
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.098)
    if child.poll() is None:
        child.send_signal(signal.SIGCONT)


def status_of(client: httpx.Client, url: str) -> int | None:
    try:
        return client.get(url).status_code
    except httpx.HTTPError:
        return None
