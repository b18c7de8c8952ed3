"""What a failed request or connection means, in one place: an exception -> (reason, detail),
where the reason is "refused", "timeout" or "error". The probes' checks (`probes.run_probe`) and
the http action both say it this way."""

from __future__ import annotations

import httpx


def _request_of(exc: httpx.RequestError) -> str:
    try:
        request = exc.request
    except RuntimeError:  # raised by httpx when the error carries no request
        return ""
    return f" ({request.method} {request.url})"


def _refused(exc: BaseException) -> bool:
    """httpx wraps the socket error; look down the chain for the refusal itself."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def classify(exc: Exception, timeout: float | None = None) -> tuple[str, str]:
    """An exception from a check -> (reason, readable detail)."""
    after = f" after {timeout:g}s" if timeout is not None else ""
    if isinstance(exc, httpx.TimeoutException):
        phase = type(exc).__name__.removesuffix("Timeout").lower()  # connect, read, write, pool
        return "timeout", f"timed out{after} ({phase}){_request_of(exc)}"
    if isinstance(exc, TimeoutError):
        return "timeout", f"timed out{after}"
    if _refused(exc):
        where = _request_of(exc) if isinstance(exc, httpx.RequestError) else ""
        return "refused", f"connection refused{where}"
    if isinstance(exc, httpx.RequestError):
        return "error", f"{exc or type(exc).__name__}{_request_of(exc)}"
    return "error", f"{type(exc).__name__}: {exc}"
