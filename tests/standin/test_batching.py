"""The stand-in's batching mode (`--batch-curve`, standin/batching.py): its engine's steps
lengthen with the batch as a measured GPU's do, so the server's total tokens/s rises with
concurrency and flattens, where by default every sequence keeps its speed whatever the batch.

Rates are read from the stand-in's own counters (vllm:generation_tokens_total), scraped while N
streamed generations run; the window's ends are the scrapes' own times.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest
from support.faithful import Target, long_request
from support.standin import StandIn, wait_for

from ralph_runner.standin.batching import CURVES, BatchCurve, parse_curve

pytestmark = pytest.mark.timeout(120)

RATE = 20  # tokens/s of one sequence alone: 50 ms steps, so a loaded machine's jitter is small
WINDOW = 3.0  # s of counters per measurement
LONG = 5000  # tokens a generation asks for: far more than a measurement lasts
TOLERANCE = 0.15  # measured / expected, on two shared cores
JSON = {"Content-Type": "application/json"}
SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)


class Generation(threading.Thread):
    """One streamed generation that never ends by itself, read line by line through the standard
    library's http.client (a thread per stream, cheap: an httpx client per stream cost seconds of
    this process's CPU on a loaded machine); `leave()` hangs up, and the server aborts it."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.port, self.body = port, json.dumps(body)
        self.leaving = threading.Event()
        self.start()

    def run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request("POST", "/v1/chat/completions", self.body, JSON)
            response = connection.getresponse()
            while not self.leaving.is_set() and response.readline():
                pass
        finally:
            connection.close()

    def leave(self) -> None:
        self.leaving.set()
        self.join(10)


class Counters:
    """The stand-in's /metrics through one kept-alive client."""

    def __init__(self, target: Target) -> None:
        self.url = f"{target.root_url}/metrics"
        self.client = httpx.Client(timeout=30)

    def read(self) -> dict[str, float]:
        text = self.client.get(self.url).text
        return {m[1]: float(m[2]) for m in SAMPLE.finditer(text)}

    def running(self) -> float:
        return self.read()["vllm:num_requests_running"]

    def scrape(self) -> tuple[float, float]:
        """(when, generated tokens so far): the time is the middle of the scrape."""
        before = time.monotonic()
        tokens = self.read()["vllm:generation_tokens_total"]
        return (before + time.monotonic()) / 2, tokens


def total_rate(target: Target, concurrency: int) -> float:
    """The server's generated tokens/s while `concurrency` generations run at once."""
    counters = Counters(target)
    body = long_request(target, max_tokens=LONG)  # plan_of makes a Piece per token
    port = int(target.root_url.rsplit(":", 1)[1])
    streams = [Generation(port, body) for _ in range(concurrency)]
    try:
        wait_for(lambda: counters.running() == concurrency, 30, f"{concurrency} running")
        start = counters.scrape()

        def window_over() -> tuple[float, float] | None:
            now = counters.scrape()
            return now if now[0] - start[0] >= WINDOW else None

        end = wait_for(window_over, 30, "the window's end")
        assert counters.running() == concurrency
        return (end[1] - start[1]) / (end[0] - start[0])
    finally:
        for stream in streams:
            stream.leave()
        wait_for(lambda: counters.running() == 0, 30, "the aborts")
        counters.client.close()


def close_to(measured: float, expected: float) -> bool:
    return abs(measured / expected - 1) <= TOLERANCE


def test_the_curve_is_the_measured_points_joined_by_lines() -> None:
    curve = parse_curve("h100-llama8b")
    assert [curve.step(b) for b, _ in CURVES["h100-llama8b"]] == [6.48, 6.59, 10.94, 46.91]
    assert curve.step(8) == pytest.approx(6.59 + (10.94 - 6.59) * 4 / 12)
    assert curve.stretch(1) == 1.0
    # past the last point the last slope goes on: the total flattens, never falls to nothing
    assert curve.total(128) == pytest.approx(curve.total(64), rel=0.02)
    assert parse_curve("1:10, 8:40") == BatchCurve(((1, 10.0), (8, 40.0)))
    for bad in ("h200", "8:40,1:10", "0:5", "1:0", "1:x"):
        with pytest.raises(ValueError):
            parse_curve(bad)


def test_total_tokens_per_second_rise_with_concurrency_by_the_curve(standin: StandIn) -> None:
    child = standin.spawn("--tokens-per-second", str(RATE), "--batch-curve", "h100-llama8b")
    target = standin.target(child)
    curve = parse_curve("h100-llama8b")
    alone = total_rate(target, 1)
    assert close_to(alone, RATE), alone
    rates = {n: total_rate(target, n) for n in (4, 8, 16, 32)}
    for n, rate in rates.items():
        assert close_to(rate / alone, curve.total(n)), (n, rate / alone, curve.total(n))
    # it rises (3.9x at 4, 6.4x at 8, 9.5x at 16), then flattens (9.0x at 32)
    assert alone < rates[4] < rates[8] < rates[16]
    assert close_to(rates[32], rates[16])


def test_by_default_every_sequence_keeps_its_speed_and_the_fault_sets_a_curve(
    standin: StandIn,
) -> None:
    child = standin.spawn("--tokens-per-second", str(RATE))
    target = standin.target(child)
    alone = total_rate(target, 1)
    assert close_to(total_rate(target, 8) / alone, 8)
    assert standin.admin("batch_curve", "1:10,0:20").status_code == 400
    assert standin.admin("batch_curve", "1:10,8:40").status_code == 200
    assert close_to(total_rate(target, 8) / alone, 8 / 4)  # each step 4x as long
    assert standin.admin("batch_curve", False).status_code == 200
    assert close_to(total_rate(target, 8) / alone, 8)
