"""The progress probe against a real HTTP server that answers like vLLM (engine_helpers.Engine):
busy is never a failure, a hang is "stalled", a dead engine is "status"."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import httpx
import pytest
from engine_helpers import Engine
from support.standin import free_port, wait_for

from ralph_runner import probes
from ralph_runner.plugins import prometheus_text
from ralph_runner.probes import ProbeContext, ProbeResult, progress, run_probe
from ralph_runner.process.connection import for_host

MARGIN = 0.5  # scheduling slack on a loaded 2-core machine


@pytest.fixture
def engine():
    with Engine() as scripted:
        yield scripted


@pytest.fixture
def client():
    with httpx.Client() as shared:
        yield shared


class Prober:
    """One progress probe with its memory, checked again and again as a worker would."""

    def __init__(self, client: httpx.Client, params: dict, timeout: float = 1.0) -> None:
        self.params = progress.Params.model_validate(params)
        self.ctx = ProbeContext(client, for_host({}), timeout)

    def check(self) -> ProbeResult:
        return run_probe("engine progress", "progress", self.params, self.ctx)


def params_for(engine: Engine, stall_after: float = 0.6, canary: bool = True) -> dict:
    params: dict = {"metrics": engine.metrics_url, "stall_after": stall_after}
    if canary:
        params["completion"] = {"url": engine.url, "model": "m"}
    return params


@pytest.fixture
def prober(engine, client):
    return Prober(client, params_for(engine))


def verdict(result: ProbeResult) -> tuple[bool, str | None]:
    """ok and reason; a failed verdict's reason is one of the reasons probes document."""
    assert result.ok or result.reason in probes.REASONS, result
    return result.ok, result.reason


# idle


def test_idle_engine_answers_the_canary(engine, prober):
    first = prober.check()
    assert verdict(first) == (True, None)
    assert first.detail.startswith("idle: a 1-token request answered in")
    assert engine.completions == 1


def test_idle_hang_is_stalled_within_the_timeout(engine, prober):
    prober.check()
    engine.hang()

    started = time.monotonic()
    result = prober.check()

    assert verdict(result) == (False, "stalled") and result.finding == "idle-unanswered"
    assert re.fullmatch(
        r"idle engine did not answer a 1-token request within \d+(\.\d+)? s( \(bound .*\))?",
        result.detail,
    )
    assert time.monotonic() - started < prober.ctx.timeout + MARGIN


def test_an_engine_that_answered_gets_stall_after_before_an_unanswered_canary_is_stalled(
    engine, client
):
    """The gauges say idle until an engine step ends: the first chunk of a long prompt that just
    came looks like an idle engine that does not answer. One that answered a canary before gets
    stall_after s from its first unanswered one; a hang is still stalled once they are up."""
    stall_after, timeout = 3.0, 1.0
    prober = Prober(client, params_for(engine, stall_after=stall_after), timeout=timeout)
    assert verdict(prober.check()) == (True, None)  # it answered
    engine.hang()
    unanswered = time.monotonic()  # the first unanswered canary is sent now
    first = prober.check()
    assert verdict(first) == (True, None) and first.detail.startswith("busy?: no answer"), first

    def failed() -> ProbeResult | None:
        result = prober.check()
        return None if result.ok else result

    result = wait_for(failed, 10, "the hang to be stalled")
    waited = time.monotonic() - unanswered
    assert verdict(result) == (False, "stalled") and "did not answer a 1-token" in result.detail
    assert result.finding == "idle-unanswered"
    # The grace is stall_after s, no less and not much more: the check that ends it waits out
    # its own canary (timeout s), and the check before it may have just begun (timeout s more).
    assert stall_after <= waited <= stall_after + 2 * timeout + MARGIN, waited


def test_a_server_that_never_answered_gets_no_grace(engine, client):
    """A server starting (a recovery waits for it) that does not answer is not busy: stalled."""
    prober = Prober(client, params_for(engine, stall_after=30.0), timeout=1.0)
    engine.hang()
    assert verdict(prober.check()) == (False, "stalled")


def test_idle_dead_engine_is_a_status_failure(engine, prober):
    engine.completion_status = 500
    result = prober.check()
    assert verdict(result) == (False, "status")
    assert result.detail.startswith("HTTP 500:") and "EngineCore encountered an issue" in (
        result.detail
    )


def test_without_a_canary_idle_is_ok_and_sends_nothing(engine, client):
    prober = Prober(client, params_for(engine, canary=False))
    assert prober.check().detail == "idle: no request active"
    assert engine.completions == 0


# busy and hung with requests active


