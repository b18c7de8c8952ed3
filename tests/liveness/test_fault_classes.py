"""What a failed first check means (liveness/faults.py): a server that is not serving *yet*
(nothing listens, or llama.cpp's 503 "Loading model") is a start, not a death; vLLM's 503 of a
dead engine, or any other failure, is a death of its class."""

from __future__ import annotations

import pytest

from ralph_runner.liveness import faults
from ralph_runner.probes import ProbeResult

LOADING = '{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'


def failed(reason: str, detail: str) -> ProbeResult:
    return ProbeResult("engine progress", "progress", False, reason, detail, 0.01)


@pytest.mark.parametrize(
    ("reason", "detail", "yet"),
    [
        ("refused", "connection refused", True),
        ("status", f"http://127.0.0.1:8080/metrics: HTTP 503: {LOADING}", True),  # llama.cpp
        ("status", f"HTTP 503: {LOADING}", True),  # the http probe's words
        ("status", "http://127.0.0.1:8000/metrics: HTTP 503: ", False),  # vLLM, engine dead
        ("status", f"http://127.0.0.1:8080/metrics: HTTP 500: {LOADING}", False),
        ("timeout", "no answer within 5 s", False),
        ("stalled", "no token for 4.1 s while 1 request active", False),
    ],
)
def test_only_nothing_listening_or_a_model_loading_is_not_serving_yet(
    reason: str, detail: str, yet: bool
) -> None:
    assert faults.not_serving_yet(failed(reason, detail)) is yet


def test_a_loading_server_found_later_is_still_classed_as_a_death() -> None:
    """Past the first check a 503 is what it always was: the engine answers, and not work."""
    cls, evidence = faults.classify([failed("status", f"HTTP 503: {LOADING}")])
    assert cls == faults.DEAD and "Loading model" in evidence
