"""Behavioural checks that hold for the stand-in and for a real vLLM alike (tests/standin and
tests/real/test_real_faithful.py run the same ones, so the stand-in cannot drift from vLLM).

Each takes a `Target`: where the server is and how to break it (the stand-in: its admin
endpoint; a real vLLM: signals to its VLLM::EngineCore), so one parametrised test can run them
against both.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from httpx_sse import ServerSentEvent, connect_sse
from prometheus_client.parser import text_string_to_metric_families

from support.standin import wait_for


@dataclass
class Target:
    """A vLLM-compatible server under test and the ways to break it."""

    root_url: str  # http://127.0.0.1:PORT, no /v1
    model: str
    hang: Callable[[], None]  # the engine stops (vLLM: SIGSTOP of EngineCore)
    resume: Callable[[], None]  # ... and goes on (SIGCONT)
    kill: Callable[[], None]  # the engine dies (vLLM: kill -9 of EngineCore)
    exit_code: Callable[[float], int | None]  # waits up to N s for the API server's exit code
    log: Callable[[], str]  # the server's log so far
    long_tokens: int = 400  # a generation that lasts a few seconds at the server's speed

    @property
    def url(self) -> str:
        return f"{self.root_url}/v1"

    def get(self, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(self.root_url + path, timeout=timeout)

    def generate(self, timeout: float = 5.0, **extra: Any) -> httpx.Response:
        """A non-streamed chat completion."""
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], **extra}
        return httpx.post(f"{self.url}/chat/completions", json=body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Each sample of /metrics parsed by prometheus_client, summed over label sets."""
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def tokens(self) -> float:
        found = self.metrics()
        return found["vllm:generation_tokens_total"] + found["vllm:prompt_tokens_total"]


def long_request(target: Target, route: str = "/chat/completions", **extra: Any) -> dict[str, Any]:
    """A generation that runs `long_tokens` tokens (ignore_eos), streamed with usage."""
    body: dict[str, Any] = {"model": target.model, "stream": True, "ignore_eos": True}
    if route == "/responses":
        body |= {"input": "tell me a story", "max_output_tokens": target.long_tokens}
    elif route == "/completions":
        body |= {"prompt": "tell me a story", "max_tokens": target.long_tokens}
    else:
        body |= {"messages": [{"role": "user", "content": "tell me a story"}]}
        body |= {"max_tokens": target.long_tokens}
    if route != "/responses":
        body["stream_options"] = {"include_usage": True}
    return body | extra


