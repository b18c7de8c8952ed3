"""The learned hang bound (docs: hangs, "The hang bound"), case by case, against the stand-in
server (a real process; its engine reads prompts in chunks whose steps last chunk / rate s and
publish their numbers when they end, as vLLM's), through ralph-run's real agent proxy, with the
progress probe checked every PERIOD s as a watch does. The numbers are scaled down from the
shipped ones (floor 4, ceiling 120, watch 2) so that each case takes seconds:

- slow steps are learned: a prompt read in 2 s steps is no failure, and the bound grows to
  margin x the step;
- a step slower than any before (twice the slowest) is no failure either;
- the first long prompt on a fresh engine, its pace unmeasured (its first step shows nothing:
  the gauges say idle): covered by the ceiling while the loop's request awaits its first token,
  also when it waited behind a generation on an engine of one sequence;
- a real hang after slow steps is stalled within the learned bound, not before it;
- a fast engine's hang is stalled at the floor, and an idle one's within floor + the canary;
- and through a real loop: a long prompt on a slow engine is no death, `status` shows the bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from support.e2e import Scenario
from support.faithful import Stream
from support.standin import StandIn, ralph, wait_for

from ralph_runner.loop.proxy import Proxy
from ralph_runner.plugins import prometheus_text
from ralph_runner.probes import ProbeContext, ProbeResult, progress, run_probe
from ralph_runner.process.connection import for_host

FLOOR, CEILING, MARGIN_X = 1.0, 20.0, 3.0  # the rule's limits, scaled down
PERIOD = 0.25  # s between checks (a watch)
TIMEOUT = 1.0  # the probe's timeout
CHUNK, RATE = 200, 100.0  # a prefill step reads 200 tokens in 2 s
STEP = CHUNK / RATE
CHARS_PER_TOKEN = 4  # the stand-in's
SLACK = 1.5  # s of scheduling on a loaded two-core machine


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    server = StandIn(tmp_path / "standin")
    child = server.spawn("--tokens-per-second", "200")
    try:
        yield server
    finally:
        child.kill()
        child.wait(10)


@pytest.fixture
def proxy(standin: StandIn) -> Iterator[Proxy]:
    with Proxy(standin.url) as running:
        yield running


@dataclass
class Watcher:
    """The progress probe, checked every PERIOD s on a thread of its own, its results kept."""

    standin: StandIn
    traffic: Proxy | None
    results: list[tuple[float, ProbeResult]] = field(default_factory=list)
    calibrate: bool = False  # the cases below teach the pace themselves (test_first_token.py)

    def __post_init__(self) -> None:
        params = {
            "metrics": f"{self.standin.root_url}/metrics",
            "completion": {"url": self.standin.url, "model": self.standin.model},
            "stall": {"floor": FLOOR, "ceiling": CEILING, "margin": MARGIN_X},
            "calibrate": self.calibrate,
        }
        self.params = progress.Params.model_validate(params)
        self.client = httpx.Client()
        awaiting = self.traffic.awaiting if self.traffic is not None else None
        self.ctx = ProbeContext(self.client, for_host({}), TIMEOUT, traffic=awaiting)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self.check()  # the start check: the canary answered
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()

    def check(self) -> ProbeResult:
        result = run_probe("engine progress", "progress", self.params, self.ctx)
        self.results.append((time.monotonic(), result))
        return result

    def _run(self) -> None:
        while not self._stop.wait(PERIOD):
            self.check()

    def failures(self) -> list[ProbeResult]:
        return [result for _, result in self.results if not result.ok]

    def first_failure_after(self, start: float) -> float | None:
        return next((t - start for t, r in self.results if t >= start and not r.ok), None)

    def bound(self) -> float:
        found = progress.memory_of(self.ctx).bound
        return found.seconds if found is not None else 0.0


def prompt_of(tokens: int) -> str:
    return "x" * (tokens * CHARS_PER_TOKEN)


def agent_request(url: str, tokens: int, max_tokens: int = 20) -> Stream:
    """The agent's streamed call with a prompt of `tokens` tokens, through `url` (the proxy)."""
    body = {
        "model": "stand-in",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt_of(tokens)}],
    }
    return Stream(f"{url}/chat/completions", body)


def generated(standin: StandIn) -> float:
    """The tokens the engine generated so far (its /metrics)."""
    text = httpx.get(f"{standin.root_url}/metrics", timeout=5).text
    return prometheus_text.metric_sum(text, "vllm:generation_tokens_total") or 0.0


def chunked(standin: StandIn, rate: float = RATE) -> None:
    standin.admin("prefill_tokens_per_second", rate).raise_for_status()
    standin.admin("prefill_chunk", CHUNK).raise_for_status()


