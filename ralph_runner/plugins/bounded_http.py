"""One HTTP request whose whole answer must come within a deadline and a size.

httpx's timeouts are per phase and per read: a server that sends a byte every half second is
never "timed out", and one whose body never ends is read until memory runs out (an endless
/metrics took a probe to 951 MiB in 2.9 s). Every read ralph-run makes from a server (probes,
the flight recorder, http tasks) goes through `fetch`: the body is read as it streams, and the
request fails as a timeout once `timeout` s have passed since it was sent, its headers' time
included (a server that sent a header line a second held a read for good), or with BodyTooLarge
once the decoded body passes `cap` bytes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
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
    response = _headers_within(client, request, timeout)
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


@dataclass
class _Send:
    """One send on its own thread: the connection's socket once made, then its outcome."""

    socket: socket.socket | None = None
    response: httpx.Response | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: threading.Event = field(default_factory=threading.Event)


def _headers_within(client: httpx.Client, request: httpx.Request, timeout: float) -> httpx.Response:
    """`client.send(request, stream=True)`, given up as a timeout after `timeout` s: httpx's
    read timeout is per read, so a server that sends a header line a second held it for good.
    The send runs in a thread of its own; one given up is cut (its new connection's socket
    shut down) and closes its response when it comes."""
    sending = _Send()

    def trace(event: str, info: dict[str, Any]) -> None:
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            found = info["return_value"].get_extra_info("socket")
            sending.socket = found if isinstance(found, socket.socket) else None

    def send() -> None:
        try:
            sending.response = client.send(request, stream=True)
        except BaseException as err:  # the caller's to raise
            sending.error = err
        sending.done.set()
        if sending.abandoned.is_set() and sending.response is not None:
            sending.response.close()

    request.extensions = {**request.extensions, "trace": trace}
    threading.Thread(target=send, name="http-headers", daemon=True).start()
    if not sending.done.wait(timeout):
        sending.abandoned.set()
        if sending.socket is not None:
            with contextlib.suppress(OSError):
                sending.socket.shutdown(socket.SHUT_RDWR)  # wakes the blocked read
        if sending.done.is_set() and sending.response is not None:
            sending.response.close()
        raise httpx.ReadTimeout(f"its answer's headers took over {timeout:g} s", request=request)
    if sending.error is not None:
        raise sending.error
    assert sending.response is not None  # done, without an error
    return sending.response
