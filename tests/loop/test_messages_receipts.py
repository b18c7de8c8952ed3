"""Receipts for Anthropic's Messages API (Claude Code's): the loop proxy counts input and output
tokens of `/v1/messages` (and `?beta=true`), streamed and whole, equal to what the stand-in's
engine counted; and a stream as Anthropic's own API sends it (message_delta with output tokens
only, cache reads) read as the prompt tokens the engine saw."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from support.standin import StandIn

from ralph_runner.loop.proxy import Proxy
from ralph_runner.loop.proxy_counting import Counting

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(tmp_path: Path):
    with StandIn(tmp_path / "vllm") as standin:
        standin.start()
        yield standin


def counters(server: StandIn) -> tuple[float, float]:
    prompt = generated = 0.0
    for line in server.get("/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == "vllm:prompt_tokens_total":
            prompt += float(line.rsplit(" ", 1)[1])
        elif name == "vllm:generation_tokens_total":
            generated += float(line.rsplit(" ", 1)[1])
    return prompt, generated


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_messages_receipts_equal_the_engines_counters(server: StandIn, stream: bool) -> None:
    body = {
        "model": server.model,
        "max_tokens": 9,
        "ignore_eos": True,  # vLLM's extra: exactly 9 tokens
        "system": "you are terse",
        "messages": [{"role": "user", "content": "tell me a long story " * 8}],
        "stream": stream,
    }
    before = counters(server)
    # the server's root: Claude Code's ANTHROPIC_BASE_URL, /v1/messages appended by the client
    with Proxy(server.url) as proxy:
        base = proxy.url.removesuffix("/v1")
        for path in ("/v1/messages", "/v1/messages?beta=true"):
            response = httpx.post(base + path, json=body, timeout=10)
            assert response.status_code == 200, response.text
        totals = proxy.settled(5)
    after = counters(server)
    assert totals.requests == 2 and totals.errors == 0 and totals.estimated == 0
    assert totals.prompt_tokens == after[0] - before[0] > 0
    assert totals.generated_tokens == after[1] - before[1] == 18
    assert totals.first_tokens == 2


def sse(kind: str, **data: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def test_anthropics_own_stream_counts_message_starts_input_and_cache_reads() -> None:
    usage = {"input_tokens": 12, "cache_read_input_tokens": 100, "output_tokens": 1}
    start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": usage}
    frames = [
        sse("message_start", message=start),
        sse("ping"),
        sse("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        sse("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hel"}),
        sse("content_block_delta", index=0, delta={"type": "text_delta", "text": "lo"}),
        sse("content_block_stop", index=0),
        sse("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 5}),
        sse("message_stop"),
    ]
    counting = Counting(started=0.0, stream=True)
    for frame in frames:  # split across chunks as a network would
        counting.feed(frame[:7])
        counting.feed(frame[7:])
    counting.finish()
    assert counting.usage == {"prompt": 112, "generated": 5}
    assert counting.pieces == 2 and counting.first_token is not None


def test_a_stream_cut_before_message_delta_keeps_message_starts_prompt() -> None:
    counting = Counting(started=0.0, stream=True)
    usage = {"input_tokens": 40, "output_tokens": 0}
    counting.feed(sse("message_start", message={"usage": usage}))
    delta = {"type": "input_json_delta", "partial_json": '{"command": "ls"}'}
    counting.feed(sse("content_block_delta", index=0, delta=delta))
    counting.finish()
    assert counting.usage == {"prompt": 40, "generated": 0}
    assert counting.pieces == 1