def test_slow_steps_are_learned_and_a_long_prompt_is_no_failure(standin, proxy):
    """A 5-step prompt (10 s; each step 2 s, twice the floor) after a short request measured the
    pace (s per byte to the first token, on the same engine): no failed check, and the bound
    grew to at least margin x (the step less a period)."""
    with Watcher(standin, proxy) as watcher:
        chunked(standin)
        agent_request(proxy.url, 10).wait()  # the pace: s per byte to the first token
        stream = agent_request(proxy.url, 5 * CHUNK).wait(60)
    assert stream.error is None and stream.status == 200
    assert watcher.failures() == [], watcher.failures()
    learned = progress.memory_of(watcher.ctx).pace.slowest(time.monotonic())
    assert STEP - 2 * PERIOD <= learned <= STEP + SLACK, learned
    # the last check's bound: margin x the step it learned (not a bound >= 0: a margin doubled
    # in the code must fail here, ci/mutations.yaml)
    bound = watcher.bound()
    assert bound == pytest.approx(MARGIN_X * learned, rel=0.05), (bound, learned)


def test_a_step_slower_than_any_before_is_no_failure(standin, proxy):
    """Steps of 2 s are learned, then the engine slows down to steps of 4 s (twice the slowest
    step seen, four times the floor): still no failed check."""
    with Watcher(standin, proxy) as watcher:
        chunked(standin)
        agent_request(proxy.url, 10).wait()
        agent_request(proxy.url, 3 * CHUNK).wait(60)
        assert progress.memory_of(watcher.ctx).pace.slowest(time.monotonic()) >= STEP - SLACK
        chunked(standin, rate=RATE / 2)
        slower = agent_request(proxy.url, 3 * CHUNK).wait(60)
    assert slower.error is None and slower.status == 200
    assert watcher.failures() == [], watcher.failures()


def test_the_first_long_prompt_on_a_fresh_engine_gets_the_ceiling(standin, proxy):
    """Nothing measured yet (no request through the proxy, only the canary): the first step of
    a long prompt (4 s, four times the floor) shows nothing in /metrics, the gauges say idle;
    the loop's request awaiting its first token holds the bound at the ceiling."""
    chunked(standin, rate=CHUNK / 4.0)
    with Watcher(standin, proxy) as watcher:
        stream = agent_request(proxy.url, 2 * CHUNK)
        wait_for(lambda: proxy.awaiting() is not None, 10, "the request to be sent")
        wait_for(lambda: watcher.bound() == CEILING, 10, "the ceiling while it awaits")
        stream.wait(60)
    assert stream.error is None and stream.status == 200
    assert watcher.failures() == [], watcher.failures()


def test_a_long_prompt_deferred_behind_a_generation_is_no_failure(tmp_path):
    """One sequence at a time (`--max-num-seqs 1`, llama.cpp's one slot): the loop's long
    prompt (pace unmeasured: no streamed call yet; steps of 4 s) waits behind the loop's own
    generation, whose tokens are engine steps taken after the prompt was sent. Its first step
    starts only when that generation ends, and shows nothing: the ceiling still covers it (it
    was the floor: "stalled", a false death)."""
    server = StandIn(tmp_path / "standin")
    child = server.spawn("--tokens-per-second", "200", "--max-num-seqs", "1")
    try:
        chunked(server, rate=CHUNK / 4.0)
        with Proxy(server.url) as proxy, Watcher(server, proxy) as watcher:
            body = {"model": "stand-in", "max_tokens": 600, "ignore_eos": True, "prompt": "x"}
            generation = threading.Thread(  # 3 s of tokens, not streamed: no pace measured
                target=httpx.post, args=(f"{proxy.url}/completions",), daemon=True,
                kwargs={"json": body, "timeout": 60},
            )  # fmt: skip
            generation.start()
            wait_for(lambda: generated(server) > 100, 10, "tokens to flow")
            deferred = agent_request(proxy.url, 2 * CHUNK)
            generation.join(60)
            deferred.wait(60)
    finally:
        child.kill()
        child.wait(10)
    assert deferred.error is None and deferred.status == 200
    assert watcher.failures() == [], watcher.failures()


def test_without_the_proxy_the_first_long_step_is_an_idle_hang(standin):
    """The same first step without the proxy's word: an engine that answered a canary and then
    answers none for longer than the floor is stalled (the docs say so: the shipped runbooks run
    the proxy, and a fast engine's idle hang must be found in seconds)."""
    chunked(standin, rate=CHUNK / 4.0)
    with Watcher(standin, None) as watcher:
        sent = time.monotonic()
        stream = agent_request(standin.url, 2 * CHUNK)
        wait_for(lambda: watcher.failures(), 10, "a failed check")
        stream.wait(60)
    failed_after = watcher.first_failure_after(sent)
    assert failed_after is not None and FLOOR <= failed_after <= FLOOR + TIMEOUT + SLACK


