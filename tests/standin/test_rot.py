"""The stand-in's rot (standin/rot.py): a real server process that degrades without dying, as
vLLM's do: decode slower with age, memory that grows until the OOM kill, preemptions. Read
through its own /metrics, as ralph-run's signs read it (loop/signs.py)."""

from __future__ import annotations

import httpx
import psutil
import pytest
from support.standin import StandIn, wait_for

from ralph_runner.loop.signs import MIB, Scrape, parse

pytestmark = pytest.mark.timeout(60)


def scrape(standin: StandIn) -> Scrape:
    return parse(standin.get("/metrics").text, at=0.0)


def generate(standin: StandIn, tokens: int) -> None:
    body = {"model": standin.model, "prompt": "go", "max_tokens": tokens, "min_tokens": tokens}
    response = httpx.post(f"{standin.url}/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def decode_rate(standin: StandIn, tokens: int = 40) -> float:
    """Tokens/s of one generation's decode, from the inter-token latency histogram's deltas."""
    before = scrape(standin)
    generate(standin, tokens)
    after = scrape(standin)
    return (after.inter_tokens - before.inter_tokens) / (
        after.inter_token_seconds - before.inter_token_seconds
    )


def test_decode_slows_with_age_to_its_floor_and_a_new_server_is_fast_again(
    standin: StandIn,
) -> None:
    args = ("--tokens-per-second", "100", "--decode-halflife", "2", "--decode-floor", "20")
    child = standin.spawn(*args)
    try:
        fresh = decode_rate(standin)
        assert fresh > 60  # 100 tokens/s, less the machine's jitter
        aged = wait_for(lambda: (r := decode_rate(standin)) < fresh / 2 and r, timeout=20,
                        what="decode to slow with age")  # fmt: skip
        floor = wait_for(lambda: (r := decode_rate(standin)) < 25 and r, timeout=20,
                         what="decode at its floor")  # fmt: skip
        assert floor > 14  # the floor holds: 20 tokens/s, less jitter
        assert aged < fresh / 2
    finally:
        child.terminate()
        child.wait(10)
    child = standin.spawn(*args)
    try:
        assert decode_rate(standin) > 60
    finally:
        child.terminate()
        child.wait(10)


def test_a_leak_grows_resident_memory_until_the_oom_kill(standin: StandIn) -> None:
    child = standin.spawn("--leak-kb-per-request", "8192", "--memory-limit-mb", "160")
    process = psutil.Process(child.pid)
    start = scrape(standin).resident_bytes
    assert start is not None and abs(start - process.memory_info().rss) < 16 * MIB
    generate(standin, 1)
    generate(standin, 1)
    grown = scrape(standin).resident_bytes
    assert grown is not None and grown - start >= 15 * MIB
    requests = 2
    while child.poll() is None and requests < 100:
        try:
            generate(standin, 1)
        except (httpx.HTTPError, AssertionError):
            break  # the request that pushed it past the limit: killed in its handling
        requests += 1
    assert child.wait(10) == -9  # SIGKILL, as the OOM killer's
    assert "Out of memory: killed process" in standin.log()
    assert standin.exit_marker() is None  # nothing written after a SIGKILL


def test_preemptions_are_counted_per_request(standin: StandIn) -> None:
    child = standin.spawn("--preemptions-per-request", "3")
    try:
        assert scrape(standin).preemptions == 0
        generate(standin, 2)
        generate(standin, 2)
        assert scrape(standin).preemptions == 6
    finally:
        child.terminate()
        child.wait(10)
