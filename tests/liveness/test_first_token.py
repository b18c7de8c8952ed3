"""The first step's bound, measured (issue 36; docs: hangs, "The hang bound"): a prompt's first
engine step is covered by its size in tokens x a pace measured, not by the ceiling, so a hang
right after the loop's request is sent is found at the floor on a fast engine, streamed or not.
Each source, against the stand-in (a real process) through ralph-run's real agent proxy, the
progress probe checked every PERIOD s as a watch does:

- the engine's histograms (another client's finished request taught the pace);
- the calibration request of the run's first idle check (an engine without histograms);
- a non-streamed answer of the loop's, an upper bound of its first token;
- the steps the engine counts: a hang mid non-streamed generation, checks too seldom to have
  seen the engine step twice;
- and with nothing measured, the ceiling still covers the first step (no false death).

On the code before this rule, each hang here was found at the ceiling (CEILING s), not the floor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.standin import StandIn, wait_for

from ralph_runner.loop.proxy import Proxy
from ralph_runner.plugins import prometheus_text
from ralph_runner.probes import ProbeContext, ProbeResult, progress, run_probe
from ralph_runner.process.connection import for_host

pytestmark = pytest.mark.system

FLOOR, CEILING, MARGIN_X = 1.0, 30.0, 3.0  # the rule's limits, scaled down
TIMEOUT = 1.0  # the probe's timeout
SLACK = 1.5  # s of scheduling on a loaded two-core machine
NO_HISTOGRAMS = {"seconds": "engine:absent_seconds", "tokens": "engine:absent_tokens"}


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
def measurable(standin: StandIn) -> StandIn:
    """Prompts read at 20,000 tokens a second in one step: fast, but long enough to time."""
    standin.admin("prefill_tokens_per_second", 20000.0).raise_for_status()
    standin.admin("prefill_chunk", 8192).raise_for_status()
    return standin


@pytest.fixture
def proxy(standin: StandIn) -> Iterator[Proxy]:
    with Proxy(standin.url) as running:
        yield running


class Watcher:
    """The progress probe checked every `period` s on a thread, its results kept."""

    def __init__(self, standin: StandIn, proxy: Proxy, period: float = 0.25, **params: Any) -> None:
        self.params = progress.Params.model_validate(
            {
                "metrics": f"{standin.root_url}/metrics",
                "completion": {"url": standin.url, "model": standin.model},
                "stall": {"floor": FLOOR, "ceiling": CEILING, "margin": MARGIN_X},
                **params,
            }
        )
        self.client = httpx.Client()
        self.ctx = ProbeContext(self.client, for_host({}), TIMEOUT, traffic=proxy.awaiting)
        self.period = period
        self.results: list[tuple[float, ProbeResult]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        first = self.check()  # the start check: the canary answered (and the calibration)
        assert first.ok, first.detail
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
        while not self._stop.wait(self.period):
            self.check()

    def failure(self, within: float) -> tuple[float, ProbeResult]:
        """The first failed check, waited for up to `within` s."""
        return wait_for(
            lambda: next(((t, r) for t, r in self.results if not r.ok), None),
            within,
            "a failed check",
        )

    def memory(self) -> progress.Memory:
        return progress.memory_of(self.ctx)


def request(url: str, tokens: int, *, stream: bool = False, max_tokens: int = 5) -> Any:
    """A chat completion of a `tokens`-token prompt (the stand-in counts 4 characters a
    token), on a thread; its response (or exception) in `.outcome` when it ends."""
    body = {
        "model": "stand-in",
        "stream": stream,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "x" * (4 * tokens)}],
    }

    class Call(threading.Thread):
        outcome: Any = None

        def run(self) -> None:
            try:
                self.outcome = httpx.post(f"{url}/chat/completions", json=body, timeout=120)
            except httpx.HTTPError as exc:
                self.outcome = exc

    call = Call(daemon=True)
    call.start()
    return call


def hang_then_send(standin: StandIn, proxy: Proxy, watcher: Watcher, tokens: int) -> float:
    """EngineCore stopped while idle, the loop's request sent a moment later (not streamed):
    seconds from the send to the first failed check."""
    standin.admin("engine_hang").raise_for_status()
    sent = time.monotonic()
    request(proxy.url, tokens)
    failed_at, result = watcher.failure(CEILING + 10)
    assert result.reason == "stalled" and result.finding == "work-stalled", result.detail
    return failed_at - sent


def test_the_engines_histograms_pace_the_first_step_of_a_prompt(measurable, proxy):
    """Another client's finished 2,000-token request taught the engine's pace (vLLM's prefill
    time and prompt tokens): an idle hang just before the loop's non-streamed 2,000-token
    request is stalled at the floor, and the bound says which source set it."""
    standin = measurable
    with Watcher(standin, proxy, calibrate=False) as watcher:
        other = request(standin.url, 2000)  # not through the proxy: the engine's numbers only
        other.join(30)
        assert isinstance(other.outcome, httpx.Response) and other.outcome.status_code == 200
        ended = time.monotonic()  # a check sees the engine idle since (as before an agent's call)
        wait_for(lambda: watcher.memory().measures, 5, "the engine's measure")
        wait_for(lambda: idle_since(watcher, ended), 5, "an idle check")
        found = hang_then_send(standin, proxy, watcher, 2000)
        _, failed = watcher.failure(0)
    assert found <= FLOOR + watcher.period + SLACK, found
    assert "the engine's histograms" in failed.detail, failed.detail


def test_a_calibration_at_the_first_idle_check_paces_an_engine_without_histograms(standin, proxy):
    """No histograms and no request measured yet: the run's first idle check sends one
    request of about 1,000 tokens (its detail says what it measured), and a hang before the
    loop's first request is stalled at the floor, by the calibration's pace."""
    with Watcher(standin, proxy, prefill=NO_HISTOGRAMS) as watcher:
        first = watcher.results[0][1]
        assert "calibrated:" in first.detail and "prompt tokens" in first.detail, first.detail
        found = hang_then_send(standin, proxy, watcher, 2000)
        _, failed = watcher.failure(0)
    assert found <= FLOOR + watcher.period + SLACK, found
    assert "by calibration" in failed.detail, failed.detail


def test_a_whole_answer_is_an_upper_bound_of_its_first_token(standin, proxy):
    """No histograms, no calibration: the loop's non-streamed 2,000-token call answered whole
    in a fraction of a second bounds the pace from above; the next hang is found at the floor."""
    with Watcher(standin, proxy, prefill=NO_HISTOGRAMS, calibrate=False) as watcher:
        call = request(proxy.url, 2000)
        call.join(30)
        assert isinstance(call.outcome, httpx.Response) and call.outcome.status_code == 200
        found = hang_then_send(standin, proxy, watcher, 2000)
        _, failed = watcher.failure(0)
    assert found <= FLOOR + watcher.period + SLACK, found
    assert "whole answers (an upper bound)" in failed.detail, failed.detail


def test_steps_the_engine_counts_end_the_first_step_allowance(standin, proxy):
    """Nothing paced (the ceiling would cover the first step), checks 1 s apart: the engine
    stops 20 tokens into the loop's non-streamed 3,000-token answer. The engine counted its
    steps since the request was sent (vllm:iteration_tokens_total's count), so the first step
    is over: stalled at the floor, not at the ceiling."""
    params = {"prefill": NO_HISTOGRAMS, "calibrate": False}
    with Watcher(standin, proxy, period=1.0, **params) as watcher:
        request(proxy.url, 10, max_tokens=3000)
        wait_for(lambda: generated(standin) >= 20, 10, "20 tokens")
        standin.admin("engine_hang").raise_for_status()
        stopped = time.monotonic()
        failed_at, failed = watcher.failure(CEILING + 10)
    assert failed_at - stopped <= FLOOR + watcher.period + SLACK, failed.detail
    assert "to its first token" not in failed.detail, failed.detail  # the steps set it


def test_with_nothing_measured_the_ceiling_covers_a_slow_first_step(standin, proxy):
    """No histograms, no calibration, no answer yet: the loop's first prompt on an engine that
    reads it in one 4 s step (four times the floor) is no failure: the ceiling covers it."""
    standin.admin("prefill_tokens_per_second", 250.0).raise_for_status()
    standin.admin("prefill_chunk", 1000).raise_for_status()
    with Watcher(standin, proxy, prefill=NO_HISTOGRAMS, calibrate=False) as watcher:
        call = request(proxy.url, 1000)
        why = wait_for(lambda: watcher.memory().bound, 10, "a bound").why
        call.join(60)
    assert isinstance(call.outcome, httpx.Response) and call.outcome.status_code == 200
    assert [r for _, r in watcher.results if not r.ok] == []
    assert "pace unmeasured" in why, why


def generated(standin: StandIn) -> float:
    text = httpx.get(f"{standin.root_url}/metrics", timeout=5).text
    return prometheus_text.metric_sum(text, "vllm:generation_tokens_total") or 0.0


def idle_since(watcher: Watcher, since: float) -> bool:
    """A check after `since` saw the engine idle (its steps counted then)."""
    return any(at > since and idle for at, _, idle in watcher.memory().meter.steps_seen)
