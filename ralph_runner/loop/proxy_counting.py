"""What the agent proxy (loop/proxy.py) counts of each response, and its running totals.

A response is counted as it passes, chunk by chunk, never held: a JSON body's `usage`, or a
server-sent event stream's events (the last `usage` seen; else its content pieces, a lower bound
of the generated tokens, `estimated`), and the times to its first byte, its first token and its
end. The formats: OpenAI's chat/completions and completions, its responses API, and Anthropic's
Messages API (as vLLM and llama-server serve them).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ralph_runner.deaths.history import ProxyReceipt

MAX_EVENT = 1024 * 1024  # bytes of one SSE event kept for counting; a longer one is not parsed


@dataclass
class Totals:
    """What went through the proxy since it started; differences of two give an iteration."""

    requests: int = 0
    errors: int = 0  # requests the upstream did not answer (refused, cut) or answered >= 400
    prompt_tokens: int = 0
    generated_tokens: int = 0
    estimated: int = 0  # requests whose generated tokens are content pieces (no usage given)
    first_token_seconds: float = 0.0  # summed over the requests that had a first token
    first_tokens: int = 0  # ... how many
    generation_seconds: float = 0.0  # first token to the end, summed
    request_seconds: float = 0.0  # request to the end of the response, summed

    def add(self, counting: Counting | None, started: float, ended: float, failed: bool) -> None:
        """One request's end, counted."""
        self.requests += 1
        self.errors += failed
        self.request_seconds += ended - started
        if counting is None:
            return
        if counting.usage is not None:
            self.prompt_tokens += counting.usage["prompt"]
            self.generated_tokens += counting.usage["generated"]
        elif counting.pieces:
            self.generated_tokens += counting.pieces
            self.estimated += 1
        if counting.first_token is not None:
            self.first_tokens += 1
            self.first_token_seconds += counting.first_token - started
            self.generation_seconds += ended - counting.first_token

    def minus(self, earlier: Totals) -> Totals:
        mine, theirs = asdict(self), asdict(earlier)
        return Totals(**{key: mine[key] - theirs[key] for key in mine})

    def receipt(self) -> ProxyReceipt:
        """The fields an iteration's history line gets."""
        first = self.first_token_seconds / self.first_tokens if self.first_tokens else None
        return {
            "requests": self.requests,
            "request_errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "tokens_estimated": self.estimated > 0,
            "first_token_seconds": None if first is None else round(first, 3),
            "generation_seconds": round(self.generation_seconds, 3),
            "request_seconds": round(self.request_seconds, 3),
        }


class Counting:
    """Reads one response's body as it passes: its usage, its content pieces, its timing."""

    def __init__(self, started: float, stream: bool) -> None:
        self.started, self.stream = started, stream
        self.first_byte: float | None = None
        self.first_token: float | None = None
        self.usage: dict[str, Any] | None = None
        self.pieces = 0
        self._buffer = b""
        self._body: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        now = time.monotonic()
        if self.first_byte is None:
            self.first_byte = now
        if not self.stream:
            if self._size <= 16 * MAX_EVENT:
                self._body.append(chunk)
                self._size += len(chunk)
            return
        self._buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            self._event(event, now)
        if len(self._buffer) > MAX_EVENT:
            self._buffer = b""

    def finish(self) -> None:
        if self.stream:
            if self._buffer.strip():
                self._event(self._buffer, time.monotonic())
            return
        try:
            body = json.loads(b"".join(self._body))
        except ValueError:
            return
        if isinstance(body, dict):
            self.usage = _usage(body) or self.usage
            if self.first_byte is not None and self.usage:
                self.first_token = self.first_byte  # a whole answer: its first byte

    def _event(self, event: bytes, now: float) -> None:
        data = b"\n".join(
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data or data == b"[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        usage = _usage(chunk)
        if usage is None and isinstance(chunk.get("response"), dict):
            usage = _usage(chunk["response"])  # responses: response.completed
        if usage is None and isinstance(chunk.get("message"), dict):
            usage = _usage(chunk["message"])  # messages: message_start
        if usage is not None:
            said = chunk.get("usage")
            if isinstance(said, dict) and "input_tokens" not in said and self.usage is not None:
                usage["prompt"] = self.usage["prompt"]  # Anthropic's message_delta: output only
            self.usage = usage
        pieces = _pieces(chunk)
        if pieces:
            self.pieces += pieces
            if self.first_token is None:
                self.first_token = now


def _usage(body: dict[str, Any]) -> dict[str, Any] | None:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    generated = usage.get("completion_tokens", usage.get("output_tokens"))
    if not isinstance(prompt, int) and not isinstance(generated, int):
        return None
    prompt = prompt if isinstance(prompt, int) else 0
    if "input_tokens" in usage:  # the Messages API leaves cached prompt tokens out of it
        for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            prompt += usage[cached] if isinstance(usage.get(cached), int) else 0
    return {"prompt": prompt, "generated": generated or 0}


def _pieces(chunk: dict[str, Any]) -> int:
    """Content pieces in one stream chunk: each one token at least."""
    if chunk.get("type") == "response.output_text.delta":
        return 1 if chunk.get("delta") else 0
    if chunk.get("type") == "content_block_delta":  # messages: text, tool input, thinking
        delta = chunk.get("delta")
        pieces = ("text", "partial_json", "thinking")
        return 1 if isinstance(delta, dict) and any(delta.get(key) for key in pieces) else 0
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return 0
    count = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(delta, dict) and not text:
            text = delta.get("reasoning_content") or delta.get("tool_calls")
        count += 1 if text else 0
    return count


def before_first_token(counting: Counting | None) -> bool:
    """A stream whose first token has not come yet (its first bytes may be a role, a comment)."""
    return counting is not None and counting.stream and counting.first_token is None
