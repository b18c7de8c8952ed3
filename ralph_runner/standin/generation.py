"""What a generation request asks, read as vLLM reads it: its prompt's size and its token limits.

A request's body is whatever the client sent: each key is read with its type checked, and a key
of another type counts as absent.
"""

from __future__ import annotations

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


def prompt_chars_of(route: str, request: Mapping[str, object]) -> int:
    """Prompt size of a generation request: the characters of what the model reads."""
    if route == "/v1/chat/completions":
        messages = request.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(len(text_of(m.get("content"))) for m in messages if isinstance(m, dict))
    if route == "/v1/completions":
        return len(text_of(request.get("prompt", "")))
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
