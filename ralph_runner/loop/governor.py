"""`loop.workers: auto`: as many workers as the server has headroom for, 1 to `max_workers`.

A serial loop leaves a batching server idle; too many workers make it queue (requests wait for a
slot) and preempt (vLLM evicts a running request's KV cache to fit another, and recomputes it
later): each worker is slower and nothing more gets done, and KV-cache pressure can kill vLLM's
engine (the `num_required_blocks` assertion). So the governor looks at the server's /metrics
(the `progress` probe's, unless `loop.governor.metrics` says) every `every` s, and decides:

- **shed** one worker when requests wait in two looks in a row, when preemptions rose since the
  last look, when the KV-cache use is at `kv_cache_max`, and after a death whose signature
  points at KV-cache pressure. A shed worker's attempt is never killed: nothing starts until
  fewer than the admitted number are in flight. The level shed from is not admitted again for
  RECALL s (the server told us it was too many).
- **admit** when every admitted worker is busy and the server has shown headroom for `settle` s
  since the last change (nothing waiting, KV-cache use under the bound, no new preemption):
  doubling until the first shed (slow start, as TCP's), one at a time after it.

A look that fails (the server is down or recovering) decides nothing. Each decision is a
`governor` event with its reason; status.json's `governor` says where it stands.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from ralph_runner import events
from ralph_runner.plugins import bounded_http, prometheus_text

if TYPE_CHECKING:
    from ralph_runner.output.bus import EventBus
    from ralph_runner.runbook.schema import Governor as Settings
    from ralph_runner.workspace.status_file import GovernorStatus

RECALL = 600.0  # s a level shed from is not admitted again
SCRAPE_TIMEOUT = 3.0  # s for one look at /metrics
SCRAPE_CAP = 4 * 1024 * 1024  # bytes of /metrics read at most
# A death signature that says the KV cache ran out (vLLM's block assertion, an out-of-memory).
KV_PRESSURE = re.compile(
    r"num_required_blocks|req_blocks|KV cache|kv_cache|out of memory|OutOfMemory|preempt", re.I
)


@dataclass(frozen=True)
class Look:
    """One look at the server's numbers (None: /metrics lacks it)."""

    at: float  # monotonic
    waiting: float
    kv_cache: float | None
    preemptions: float | None


@dataclass(frozen=True)
class Decision:
    workers: int
    was: int
    reason: str


@dataclass
class Policy:
    """The rules, apart from the looking: fed looks and deaths, says what to change."""

    max_workers: int
    kv_cache_max: float
    settle: float
    admitted: int = 1
    slow_start: bool = True  # doubling until the first shed
    last: Look | None = None
    calm_since: float | None = None  # headroom seen at every look since (None: not now)
    changed_at: float = 0.0
    barred: dict[int, float] = field(default_factory=dict)  # level -> not admitted until

    def look(self, look: Look, busy: int) -> Decision | None:
        """One look's decision; `busy`: the attempts in flight."""
        last, self.last = self.last, look
        kv = look.kv_cache
        before = last.preemptions if last is not None else None
        if look.preemptions is not None and before is not None and look.preemptions > before:
            return self.shed(look.at, f"preemptions rose by {look.preemptions - before:g}")
        if look.waiting > 0 and last is not None and last.waiting > 0:
            return self.shed(look.at, f"{look.waiting:g} requests waiting, two looks in a row")
        if kv is not None and kv >= self.kv_cache_max:
            return self.shed(look.at, f"KV cache at {kv:.0%} (bound {self.kv_cache_max:.0%})")
        if look.waiting > 0:  # once may be a moment: no change, and no headroom either
            self.calm_since = None
            return None
        if self.calm_since is None:
            self.calm_since = look.at
        if busy < self.admitted or self.admitted >= self.max_workers:
            return None  # the admitted ones are not all busy: more would not be used
        if look.at - self.calm_since < self.settle:
            return None
        want = min(self.max_workers, self.admitted * 2 if self.slow_start else self.admitted + 1)
        while want > self.admitted and self.barred.get(want, 0.0) > look.at:
            want -= 1
        if want == self.admitted:
            return None
        kv_text = f", KV cache {kv:.0%}" if kv is not None else ""
        return self._to(want, look.at, f"headroom for {self.settle:g} s: nothing waiting{kv_text}")

    def shed(self, now: float, reason: str) -> Decision | None:
        """One worker fewer (never below 1), and its level barred for RECALL s."""
        self.slow_start = False
        if self.admitted <= 1:
            return None
        self.barred[self.admitted] = now + RECALL
        return self._to(self.admitted - 1, now, reason)

    def _to(self, workers: int, now: float, reason: str) -> Decision:
        decision = Decision(workers, self.admitted, reason)
        self.admitted, self.changed_at, self.calm_since = workers, now, now  # settle from now
        return decision