def test_moving_counters_are_progress(engine, prober):
    engine.running = 2
    prober.check()
    engine.generation_tokens += 7
    engine.prompt_tokens += 100
    result = prober.check()
    assert verdict(result) == (True, None)
    assert result.detail == "progress: +107 tokens, 2 active"


def test_busy_engine_is_never_a_failure_and_gets_no_canary(engine, prober):
    """Long generations and a full queue (a canary would wait): checks well past stall_after."""
    engine.busy(tokens_per_second=20, running=1, waiting=4)
    results = []
    until = time.monotonic() + 3 * prober.params.stall_after
    while time.monotonic() < until:
        before = engine.generation_tokens
        wait_for(lambda b=before: engine.generation_tokens > b, 5, "a token")  # never frozen
        results.append(prober.check())
    assert all(r.ok for r in results), [r.detail for r in results if not r.ok]
    assert engine.completions == 0


def test_hang_with_a_request_active_is_stalled_after_stall_after(engine, prober):
    engine.running = 1
    prober.check()  # first look: tokens so far, the clock starts
    engine.generation_tokens += 5
    last_token_seen = time.monotonic()  # before the check that sees the tokens
    moved = prober.check()
    engine.hang()

    results = []
    while (result := prober.check()).ok:
        results.append(result)
        assert time.monotonic() - last_token_seen < prober.params.stall_after + MARGIN
        time.sleep(0.05)  # a watch's period, shortened
    stalled_at = time.monotonic() - last_token_seen

    assert moved.detail.startswith("progress: +5 tokens")
    assert results and all(r.detail.startswith("busy: 1 active, no token for") for r in results)
    assert (result.reason, result.detail[:13]) == ("stalled", "no token for ")
    assert "s while 1 request active (bound 0.6 s: stall_after 0.6 s)" in result.detail
    assert result.finding == "work-stalled" and all(r.finding is None for r in results)
    assert stalled_at >= prober.params.stall_after
    assert engine.completions == 0  # requests active: no canary needed, none sent


def test_metrics_late_while_work_is_active_is_busy_until_stall_after(engine, client):
    """A server too starved to answer /metrics in time while it generates (a CPU engine on two
    cores): busy within the stall window from the last progress seen, then stalled. With no
    work seen at the last answer, a late /metrics is an ordinary timeout."""
    prober = Prober(client, params_for(engine, stall_after=3.0))  # a late check takes 1 s
    engine.running = 1
    prober.check()
    engine.generation_tokens += 5
    last_token_seen = time.monotonic()
    assert prober.check().detail.startswith("progress: +5 tokens")
    engine.metrics_delay = 2 * prober.ctx.timeout
    late = prober.check()
    assert verdict(late) == (True, None), late.detail
    assert late.detail.startswith("timed out after 1s (read)") and "busy: 1 active" in late.detail
    while (result := prober.check()).ok:
        assert time.monotonic() - last_token_seen < prober.params.stall_after + 2 + MARGIN
    assert result.reason == "stalled" and "no token for" in result.detail, result.detail
    assert result.finding == "work-stalled"  # found by the late check's own reading

    idle = Prober(client, params_for(engine))
    engine.metrics_delay, engine.running = 0.0, 0
    idle.check()
    engine.metrics_delay = 2 * idle.ctx.timeout
    assert verdict(idle.check()) == (False, "timeout")


def test_metrics_late_while_the_loops_request_awaits_is_busy_though_last_seen_idle(engine, client):
    """The last answer said idle, then the loop's own request was sent (the proxy tells) and
    /metrics answers late (an engine that answers it between batches, in its first one): busy
    within the stall window from when the request was sent, then stalled; without the
    request, the same late answer is an ordinary timeout."""
    awaiting: list[probes.Awaiting] = []  # what the proxy says: nothing yet
    prober = Prober(client, params_for(engine, stall_after=3.0))
    prober.ctx = replace(prober.ctx, traffic=lambda: awaiting[0] if awaiting else None)
    assert prober.check().detail.startswith("idle")
    sent = time.monotonic()
    awaiting.append(probes.Awaiting(count=1, since=sent, latest=sent, tokens=10))
    engine.metrics_delay = 2 * prober.ctx.timeout
    late = prober.check()
    assert verdict(late) == (True, None), late.detail
    assert "busy: 1 active" in late.detail, late.detail
    while (result := prober.check()).ok:
        assert time.monotonic() - sent < prober.params.stall_after + 2 + MARGIN
    assert result.reason == "stalled" and result.finding == "work-stalled", result.detail


