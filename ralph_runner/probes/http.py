"""`http: {url, status, ...}`: the seed's `curl --max-time 3 $BASE/models`, on a kept-alive client.

Healthy when the status matches and, if asked, the body holds a text or the JSON holds values
(`json: {"data.0.id": my-model}`: dotted paths, list indexes as numbers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ralph_runner.plugins.fields import Templated
from ralph_runner.probes import ProbeContext, Verdict, excerpt, request

KIND = "http"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    url: str  # the URL checked
    status: Templated[int] | list[int] = 200  # the status (or any of the statuses) that is healthy
    method: str = "GET"  # the HTTP method
    body_contains: str | None = None  # a text the body must hold
    json_values: dict[str, object] | None = Field(  # `json` shadows a BaseModel attribute
        None,
        alias="json",
        description="values the JSON body must hold, by dotted path: "
        "{data.0.id: my-model} (list indexes as numbers)",
    )
    headers: dict[str, str] = {}  # request headers, e.g. Authorization

    @field_validator("method")
    @classmethod
    def _upper(cls, method: str) -> str:
        return method.upper()


def statuses(status: Templated[int] | list[int]) -> Sequence[int | str]:
    """The accepted statuses; a template left unrendered (a str) matches no status code."""
    return status if isinstance(status, list) else [status]


_MISSING = object()


def lookup(data: Any, path: str) -> Any:
    """`a.0.b` in parsed JSON; _MISSING when any step is absent."""
    for part in path.split("."):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return _MISSING
    return data


def same(actual: Any, expected: Any) -> bool:
    """Equal, or equal as text: a rendered template gives "8000" where the JSON holds 8000."""
    if actual == expected:
        return True
    return (
        isinstance(expected, str) and not isinstance(actual, str) and json.dumps(actual) == expected
    )


def json_mismatch(text: str, expected: dict[str, object]) -> str | None:
    """Why the body does not hold the expected values; None when it does."""
    try:
        data = json.loads(text)
    except ValueError:
        return f"body is not JSON: {excerpt(text)}"
    for path, want in expected.items():
        found = lookup(data, path)
        if found is _MISSING:
            return f"json {path} missing: {excerpt(text)}"
        if not same(found, want):
            return f"json {path} is {found!r}, expected {want!r}"
    return None


def check(params: Params, ctx: ProbeContext) -> Verdict:
    response = request(ctx, params.method, params.url, headers=params.headers)
    text = response.text
    if response.status_code not in statuses(params.status):
        return Verdict(False, "status", f"HTTP {response.status_code}: {excerpt(text)}")
    if params.body_contains is not None and params.body_contains not in text:
        return Verdict(False, "body", f"body lacks {params.body_contains!r}: {excerpt(text)}")
    if params.json_values:
        mismatch = json_mismatch(text, params.json_values)
        if mismatch:
            return Verdict(False, "body", mismatch)
    return Verdict(True, None, f"HTTP {response.status_code}")