def test_a_hang_after_slow_steps_is_stalled_within_the_learned_bound(standin, proxy):
    """Slow steps learned (bound ~ 3 x 2 s), then the engine hangs mid-prompt: stalled no sooner
    than the floor and within the learned bound + a period + slack."""
    with Watcher(standin, proxy) as watcher:
        chunked(standin)
        agent_request(proxy.url, 10).wait()
        agent_request(proxy.url, 20 * CHUNK)  # ends with the server (the fixture)
        wait_for(lambda: progress.memory_of(watcher.ctx).pace.slowest(time.monotonic()) > 1, 30)
        # the prompt's first steps are over: the bound leaves the ceiling for the learned one
        # (read at the ceiling, any late detection would pass)
        wait_for(lambda: watcher.bound() < CEILING, 30, "the learned bound, below the ceiling")
        learned = watcher.bound()
        assert MARGIN_X * (STEP - 2 * PERIOD) <= learned <= MARGIN_X * (STEP + SLACK), learned
        standin.admin("engine_hang").raise_for_status()
        hung = time.monotonic()
        wait_for(lambda: watcher.failures(), CEILING + 10, "the hang to be stalled")
    failed_after = watcher.first_failure_after(hung)
    assert failed_after is not None
    assert FLOOR <= failed_after <= learned + STEP + PERIOD + SLACK, (failed_after, learned)
    assert watcher.failures()[0].reason == "stalled"


def test_a_fast_engines_hang_mid_generation_is_stalled_at_the_floor(standin, proxy):
    """Tokens stream (a step every few ms): nothing slow learned, the bound is the floor, and a
    hang is stalled within floor + a period + slack."""
    with Watcher(standin, proxy) as watcher:
        stream = agent_request(proxy.url, 10, max_tokens=100000)
        wait_for(lambda: len(stream.events) > 20, 10, "tokens to stream")
        wait_for(lambda: len(watcher.results) > 4, 10, "checks that see them")
        standin.admin("engine_hang").raise_for_status()
        hung = time.monotonic()
        wait_for(lambda: watcher.failures(), 10, "the hang to be stalled")
        standin.admin("resume").raise_for_status()
        stream.leave()
    failed_after = watcher.first_failure_after(hung)
    assert failed_after is not None and failed_after <= FLOOR + PERIOD + SLACK, failed_after
    assert watcher.bound() == FLOOR


def test_an_idle_engines_hang_is_stalled_within_the_floor_and_a_canary(standin, proxy):
    """Idle (nothing awaits, the canary answers in milliseconds): a hang leaves the next canary
    unanswered; stalled once the floor has passed since it was sent, and a confirming canary
    waits CONFIRM s, not the whole timeout."""
    with Watcher(standin, proxy) as watcher:
        wait_for(lambda: len(watcher.results) > 3, 10, "idle checks")
        standin.admin("engine_hang").raise_for_status()
        hung = time.monotonic()
        wait_for(lambda: len(watcher.failures()) >= 2, 15, "two stalled checks")
        standin.admin("resume").raise_for_status()
    failed = [(t, r) for t, r in watcher.results if not r.ok]
    assert failed[0][0] - hung <= PERIOD + TIMEOUT + SLACK, failed[0][0] - hung
    assert failed[1][1].seconds <= progress.CONFIRM + progress.RESCRAPE + 0.5, failed[1][1]
    assert all(r.reason == "stalled" for _, r in failed[:2])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_loop_reads_a_long_prompt_on_a_slow_engine_with_no_death(
    scenario: Scenario, workers: int
):
    """Through `ralph-run`: the agent (through the loop's proxy) sends a 1,000-token prompt to a
    fresh engine that reads it in 2 s steps (twice the floor; the first step shows nothing in
    /metrics). No death, the item done; while the agent waits, `ralph-run status` shows the
    hang bound the probe computed, and why: status.json follows the watch's rounds mid-step
    with one worker or a pool of them (the pool's step runner once left it stale)."""
    scenario.prepare(
        ["long prompt"], engine_probe=True, watch=PERIOD, agent_timeout=60, step_timeout=120
    )
    book = yaml.safe_load(scenario.runbook_path.read_text())
    book["health"]["probes"][0]["progress"].pop("stall_after")
    book["health"]["probes"][0]["progress"]["stall"] = {"floor": FLOOR, "ceiling": CEILING}
    book["loop"]["proxy"] = True
    book["loop"]["workers"] = workers
    step = book["loop"]["steps"][1]
    step["shell"] = step["shell"].replace("--url {{ base_url }}", "--url {{ agent_base_url }}")
    book["prompt"] += "x " * (2 * 5 * CHUNK)  # 4,000 characters: 1,000 tokens, 5 steps
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    chunked(scenario.standin)

    run = scenario.start()
    run.wait_agent(1)
    bound = wait_for(lambda: run.status().get("hang_bound"), 15, "a hang bound in status")
    shown = ralph("status", str(scenario.workspace))
    code = run.wait(120)

    assert code == 0, (run.events[-5:], run.stderr)
    assert not run.of("death") and scenario.records("death") == []
    assert scenario.marks() == ["x"], [e.get("status") for e in run.of("step-done")]
    assert bound["seconds"] >= FLOOR and "floor 1, ceiling 20" in bound["why"], bound
    assert "hang bound: " in shown.stdout and "s without an engine step" in shown.stdout, shown
