"""What a generation request asks, read as vLLM reads it: its prompt's size and its token limits.

A request's body is whatever the client sent: each key is read with its type checked, and a key
of another type counts as absent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ralph_runner.standin.engine import KV_CACHE_TOKENS

COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions; chat has none


def text_of(content: object) -> str:
    """The text of an OpenAI content: a string or a list of parts with `text` (or `output`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            text_of(p.get("text", p.get("output", ""))) for p in content if isinstance(p, dict)
        )
    return ""


def blocks_text(content: object) -> str:
    """The text of a Messages API content: a string, or blocks (text, a tool_use's input, a
    tool_result's content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for block in content:
        if isinstance(block, dict):
            if block.get("type") == "tool_use":
                parts.append(json.dumps(block.get("input")))
            else:
                parts.append(blocks_text(block.get("text", block.get("content", ""))))
    return "".join(parts)


def prompt_chars_of(route: str, request: Mapping[str, object]) -> int:
    """Prompt size of a generation request: the characters of what the model reads."""
    if route == "/v1/chat/completions":
        messages = request.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(len(text_of(m.get("content"))) for m in messages if isinstance(m, dict))
    if route == "/v1/completions":
        return len(text_of(request.get("prompt", "")))
    if route == "/v1/messages":  # system, then text, tool_use input and tool_result blocks
        turns = request.get("messages")
        turns = turns if isinstance(turns, list) else []
        system = len(blocks_text(request.get("system")))
        return system + sum(
            len(blocks_text(m.get("content"))) for m in turns if isinstance(m, dict)
        )
    items = request.get("input", "")
    if isinstance(items, list):  # responses: messages, function calls and their outputs
        parts = [i.get("content", i.get("output", i.get("arguments", ""))) for i in items]
        items = [{"text": text_of(p)} for p in parts if isinstance(p, str | list)]
    return len(text_of(request.get("instructions") or "")) + len(text_of(items))


def max_tokens_of(route: str, request: Mapping[str, object], prompt_tokens: int) -> int:
    keys = {
        "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
        "/v1/completions": ("max_tokens",),
        "/v1/responses": ("max_output_tokens",),
        "/v1/messages": ("max_tokens",),
    }[route]
    for key in keys:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if route == "/v1/completions":
        return COMPLETIONS_MAX_TOKENS
    return max(1, KV_CACHE_TOKENS - prompt_tokens)


def min_tokens_of(request: Mapping[str, object], max_tokens: int) -> int:
    """vLLM's sampling extras: `ignore_eos` generates max_tokens, `min_tokens` at least that."""
    if request.get("ignore_eos") is True:
        return max_tokens
    value = request.get("min_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
