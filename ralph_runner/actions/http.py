"""`http: {url, method, status, body, headers, lines}`: an HTTP request, like Ansible's `uri`.

Registers `status` (-1 when nothing answered, as `uri` does), `json` (the parsed body, or None)
and `content` (the body's last `max_output` bytes). `lines: REGEX` keeps only the body's lines
that match, e.g. the KV-cache gauges of vLLM's /metrics, which is otherwise mostly histograms.
The task's `timeout` bounds each phase of the request (connect, then read), 30 s when it has none.
"""

from __future__ import annotations

import functools
import re
import time
from typing import TypedDict

import httpx
from pydantic import BaseModel, ConfigDict, field_validator

from ralph_runner.actions import TaskContext, TaskResult
from ralph_runner.plugins.bounded_http import fetch
from ralph_runner.plugins.fields import Regex, Templated
from ralph_runner.plugins.network_errors import classify

KEY = "http"
DEFAULT_TIMEOUT = 30.0


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str  # where the request goes
    method: str = "GET"  # the HTTP method
    status: Templated[int] | list[int] = 200  # the status (or any of the statuses) that is success
    body: str | dict[str, object] | list[object] | None = None  # a dict or list is sent as JSON
    headers: dict[str, str] = {}  # request headers, e.g. Authorization
    lines: Regex | None = None  # keep only the lines of the body that match

    @field_validator("method")
    @classmethod
    def _upper(cls, method: str) -> str:
        return method.upper()


@functools.cache
def client() -> httpx.Client:
    """One kept-alive client for every http task of the run."""
    return httpx.Client()


def describe(params: Params, ctx: TaskContext) -> str:
    request = ctx.render_params(params)
    return f"{request.method} {request.url}"


def last_bytes(text: str, limit: int) -> tuple[str, int]:
    """The end of a body, as the output cap keeps it, and how many bytes were cut."""
    data = text.encode()
    cut = max(0, len(data) - limit)
    return data[cut:].decode(errors="ignore"), cut


class Payload(TypedDict, total=False):
    """The request's body, as httpx's keywords: text as it is, or data sent as JSON."""

    content: str
    json: dict[str, object] | list[object]


def payload(body: str | dict[str, object] | list[object] | None) -> Payload:
    if body is None:
        return {}
    return {"content": body} if isinstance(body, str) else {"json": body}


def run(params: Params, ctx: TaskContext) -> TaskResult:
    request = ctx.render_params(params)
    timeout = ctx.timeout or DEFAULT_TIMEOUT
    started = time.monotonic()
    try:
        response = fetch(
            client(),
            request.method,
            request.url,
            headers=request.headers,
            timeout=timeout,
            **payload(request.body),
        )
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        reason, detail = classify(exc, timeout)
        return TaskResult(
            ok=False,
            output=detail,
            timed_out=reason == "timeout",
            seconds=time.monotonic() - started,
            data={"status": -1, "json": None, "content": ""},
        )
    try:
        parsed = response.json()
    except ValueError:
        parsed = None
    text = response.text
    if request.lines is not None:
        pattern = re.compile(request.lines)
        text = "".join(line for line in text.splitlines(True) if pattern.search(line))
    content, cut = last_bytes(text, ctx.max_output)
    wanted = request.status if isinstance(request.status, list) else [request.status]
    return TaskResult(
        ok=response.status_code in wanted,
        output=content,
        cut_bytes=cut,
        seconds=time.monotonic() - started,
        data={"status": response.status_code, "json": parsed, "content": content},
    )
