"""OpenAI wire formats as vLLM speaks them: chat, completions and responses, whole or streamed.

Each format turns the engine's generated pieces (engine.Piece) into what the client reads:
a JSON body, or server-sent events. Chat and completions stream `data: {json}` frames and end
with `data: [DONE]` (vLLM's serving_chat.py / serving_completion.py); responses streams
`event: TYPE` + `data: {json}` frames with a `sequence_number`, from `response.created` to
`response.completed` (vLLM's serving_responses.py, the shapes of openai-python's types). Field
sets follow vLLM's (`exclude_unset` where vLLM uses it), so a strict client parses them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Unpack

from ralph_runner.standin.engine import Piece
from ralph_runner.standin.payloads import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    ChunkChoice,
    ChunkExtras,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionEnvelope,
    Delta,
    ErrorBody,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    Response,
    ResponseUsage,
    ToolCallDelta,
    ToolCalls,
    Usage,
)
from ralph_runner.standin.scripted import ToolCall
from ralph_runner.standin.vllm_log import VERSION

DONE = b"data: [DONE]\n\n"
FINGERPRINT = f"vllm-{VERSION}-standin"


def sse(payload: Mapping[str, object]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def sse_event(payload: Mapping[str, object]) -> bytes:
    return (
        f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
    )


def error_body(message: str, kind: str, code: int) -> ErrorBody:
    """vLLM's ErrorResponse: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def text_of(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces if p.call is None)


def calls_of(pieces: list[Piece]) -> list[tuple[ToolCall, str]]:
    """Each tool call opened in `pieces` with the arguments generated for it so far."""
    calls: dict[int, tuple[ToolCall, list[str]]] = {}
    for piece in pieces:
        if piece.opens is not None:
            assert piece.call is not None  # an opening piece carries its call's index
            calls[piece.call] = (piece.opens, [])
        elif piece.call is not None:
            calls[piece.call][1].append(piece.text)
    return [(call, "".join(parts)) for call, parts in calls.values()]


def usage_of(prompt_tokens: int, completion_tokens: int, details: bool = False) -> Usage:
    """vLLM's UsageInfo; a whole body also carries its (empty) details."""
    usage: Usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        usage["prompt_tokens_details"] = usage["completion_tokens_details"] = None
    return usage


class Format:
    """One request's answer in one wire format; `stream_*` return the SSE frames to send."""

    api = ""
    prefix = ""

    def __init__(self, model: str, request: Mapping[str, object], prompt_tokens: int) -> None:
        self.model = model
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.generated: list[Piece] = []

    @property
    def include_usage(self) -> bool:
        options = self.request.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    def body(self, pieces: list[Piece], finish_reason: str) -> Mapping[str, object]:
        raise NotImplementedError

    def stream_open(self) -> list[bytes]:
        return []

    def stream_pieces(self, pieces: list[Piece]) -> list[bytes]:
        raise NotImplementedError

    def stream_close(self, finish_reason: str) -> list[bytes]:
        raise NotImplementedError

    def stream_error(self, message: str) -> list[bytes]:
        """What vLLM's stream generators send when the engine fails mid-stream: the error as
        a data frame (it has answered 200 already), then `[DONE]`."""
        return [sse(error_body(message, "InternalServerError", 500)), DONE]


class Chat(Format):
    """`/v1/chat/completions`: `chat.completion`, or `chat.completion.chunk` frames."""

    api = "chat"
    prefix = "chatcmpl"

    def chunk(self, choice: ChunkChoice | None, **extra: Unpack[ChunkExtras]) -> bytes:
        """One chunk; vLLM adds `token_ids` to every choice after the first chunk's."""
        if choice is not None and "role" not in choice["delta"]:
            choice = {**choice, "token_ids": None}
        chunk: ChatCompletionChunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
            **extra,
        }
        return sse(chunk)

    def body(self, pieces: list[Piece], finish_reason: str) -> ChatCompletion:
        text, calls = text_of(pieces), calls_of(pieces)
        tool_calls: ToolCalls = {}  # vLLM leaves an empty list out
        if calls:
            tool_calls["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": a}}
                for call, a in calls
            ]
        message: ChatMessage = {
            "role": "assistant",
            "content": text if text or not calls else None,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            **tool_calls,
            "reasoning": None,
        }
        choice: ChatChoice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": usage_of(self.prompt_tokens, len(pieces), details=True),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def stream_open(self) -> list[bytes]:
        delta: Delta = {"role": "assistant", "content": ""}
        choice: ChunkChoice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return [self.chunk(choice, prompt_token_ids=None, prompt_text=None)]

    def stream_pieces(self, pieces: list[Piece]) -> list[bytes]:
        """Consecutive text pieces make one content delta; a tool call's first delta carries
        its index, id, type and name, the next ones pieces of its arguments (vLLM's tool
        parsers stream them so)."""
        self.generated += pieces
        frames = []
        for delta in deltas_of(pieces):
            choice: ChunkChoice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": None,
            }
            frames.append(self.chunk(choice))
        return frames

    def stream_close(self, finish_reason: str) -> list[bytes]:
        delta: Delta = {} if finish_reason == "tool_calls" else {"content": ""}
        choice: ChunkChoice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        if not self.include_usage:  # the fingerprint rides on the last chunk
            return [self.chunk(choice, system_fingerprint=FINGERPRINT), DONE]
        usage = usage_of(self.prompt_tokens, len(self.generated))
        return [
            self.chunk(choice),
            self.chunk(None, usage=usage, system_fingerprint=FINGERPRINT),
            DONE,
        ]


