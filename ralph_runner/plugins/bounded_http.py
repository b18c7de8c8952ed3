"""One HTTP request whose whole answer must come within a deadline and a size.

httpx's timeouts are per phase and per read: a server that sends a byte every half second is
never "timed out", and one whose body never ends is read until memory runs out (an endless
/metrics took a probe to 951 MiB in 2.9 s). Every read ralph-run makes from a server (probes,
the flight recorder, http tasks) goes through `fetch`: the body is read as it streams, and the
request fails as a timeout once `timeout` s have passed since it was sent, or with BodyTooLarge
once the decoded body passes `cap` bytes.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

MAX_BODY = 16 * 1024 * 1024  # bytes: vLLM's /metrics is well under 1 MiB


class BodyTooLarge(httpx.RequestError):
    """The answer's body passed the cap: it is not what was asked for."""


def fetch(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    timeout: float,
    cap: int = MAX_BODY,
    **options: Any,
) -> httpx.Response:
    """`client.request`, with its whole answer read within `timeout` s and `cap` bytes; the
    response returned is read (`.content`, `.text`, `.json()` as usual)."""
    deadline = time.monotonic() + timeout
    request = client.build_request(method, url, timeout=timeout, **options)
    response = client.send(request, stream=True)
    try:
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > cap:
                raise BodyTooLarge(f"its answer passed {cap // 1024} KiB: cut", request=request)
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"its answer took over {timeout:g} s", request=request)
    finally:
        response.close()
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        content=bytes(body),
        request=request,
        extensions=response.extensions,
    )