class Governor:
    """The governor's thread: looks every `every` s and tells the scheduler (`in_flight`,
    `admit`); a death whose signature points at KV-cache pressure sheds one (`death_signed`,
    the scheduler's call)."""

    def __init__(
        self,
        settings: Settings,
        url: str,
        max_workers: int,
        in_flight: Callable[[], int],
        admit: Callable[[int], None],
        bus: EventBus,
        client: httpx.Client,
    ) -> None:
        """`client`: the health checks' (their TLS settings, their kept-alive connection)."""
        self.settings, self.url, self.bus = settings, url, bus
        self.in_flight, self.admit = in_flight, admit
        self._client = client
        self.policy = Policy(max_workers, settings.kv_cache_max, settings.settle)
        self.reason = "the first worker: the server's headroom is not known yet"
        self.changed = time.time()
        self._death: str | None = None  # a KV-pressure death's reason, until the next look
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="governor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(SCRAPE_TIMEOUT + 1.0)

    def fields(self) -> GovernorStatus:
        return {
            "workers": self.policy.admitted,
            "max_workers": self.policy.max_workers,
            "reason": self.reason,
            "changed": self.changed,
        }

    def death_signed(self, death: int, signature: str | None) -> None:
        """A death's signature that points at KV-cache pressure sheds one at the next look
        (decided on the governor's thread: the console says the death first)."""
        if KV_PRESSURE.search(signature or ""):
            self._death = f"death {death}'s signature points at KV-cache pressure"

    def _run(self) -> None:
        while not self._stop.wait(self.settings.every):
            if (death := self._death) is not None:
                self._death = None
                self._tell(self.policy.shed(time.monotonic(), death))
            if (look := self._look()) is not None:
                self._tell(self.policy.look(look, self.in_flight()))

    def _tell(self, decision: Decision | None) -> None:
        if decision is None:
            return
        self.reason, self.changed = decision.reason, time.time()
        self.admit(decision.workers)
        self.bus.emit(
            events.Governed(
                workers=decision.workers,
                was=decision.was,
                of=self.policy.max_workers,
                reason=decision.reason,
            )
        )

    def _look(self) -> Look | None:
        s = self.settings
        names = [n for n in (s.waiting, s.kv_cache, s.preemptions) if n]
        try:
            response = bounded_http.fetch(
                self._client, "GET", self.url, timeout=SCRAPE_TIMEOUT, cap=SCRAPE_CAP
            )
        except (httpx.HTTPError, OSError):
            return None
        if response.status_code != 200:
            return None
        sums: dict[str, float] = {}
        for sample in prometheus_text.samples(response.text, names):
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        if s.waiting not in sums:
            return None  # not the server's numbers: decide nothing on them
        return Look(
            at=time.monotonic(),
            waiting=sums[s.waiting],
            kv_cache=sums.get(s.kv_cache) if s.kv_cache else None,
            preemptions=sums.get(s.preemptions) if s.preemptions else None,
        )
