"""Anthropic's Messages API as vLLM speaks it (`POST /v1/messages`): what Claude Code talks to.

vLLM (entrypoints/anthropic/serving.py) turns a Messages request into a chat completion and its
answer back: a whole `message` (dumped with `exclude_none`: no `stop_sequence: null`), or the
event stream `message_start` (usage: the prompt's tokens, 0 generated), for each content block
`content_block_start` / `content_block_delta` (`text_delta`, or `input_json_delta` for a
tool_use block's arguments) / `content_block_stop`, then `message_delta` (the stop reason and
the usage: input and output tokens) and `message_stop`; every frame `event: TYPE` + `data:`.
No `ping`. Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}`, the type
being vLLM's error class name (a real Anthropic endpoint says `rate_limit_error` and so on).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Literal, TypedDict

from ralph_runner.standin.engine import Piece
from ralph_runner.standin.wire import Format, calls_of, sse_event, text_of

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesUsage(TypedDict):
    input_tokens: int
    output_tokens: int


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, object]


class Message(TypedDict, total=False):
    """vLLM's AnthropicMessagesResponse; `stop_sequence` only where vLLM sets it (a stream)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[TextBlock | ToolUseBlock]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessagesUsage


class MessagesErrorDetail(TypedDict):
    type: str
    message: str


class MessagesError(TypedDict):
    type: Literal["error"]
    error: MessagesErrorDetail


def messages_error(message: str, kind: str) -> MessagesError:
    """vLLM's translate_error_response (and Anthropic's own error shape)."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def arguments_of(text: str) -> dict[str, object]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Messages(Format):
    """`/v1/messages`: a `message` body, or its event stream, content block by block."""

    api = "messages"

    def __init__(self, model: str, request: Mapping[str, object], prompt_tokens: int) -> None:
        super().__init__(model, request, prompt_tokens)
        self.id = f"msg_{uuid.uuid4().hex}"  # vLLM passes the chat completion's id on
        self.block: Literal["text", "tool_use"] | None = None  # the open content block
        self.blocks = 0  # content blocks opened so far (the open one's index: blocks - 1)

    def usage(self, generated: int) -> MessagesUsage:
        return {"input_tokens": self.prompt_tokens, "output_tokens": generated}

    def body(self, pieces: list[Piece], finish_reason: str) -> Message:
        content: list[TextBlock | ToolUseBlock] = []
        text, calls = text_of(pieces), calls_of(pieces)
        if text:
            content.append({"type": "text", "text": text})
        for call, arguments in calls:
            block: ToolUseBlock = {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": arguments_of(arguments),
            }
            content.append(block)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"),
            "usage": self.usage(len(pieces)),
        }

    def stream_open(self) -> list[bytes]:
        start: Message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage(0),
        }
        return [sse_event({"type": "message_start", "message": start})]

    def stream_pieces(self, pieces: list[Piece]) -> list[bytes]:
        self.generated += pieces
        frames: list[bytes] = []
        for piece in pieces:
            if piece.opens is not None:
                frames += self.close_block()
                block: ToolUseBlock = {
                    "type": "tool_use",
                    "id": piece.opens.id,
                    "name": piece.opens.name,
                    "input": {},
                }
                frames += self.open_block("tool_use", block)
            elif piece.call is not None:
                frames.append(self.delta({"type": "input_json_delta", "partial_json": piece.text}))
            else:
                if self.block != "text":
                    frames += self.close_block()
                    frames += self.open_block("text", {"type": "text", "text": ""})
                frames.append(self.delta({"type": "text_delta", "text": piece.text}))
        return frames

    def open_block(
        self, kind: Literal["text", "tool_use"], block: TextBlock | ToolUseBlock
    ) -> list[bytes]:
        self.block = kind
        self.blocks += 1
        event = {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}
        return [sse_event(event)]

    def delta(self, delta: dict[str, str]) -> bytes:
        return sse_event({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def close_block(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [sse_event({"type": "content_block_stop", "index": self.blocks - 1})]

    def stream_close(self, finish_reason: str) -> list[bytes]:
        stop = {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None}
        return [
            *self.close_block(),
            sse_event(
                {"type": "message_delta", "delta": stop, "usage": self.usage(len(self.generated))}
            ),
            sse_event({"type": "message_stop"}),
        ]

    def stream_error(self, message: str) -> list[bytes]:
        """vLLM's message stream converter: an `error` event, the stream ends."""
        return [
            sse_event({"type": "error", "error": {"type": "internal_error", "message": message}})
        ]
