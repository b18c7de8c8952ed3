"""Probe kinds: one module each, behind one interface, so a health check says *how* it failed.

A module in this package is a probe kind when it defines:

    KIND: str                      # the key in a runbook's probe, e.g. "http"
    Params: type                   # what the key's value must be (pydantic validates it)
    def check(params, ctx: ProbeContext) -> Verdict   # ok, reason, detail (, finding)

`check` may raise: `run_probe` times every check and turns an exception into a failed result
(`plugins/network_errors.py`), so one place decides what "refused" and "timeout" mean. A kind
may also define

    class Memory(probes.Memory)    # what it remembers between checks (`ctx.state`)
    def unanswered(params, state: probes.Memory) -> Verdict | None

what a check that did not answer in time means, from the probe's memory; None (or no such
function) is an ordinary timeout. The progress probe says "busy" there while the work it saw
last is within its stall window: a CPU-starved server answers /metrics late.

Probes run on the controller: HTTP and TCP probes connect from here, and the process and gpu
probes look at this machine; only the command probe runs on the host's connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import httpx

from ralph_runner.plugins import discovery
from ralph_runner.plugins.bounded_http import fetch
from ralph_runner.plugins.network_errors import classify

if TYPE_CHECKING:
    from ralph_runner.plugins.first_token import Measure
    from ralph_runner.process.connection import Connection

# "foreign": the probe passed, but another local user holds its loopback port (not a check of
# a kind: liveness/port_owner.py looks at the port's owner after a passing round)
REASONS = ("refused", "timeout", "status", "body", "error", "stalled", "foreign")
EXCERPT = 200  # characters of an unexpected answer kept in a probe's detail
# What a "stalled" engine was found doing (the progress probe), so that a death's class is read
# from data (liveness/faults.py), never from the detail's wording: requests active and no
# engine step within the hang bound; idle, and our 1-token canary unanswered; put to sleep.
Finding = Literal["work-stalled", "idle-unanswered", "asleep"]


@dataclass(frozen=True)
class Verdict:
    """What one check says: ok, or its reason (one of REASONS); the detail in words; what it
    found, when the reason alone does not say (`stalled`)."""

    ok: bool
    reason: str | None
    detail: str
    finding: Finding | None = None


class ProbeEntry(TypedDict):
    """A ProbeResult as death records and `ralph-run probe --json` hold it."""

    name: str
    kind: str
    ok: bool
    reason: str | None
    detail: str
    seconds: float


@dataclass
class ProbeResult:
    """One probe's verdict; `reason` is None when ok, else one of REASONS; `finding` as the
    Verdict's (not in the records: the death's class, made from it, is)."""

    name: str
    kind: str
    ok: bool
    reason: str | None
    detail: str
    seconds: float
    finding: Finding | None = None

    def as_dict(self) -> ProbeEntry:
        return {
            "name": self.name,
            "kind": self.kind,
            "ok": self.ok,
            "reason": self.reason,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class Awaiting:
    """The loop's own requests that wait for their first token (the loop's agent proxy sees
    them): work the engine has not reported yet while it reads their prompts."""

    count: int
    since: float  # monotonic time the oldest was sent
    latest: float  # ... and the newest
    tokens: float  # the largest one's prompt tokens (from its bytes, at the ratio measured)
    measures: tuple[Measure, ...] = ()  # the loop's requests' first tokens (plugins/first_token.py)
    settled: float = 0.0  # when the loop's last request before these ended (monotonic)


class Memory:
    """A probe's memory between checks. A kind that remembers subclasses it as its own
    `Memory` (progress.Memory: its last counters, its hang bound), made by `memory_for`."""


def memory_for(kind: str) -> Memory:
    """A new memory for a probe of `kind`: the kind's own, or this empty one."""
    made: Callable[[], Memory] = getattr(KINDS[kind], "Memory", Memory)
    return made()


@dataclass
class ProbeContext:
    """What a check may use: one shared HTTP client (keep-alive), the host, the time limit,
    and `state`: the probe's own memory between checks (`memory_for`). Each probe's checks run
    one at a time on its worker, which owns it. `traffic`: what the loop's own requests wait
    for, when its agent proxy runs."""

    client: httpx.Client
    connection: Connection
    timeout: float
    state: Memory = field(default_factory=Memory)
    traffic: Callable[[], Awaiting | None] | None = None


def excerpt(text: str) -> str:
    """The start of an answer, on one line, for a detail."""
    flat = " ".join(text.split())
    return flat if len(flat) <= EXCERPT else flat[: EXCERPT - 3] + "..."


def request(ctx: ProbeContext, method: str, url: str, **options: Any) -> httpx.Response:
    """One request on the shared client, its whole answer within the probe's timeout and
    MAX_BODY bytes (plugins/bounded_http.py).

    A kept-alive connection that the server dropped (it restarted, died, or closed an idle
    connection as uvicorn does after 5 s) fails on reuse; that gets one retry, on a fresh
    connection, so the result says what the server does now ("refused" for a dead one).
    """
    started = time.monotonic()
    try:
        return fetch(ctx.client, method, url, timeout=ctx.timeout, **options)
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        left = ctx.timeout - (time.monotonic() - started)
        if left <= 0:
            raise
        return fetch(ctx.client, method, url, timeout=left, **options)


def run_probe(name: str, kind: str, params: Any, ctx: ProbeContext) -> ProbeResult:
    """Run one check; never raises (an unexpected exception is a failed result, reason error)."""
    started = time.monotonic()
    try:
        verdict: Verdict = KINDS[kind].check(params, ctx)
    except Exception as exc:
        verdict = Verdict(False, *classify(exc, ctx.timeout))
        if verdict.reason == "timeout":
            verdict = no_answer(kind, params, ctx.state, verdict)
    return ProbeResult(
        name=name,
        kind=kind,
        ok=verdict.ok,
        reason=None if verdict.ok else verdict.reason,
        detail=verdict.detail,
        seconds=time.monotonic() - started,
        finding=verdict.finding,
    )


def no_answer(kind: str, params: Any, state: Memory, timed_out: Verdict) -> Verdict:
    """The verdict on a check that did not answer in time: the kind's own reading of it
    (`unanswered`), else `timed_out` as it is."""
    reading = getattr(KINDS[kind], "unanswered", None)
    verdict: Verdict | None = reading(params, state) if reading is not None else None
    if verdict is None:
        return timed_out
    return replace(verdict, detail=f"{timed_out.detail}; {verdict.detail}")


KINDS: dict[str, ModuleType] = discovery.discover(
    __name__, Path(__file__).parent, "KIND", required=("Params", "check")
)