def test_an_unanswered_canary_with_tokens_moving_meanwhile_is_busy(engine, prober):
    """Idle at the scrape; then work arrives and takes the engine: the canary waits in its
    queue, but tokens move: busy, not stalled."""
    prober.check()
    engine.hang()  # the canary will wait, while someone else's tokens are counted
    engine.on_completion = lambda: engine.busy(tokens_per_second=50, running=0, waiting=0)
    result = prober.check()
    assert verdict(result) == (True, None)
    assert result.detail.startswith("busy: +") and "while our 1-token request waited" in (
        result.detail
    )


def test_a_new_server_whose_counters_restart_is_a_first_look(engine, prober):
    engine.generation_tokens = engine.prompt_tokens = 1000
    engine.running = 1
    prober.check()
    time.sleep(prober.params.stall_after)  # frozen for longer than stall_after...
    engine.generation_tokens = engine.prompt_tokens = 0  # ...but that server was replaced
    result = prober.check()
    assert verdict(result) == (True, None)
    assert result.detail.startswith("busy: 1 active, no token for 0.")


# what /metrics cannot say


def test_refused(client):
    port = free_port()
    prober = Prober(client, {"metrics": f"http://127.0.0.1:{port}/metrics"})
    result = prober.check()
    assert verdict(result) == (False, "refused")
    assert result.detail == f"connection refused (GET http://127.0.0.1:{port}/metrics)"


def test_metrics_error_status(engine, prober):
    engine.metrics_status = 500
    result = prober.check()
    assert verdict(result) == (False, "status")
    assert result.detail.startswith(f"{engine.metrics_url}: HTTP 500:")


def test_a_missing_counter_is_said_once_and_left_out(engine, prober):
    engine.omit = {"vllm:prompt_tokens_total"}
    engine.running = 1
    first, second = prober.check(), prober.check()
    engine.generation_tokens += 2
    third = prober.check()
    assert first.ok and first.detail.endswith(
        " (/metrics lacks vllm:prompt_tokens_total: left out)"
    )
    assert second.ok and "lacks" not in second.detail
    assert third.detail == "progress: +2 tokens, 1 active"


def test_metrics_without_any_counter_is_a_body_failure(engine, prober):
    engine.omit = {"vllm:prompt_tokens_total", "vllm:generation_tokens_total"}
    result = prober.check()
    assert verdict(result) == (False, "body")
    assert result.detail.startswith(
        f"{engine.metrics_url} lacks all counters vllm:generation_tokens_total, "
        "vllm:prompt_tokens_total: # HELP"
    )


def test_huge_metrics_with_histograms_are_read_quickly(engine, prober):
    engine.padding = 200_000  # about 12 MB of histogram buckets (under the 16 MiB read cap)
    engine.running = 1
    prober.ctx.timeout = 20
    prober.check()
    engine.generation_tokens += 1
    started = time.monotonic()
    result = prober.check()
    assert result.detail == "progress: +1 tokens, 1 active"
    assert time.monotonic() - started < 5


# the Prometheus text scan


def test_metric_sum_over_label_sets_ignoring_created_and_other_names():
    text = (
        "# HELP vllm:generation_tokens_total tokens\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="a} b\\"c"} 12.0\n'
        'vllm:generation_tokens_total{engine="1"} 3 1700000000000\n'
        'vllm:generation_tokens_created{engine="0"} 1.7e9\n'
        "vllm:generation_tokens_totalish 99\n"
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_requests_running{engine="1"} 2'
    )
    assert prometheus_text.metric_sum(text, "vllm:generation_tokens_total") == 15.0
    assert prometheus_text.metric_sum(text, "vllm:generation_tokens") == 15.0  # the family name
    assert prometheus_text.metric_sum(text, "vllm:num_requests_running") == 2.0
    assert prometheus_text.metric_sum(text, "vllm:prompt_tokens_total") is None
    assert prometheus_text.metric_sum("vllm:x 1\n", "vllm:x") == 1.0  # the first line


def test_malformed_lines_cost_their_own_samples_only():
    """prometheus_client's parser refuses a malformed line: that sample is left out, the rest
    of the page is read; a page with none of the counters is a "body" failure, not a crash."""
    text = (
        "vllm:generation_tokens_total{engine=0} 7\n"  # unquoted label value
        'vllm:generation_tokens_total{engine="1" 7\n'  # unclosed label set
        "vllm:generation_tokens_total many\n"  # no number
        "vllm:generation_tokens_total\n"  # no value
        'vllm:generation_tokens_total{engine="2"} 5\n'
    )
    assert prometheus_text.metric_sum(text, "vllm:generation_tokens_total") == 5.0
    assert [s.value for s in prometheus_text.samples(text, ["vllm:x"])] == []