class Stream(threading.Thread):
    """Reads one SSE stream in the background with httpx-sse (a parser of the standard):
    its events as they come, how it ended (`done`, or `error`: the exception)."""

    def __init__(self, url: str, body: dict[str, Any], read_timeout: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.timeout = httpx.Timeout(10.0, read=read_timeout)
        self.events: list[ServerSentEvent] = []
        self.status: int | None = None
        self.content_type = ""
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._leaving = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with (
                httpx.Client(timeout=self.timeout) as client,
                connect_sse(client, "POST", self.url, json=self.body) as source,
            ):
                self.status = source.response.status_code
                self.content_type = source.response.headers.get("content-type", "")
                for event in source.iter_sse():
                    if self._leaving.is_set():
                        return  # the connection closes: the server aborts the generation
                    self.events.append(event)
        except BaseException as error:  # reported to the test, whatever it is
            self.error = error
        finally:
            self.done.set()

    def data(self) -> list[Any]:
        """Each event's data, JSON-decoded ("[DONE]" stays a string)."""
        return [e.data if e.data == "[DONE]" else json.loads(e.data) for e in self.events]

    def wait(self, timeout: float = 60.0) -> Stream:
        assert self.done.wait(timeout), f"the stream did not end within {timeout} s"
        return self

    def leave(self) -> Stream:
        """Hang up at the next event, as a client that gives up would."""
        self._leaving.set()
        return self.wait()


# How long the busy and fault checks wait for a real server that streams a long generation on
# a loaded 2-core machine (check_busy says what was measured); only a failing check waits it out.
BUSY_WAIT = 120.0


def wait_streaming(stream: Stream, count: int = 3, timeout: float = 30.0) -> None:
    """Until the stream has `count` events (its generation is running)."""
    wait_for(lambda: len(stream.events) >= count or stream.done.is_set(), timeout, "events")
    assert not stream.done.is_set(), f"the stream ended early: {stream.error!r}"


def wait_frozen(target: Target, timeout: float = 30.0) -> float:
    """Until two scrapes of the token counters 0.3 s apart agree; the frozen total."""
    last = target.tokens()

    def frozen() -> bool:
        nonlocal last
        time.sleep(0.3)  # the window in which a live engine would have made tokens
        now = target.tokens()
        same, last = now == last, now
        return same

    wait_for(frozen, timeout, "the token counters to stop")
    return last


def check_metrics_exposition(target: Target) -> None:
    """/metrics parses as Prometheus text with vLLM's names, types and labels."""
    families = {f.name: f for f in text_string_to_metric_families(target.get("/metrics").text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
    }
    for name, kind in expected.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, (name, families[name].type)
        (sample, *_) = families[name].samples
        assert sample.labels["model_name"] == target.model and sample.labels["engine"] == "0"
    counter = [s.name for s in families["vllm:generation_tokens"].samples]
    assert "vllm:generation_tokens_total" in counter


def check_chat_stream(target: Target) -> Stream:
    """SSE of chat.completion.chunk: role first, content deltas, a finish_reason, a usage
    chunk with no choices, then [DONE]; every frame `data: ...` and nothing after [DONE]."""
    body = long_request(target, max_tokens=5)
    stream = Stream(f"{target.url}/chat/completions", body).wait()
    assert stream.error is None, repr(stream.error)
    assert (stream.status, stream.content_type.split(";")[0]) == (200, "text/event-stream")
    data = stream.data()
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    chunks, usage = data[:-2], data[-2]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in data[:-1]}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert all(not e.event or e.event == "message" for e in stream.events)
    return stream


def check_completions_stream(target: Target) -> None:
    stream = Stream(f"{target.url}/completions", long_request(target, "/completions", max_tokens=4))
    data = stream.wait().data()
    assert stream.error is None and data[-1] == "[DONE]"
    assert {d["object"] for d in data[:-1]} == {"text_completion"}
    assert data[-2]["choices"] == [] and data[-2]["usage"]["completion_tokens"] == 4
    assert data[-3]["choices"][0]["finish_reason"] == "length"


def check_responses_stream(target: Target) -> None:
    """The Responses API stream as codex reads it: created, in_progress, the message item
    added, its text deltas, done events, and response.completed with usage; each event's
    `event:` names its data's type and sequence numbers count up from 0."""
    body = long_request(target, "/responses", max_output_tokens=6)
    stream = Stream(f"{target.url}/responses", body).wait()
    assert stream.error is None, repr(stream.error)
    data = stream.data()
    kinds = [d["type"] for d in data]
    assert [e.event for e in stream.events] == kinds
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[:3] == head and kinds[3] == "response.content_part.added"
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds[-4:] == tail
    deltas = [d["delta"] for d in data if d["type"] == "response.output_text.delta"]
    assert deltas and set(kinds[4:-4]) == {"response.output_text.delta"}
    final = data[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "".join(deltas)
    assert final["usage"]["output_tokens"] == 6
    assert data[0]["response"]["id"] == final["id"]


def check_engine_hang(target: Target) -> None:
    """The engine stops during a streamed generation: /health, /v1/models and /metrics keep
    answering 200, the token counters freeze while num_requests_running stays above 0, the
    stream just stops (no byte, no end, connection open) and a new generation gets no answer;
    after resume the stream goes on and, once its client leaves, a new generation completes
    (waiting out the rest of the long one took 115 s of the real engine here)."""
    stream = Stream(f"{target.url}/chat/completions", long_request(target))
    try:
        wait_streaming(stream, timeout=BUSY_WAIT)
        target.hang()
        try:
            frozen = wait_frozen(target)
            seen = len(stream.events)
            for path in ("/health", "/v1/models", "/metrics"):
                assert target.get(path).status_code == 200, path
            assert target.metrics()["vllm:num_requests_running"] >= 1
            with pytest.raises(httpx.ReadTimeout):
                target.generate(timeout=1.0, max_tokens=1)
            assert target.tokens() == frozen
            assert len(stream.events) == seen and not stream.done.is_set()
        finally:
            target.resume()  # a failed check leaves no frozen engine to the next one
        wait_for(lambda: len(stream.events) > seen, BUSY_WAIT, "the stream to go on")
        assert not stream.done.is_set(), f"the stream ended at resume: {stream.error!r}"
    finally:
        stream.leave()  # no generation left running for the next check to wait behind
    assert stream.error is None, repr(stream.error)
    assert target.generate(timeout=BUSY_WAIT, max_tokens=1).status_code == 200


def check_engine_death(target: Target) -> None:
    """The engine dies during a streamed generation: the stream gets vLLM's error frame then
    [DONE] (status 200 was sent already), a new generation answers 500 with EngineDeadError's
    message, the API server exits 0 and its log holds vLLM's death lines."""
    stream = Stream(f"{target.url}/chat/completions", long_request(target))
    wait_streaming(stream, timeout=BUSY_WAIT)
    target.kill()
    stream.wait()
    assert stream.error is None, repr(stream.error)
    *_, error, done = stream.data()
    assert done == "[DONE]"
    assert error["error"]["message"].startswith("EngineCore encountered an issue.")
    assert error["error"]["code"] == 500
    with contextlib.suppress(httpx.TransportError):  # or already gone: refused
        answer = target.generate()
        assert answer.status_code == 500
        assert "EngineCore encountered an issue" in answer.json()["error"]["message"]
    assert target.exit_code(30.0) == 0
    log = target.log()
    for line in (
        "MPClient: engine core exited unexpectedly",
        "AsyncLLM output_handler failed",
        "vllm.v1.engine.exceptions.EngineDeadError",
        "Shutting down",
    ):
        assert line in log, line


def check_busy(target: Target) -> None:
    """With max-num-seqs 1 and a long generation running, a second request waits: it shows in
    num_requests_waiting while the token counters keep moving. When the first one's client
    leaves, the generation is aborted and the second completes.

    The first asks for more tokens than the checks take to watch, however fast the engine (the
    real one did 2,000 tokens in 2 s on a quiet machine), and is ended by its client, also when
    the check fails (a generation left running made the next checks wait behind it, in CI).
    The waits are long: on a loaded 2-core machine the real API server, which streams the first
    generation, took 6-13 s to queue the second and up to 10 s per /metrics scrape (measured
    with two CPU hogs), and a failed check in CI had allowed 30 s."""
    busy = long_request(target, max_tokens=5 * target.long_tokens)
    first = Stream(f"{target.url}/chat/completions", busy)
    second: Stream | None = None
    try:
        wait_streaming(first, timeout=BUSY_WAIT)
        # The second hears nothing until the first is gone, and the checks below may take their
        # three waits in all on a slow machine (CI's took 295 s once; at a 120 s read timeout the
        # queued request gave up before the first was left).
        second = Stream(
            f"{target.url}/chat/completions",
            long_request(target, max_tokens=2),
            read_timeout=4 * BUSY_WAIT,
        )
        seen: dict[str, float] = {}

        def waiting() -> bool:
            seen.update(target.metrics())
            assert not first.done.is_set(), f"the long generation ended first: {first.error!r}"
            return seen["vllm:num_requests_waiting"] >= 1

        try:
            wait_for(waiting, BUSY_WAIT, "a waiting request")
        except AssertionError as error:
            running = seen.get("vllm:num_requests_running")
            raise AssertionError(
                f"{error}; last scrape: running {running}, waiting"
                f" {seen.get('vllm:num_requests_waiting')}; the first generation's events:"
                f" {len(first.events)}; the second's: {len(second.events)}, {second.error!r}"
            ) from None
        before = target.tokens()
        wait_for(lambda: target.tokens() > before, BUSY_WAIT, "the counters to move")
        assert not first.done.is_set(), (
            f"the long generation ended before the checks: {first.error}"
        )
        assert not second.done.is_set(), f"the queued request ended: {second.error!r}"
        assert first.leave().error is None
        assert second.wait(BUSY_WAIT).error is None and second.data()[-1] == "[DONE]"
    finally:
        for stream in (first, second):
            if stream is not None and not stream.done.is_set():
                stream.leave()
