"""The stand-in's Anthropic Messages API (`POST /v1/messages`), as vLLM 0.32 serves it: the event
stream and the whole body, usage that matches the engine's counters, tool_use blocks from the
scripted model, errors in Anthropic's shape and the `rate_limit` fault's 429."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.standin import StandIn

from ralph_runner.standin.engine import tokens_of

pytestmark = pytest.mark.timeout(60)
PROMPT = "write me a poem about the sea " * 4


@pytest.fixture
def server(tmp_path: Path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"items": [{"match": "hello", "files": {"hello.txt": "hi\n"}}]}))
    with StandIn(tmp_path / "vllm") as standin:
        standin.start(SCRIPT=str(script))
        yield standin


def events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE frame."""
    found = []
    for frame in body.decode().split("\n\n"):
        if not frame.strip():
            continue
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]  # the event's name is its type
        found.append((name[7:], payload))
    return found


def counters(server: StandIn) -> tuple[float, float]:
    text = server.get("/metrics").text
    prompt = generated = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == "vllm:prompt_tokens_total":
            prompt += float(line.rsplit(" ", 1)[1])
        elif name == "vllm:generation_tokens_total":
            generated += float(line.rsplit(" ", 1)[1])
    return prompt, generated


def ask(server: StandIn, **body: Any) -> httpx.Response:
    request = {"model": server.model, "max_tokens": 64, **body}
    return httpx.post(f"{server.root_url}/v1/messages?beta=true", json=request, timeout=10)


def test_a_stream_is_vllms_event_sequence_with_its_usage(server: StandIn) -> None:
    before = counters(server)
    response = ask(
        server, messages=[{"role": "user", "content": PROMPT}], max_tokens=7, stream=True
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    stream = events(response.content)
    names = [name for name, _ in stream]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = stream[0][1]["message"]
    assert (start["type"], start["role"], start["content"]) == ("message", "assistant", [])
    assert start["usage"] == {"input_tokens": tokens_of(len(PROMPT)), "output_tokens": 0}
    deltas = [data["delta"] for name, data in stream if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" and d["text"] for d in deltas)
    delta = stream[-2][1]
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]
    after = counters(server)
    # the usage is what the engine counted
    assert after[0] - before[0] == delta["usage"]["input_tokens"]
    assert after[1] - before[1] == delta["usage"]["output_tokens"] > 0


def test_a_whole_answer_is_a_message_without_null_fields(server: StandIn) -> None:
    response = ask(server, system="be brief", messages=[{"role": "user", "content": "hi"}])
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"id", "type", "role", "content", "model", "stop_reason", "usage"}
    assert body["content"] == [{"type": "text", "text": "OK"}]
    assert body["stop_reason"] == "end_turn" and body["id"].startswith("msg_")
    assert body["usage"] == {"input_tokens": tokens_of(len("be brief") + 2), "output_tokens": 1}


CLAUDE_TOOLS = [{"name": name, "input_schema": {"type": "object"}} for name in ("Bash", "Read")]


def test_the_scripted_model_calls_claudes_bash_tool_in_tool_use_blocks(server: StandIn) -> None:
    """A Claude Code-shaped request (system with its env, its tools): a tool_use block whose
    input arrives as input_json_delta pieces, stop_reason tool_use; the same whole."""
    request = {
        "system": [{"type": "text", "text": "You are Claude Code.\nWorking directory: /w\n"}],
        "tools": CLAUDE_TOOLS,
        "messages": [{"role": "user", "content": "Do it, commit: create hello.txt"}],
        "max_tokens": 4096,  # the whole command: a cut one is no JSON
    }
    stream = events(ask(server, **request, stream=True).content)
    (start,) = [data for name, data in stream if name == "content_block_start"]
    block = start["content_block"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "Bash", {})
    pieces = [d["delta"]["partial_json"] for n, d in stream if n == "content_block_delta"]
    arguments = json.loads("".join(pieces))
    assert "hello.txt" in arguments["command"] and "CHECKLIST.md" in arguments["command"]
    assert stream[-2][1]["delta"]["stop_reason"] == "tool_use"
    whole = ask(server, **request).json()
    (use,) = whole["content"]
    assert use["type"] == "tool_use" and use["input"] == arguments
    assert whole["stop_reason"] == "tool_use"


def test_errors_are_in_anthropics_shape(server: StandIn) -> None:
    response = ask(server, model="claude-sonnet-4", messages=[{"role": "user", "content": "x"}])
    assert response.status_code == 404
    assert response.json() == {
        "type": "error",
        "error": {
            "type": "NotFoundError",
            "message": "The model `claude-sonnet-4` does not exist.",
        },
    }


def test_the_rate_limit_fault_is_a_429_with_retry_after_then_answers(server: StandIn) -> None:
    server.admin("rate_limit", 30)
    response = ask(server, messages=[{"role": "user", "content": "x"}])
    assert response.status_code == 429
    assert 29 <= int(response.headers["retry-after"]) <= 30
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
    assert f"retry after {response.headers['retry-after']} s" in error["error"]["message"]
    chat = server.chat("x")  # the OpenAI routes: vLLM's error shape, code 429
    assert chat.status_code == 429 and chat.json()["error"]["code"] == 429
    assert chat.json()["error"]["type"] == "rate_limit_error"
    server.admin("rate_limit", False)
    assert ask(server, messages=[{"role": "user", "content": "x"}]).status_code == 200