def deltas_of(pieces: list[Piece]) -> list[Delta]:
    deltas: list[Delta] = []
    for piece in pieces:
        if piece.opens is not None:
            assert piece.call is not None  # an opening piece carries its call's index
            call = piece.opens
            opening: ToolCallDelta = {
                "index": piece.call,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name},
            }
            deltas.append({"tool_calls": [opening]})
        elif piece.call is not None:
            calls = deltas[-1].get("tool_calls") if deltas else None
            last = calls[0] if calls else None
            if last is not None and last["index"] == piece.call and "arguments" in last["function"]:
                last["function"]["arguments"] += piece.text
            else:
                arguments: ToolCallDelta = {
                    "index": piece.call,
                    "function": {"arguments": piece.text},
                }
                deltas.append({"tool_calls": [arguments]})
        elif deltas and "content" in deltas[-1]:
            deltas[-1]["content"] += piece.text
        else:
            deltas.append({"content": piece.text})
    return deltas


class Completions(Format):
    """`/v1/completions`: `text_completion` bodies and frames."""

    api = "completions"
    prefix = "cmpl"

    def frame(self, text: str, finish_reason: str | None) -> bytes:
        choice: CompletionChoice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return sse(self.envelope([choice]))

    def envelope(self, choices: list[CompletionChoice]) -> CompletionEnvelope:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def body(self, pieces: list[Piece], finish_reason: str) -> Completion:
        choice: CompletionChoice = {
            "index": 0,
            "text": text_of(pieces),
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        body = self.envelope([choice])
        return {
            **body,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage_of(self.prompt_tokens, len(pieces)),
            "kv_transfer_params": None,
        }

    def stream_pieces(self, pieces: list[Piece]) -> list[bytes]:
        self.generated += pieces
        text = text_of(pieces)
        return [self.frame(text, None)] if text else []

    def stream_close(self, finish_reason: str) -> list[bytes]:
        frames = [self.frame("", finish_reason)]
        if self.include_usage:
            usage = usage_of(self.prompt_tokens, len(self.generated))
            usage_chunk: CompletionChunk = {**self.envelope([]), "usage": usage}
            frames.append(sse(usage_chunk))
        return [*frames, DONE]


class Responses(Format):
    """`/v1/responses`, the Responses API that codex speaks: a `response` object whose
    `output` holds a message item and function_call items, or the event stream building it."""

    api = "responses"

    def __init__(self, model: str, request: Mapping[str, object], prompt_tokens: int) -> None:
        super().__init__(model, request, prompt_tokens)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.sequence_number = 0
        self.items: list[OutputItem] = []  # output items, in order, as they are built
        self.open_item: OutputItem | None = None
        self.open_text = ""  # the text of the open message item so far

    def response(self, status: str, output: list[OutputItem], tokens: int) -> Response:
        """vLLM 0.32's ResponsesResponse, field for field."""
        request = self.request
        tools = request.get("tools") or []
        usage: ResponseUsage | None = None
        if status != "in_progress":
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": 0,
                    "cache_write_tokens": 0,
                    "input_tokens_per_turn": [],
                    "cached_tokens_per_turn": [],
                },
                "output_tokens": tokens,
                "output_tokens_details": {
                    "reasoning_tokens": 0,
                    "tool_output_tokens": 0,
                    "output_tokens_per_turn": [],
                    "tool_output_tokens_per_turn": [],
                },
                "total_tokens": self.prompt_tokens + tokens,
            }
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": request.get("instructions"),
            "metadata": request.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "temperature": request.get("temperature", 1.0),
            "tool_choice": request.get("tool_choice", "auto" if tools else "none"),
            "tools": tools,
            "top_p": request.get("top_p", 1.0),
            "background": False,
            "max_output_tokens": request.get("max_output_tokens"),
            "max_tool_calls": None,
            "previous_response_id": request.get("previous_response_id"),
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": status,
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    @staticmethod
    def status_of(finish_reason: str) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def body(self, pieces: list[Piece], finish_reason: str) -> Response:
        output: list[OutputItem] = []
        text = text_of(pieces)
        if text or not calls_of(pieces):
            output.append(message_item(f"msg_{uuid.uuid4().hex}", text, "completed"))
        for call, arguments in calls_of(pieces):
            output.append(function_call_item(call, arguments, "completed"))
        return self.response(self.status_of(finish_reason), output, len(pieces))

    def event(self, kind: str, **fields: object) -> bytes:
        """One event of the stream: its type, its fields, its sequence number."""
        payload = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return sse_event(payload)

    def stream_open(self) -> list[bytes]:
        opening = self.response("in_progress", [], 0)
        return [
            self.event("response.created", response=opening),
            self.event("response.in_progress", response=opening),
        ]

    def stream_pieces(self, pieces: list[Piece]) -> list[bytes]:
        self.generated += pieces
        frames: list[bytes] = []
        for piece in pieces:
            if piece.opens is not None:
                frames += self.close_item()
                frames += self.open_function_call(piece.opens)
            elif piece.call is not None:
                frames += self.function_call_delta(piece.text)
            else:
                if self.open_item is None:
                    frames += self.open_message()
                frames += self.text_delta(piece.text)
        return frames

    def open_message(self) -> list[bytes]:
        item = message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
        item["content"] = []
        self.open_item, self.open_text = item, ""
        part: OutputText = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self.items)
        return [
            self.event("response.output_item.added", output_index=index, item=dict(item)),
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def text_delta(self, text: str) -> list[bytes]:
        item = self.open_item
        assert item is not None  # stream_pieces opens a message first
        self.open_text += text
        return [
            self.event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=len(self.items),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        ]

    def open_function_call(self, call: ToolCall) -> list[bytes]:
        item = function_call_item(call, "", "in_progress")
        self.open_item = item
        index = len(self.items)
        return [self.event("response.output_item.added", output_index=index, item=dict(item))]

    def function_call_delta(self, text: str) -> list[bytes]:
        item = self.open_item
        assert item is not None and item["type"] == "function_call"  # its opening piece came first
        item["arguments"] += text
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self.items),
                delta=text,
            )
        ]

    def close_item(self) -> list[bytes]:
        """The `.done` events of the item being built, which then joins `output`."""
        item, index = self.open_item, len(self.items)
        if item is None:
            return []
        self.open_item = None
        done: OutputItem
        if item["type"] == "function_call":
            done = {**item, "status": "completed"}
            frames = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            ]
        else:
            text = self.open_text
            done = message_item(item["id"], text, "completed")
            part = done["content"][0]
            frames = [
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        self.items.append(done)
        frames.append(self.event("response.output_item.done", output_index=index, item=done))
        return frames

    def stream_close(self, finish_reason: str) -> list[bytes]:
        frames = self.close_item()
        if not self.items:  # an empty answer is an empty message, as a whole body has
            frames = self.open_message() + self.close_item()
        status = self.status_of(finish_reason)
        final = self.response(status, self.items, len(self.generated))
        # vLLM ends every stream so, an incomplete one (max_output_tokens reached) included
        return [*frames, self.event("response.completed", response=final)]

    def stream_error(self, message: str) -> list[bytes]:
        """vLLM's responses stream reports a failure as an `error` event; no [DONE] here."""
        return [self.event("error", code="InternalServerError", message=message, param=None)]


def message_item(item_id: str, text: str, status: str) -> MessageItem:
    """A message output item; a finished one's text part has `logprobs: null`, as vLLM's."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
        "phase": None,
    }


def function_call_item(call: ToolCall, arguments: str, status: str) -> FunctionCallItem:
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


FORMATS: dict[str, type[Format]] = {
    "/v1/chat/completions": Chat,
    "/v1/completions": Completions,
    "/v1/responses": Responses,
}
