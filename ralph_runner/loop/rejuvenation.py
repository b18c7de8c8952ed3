"""`health.rejuvenate`: a restart before the death, at an item boundary (docs: rejuvenation).

Servers rot without dying: decode slows, the time to first token grows, memory climbs to the
OOM killer, preemptions storm. Each ends as a death mid-item or a night at half speed. A thread
looks at the server's /metrics every `every` s and feeds the signs (signs.py); once one has held
for `sustained_for` s (and the server is older than `min_age`, and the last restart is
`at_most_every` s ago), a restart is due: the scheduler admits no new attempt, lets those in
flight land, then calls `restart` with none in flight. The restart runs the rejuvenate steps
(else the recovery steps) and waits healthy; it is recorded as a `rejuvenation`, not a death:
no strike, nothing lost. A failed restart leaves a server the next check finds dead: a death.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil

from ralph_runner import events
from ralph_runner.liveness.service import Service, iso_time
from ralph_runner.loop.signs import Finding, Names, Reading, Scrape, Signs, Thresholds, parse
from ralph_runner.plugins import bounded_http

if TYPE_CHECKING:
    from collections.abc import Callable

    from ralph_runner.loop.context import RunContext
    from ralph_runner.runbook.schema import Rejuvenate as Settings
    from ralph_runner.workspace.status_file import LastRejuvenation, RejuvenationStatus

SCRAPE_TIMEOUT = 3.0  # s for one look at /metrics
SCRAPE_CAP = 8 * 1024 * 1024  # bytes of /metrics read at most


@dataclass(frozen=True)
class Due:
    """A restart due at the next boundary: the signs that held and the numbers then."""

    findings: list[Finding]
    reading: Reading
    baseline: dict[str, float | None]

    @property
    def signs(self) -> list[str]:
        return [f.sign for f in self.findings]

    @property
    def text(self) -> str:
        return "; ".join(f"{f.text}, for {f.held:.0f} s" for f in self.findings)


def thresholds(settings: Settings) -> Thresholds:
    return Thresholds(
        decode_drop=settings.decode_drop,
        first_token_rise=settings.first_token_rise,
        preemptions_per_minute=settings.preemptions_per_minute,
        memory_limit_mb=settings.memory_limit_mb,
        memory_horizon=settings.memory_horizon,
        sustained_for=settings.sustained_for,
        warmup=settings.warmup,
        baseline=settings.baseline,
        window=settings.window,
        min_tokens=settings.min_tokens,
    )


class Rejuvenation:
    """The looking thread and the restart (see the module)."""

    def __init__(
        self, run: RunContext, settings: Settings, url: str, in_flight: Callable[[], list[str]]
    ) -> None:
        """`in_flight`: the items of the attempts in flight, that land before a due restart
        (the scheduler's, called under its lock)."""
        self.run, self.settings, self.url, self.in_flight = run, settings, url, in_flight
        self.signs = Signs(thresholds(settings))
        self.names = Names(
            inter_token=settings.inter_token,
            first_token=settings.first_token,
            preemptions=settings.preemptions,
            resident=settings.resident,
        )
        self.due: Due | None = None  # set by the thread, taken by the scheduler
        self.count = 0  # this run's restarts
        self.by_sign: Counter[str] = Counter()
        self.last: float | None = None  # monotonic: the last restart
        self.last_fields: LastRejuvenation | None = None  # status.json's `rejuvenation.last`
        self._waiting_after: int | None = None  # a restart whose new baseline is not measured yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rejuvenation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(SCRAPE_TIMEOUT + 1.0)

    def cancel(self) -> None:
        """A death: its recovery restarts the server; the signs start over with the new one."""
        with self._lock:
            self.due = None
            self.signs.reset()

    def fields(self) -> RejuvenationStatus:
        """status.json's `rejuvenation`."""
        return {
            "count": self.count,
            "by_sign": dict(self.by_sign),
            "due": self.due.signs if self.due else None,
            "last": self.last_fields,
        }

    # -- the looking thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.settings.every):
            scrape = self._scrape()
            if scrape is not None:
                self.look(scrape)

    def look(self, scrape: Scrape) -> None:
        """One scrape fed to the signs; a restart due once one held long enough."""
        with self._lock:
            findings = self.signs.look(scrape)
            self._after_measured()
            if not findings or self.due is not None:
                return
            s = self.settings
            if self.signs.age(scrape.at) < s.min_age:
                return
            if self.last is not None and scrape.at - self.last < s.at_most_every:
                return
            due = Due(findings, self.signs.reading, self._baseline())
        with self.run.lock:  # the scheduler's: it starts no attempt from here on
            self.due, in_flight = due, self.in_flight()
        self.run.bus.emit(
            events.RejuvenationDue(signs=due.signs, reason=due.text, in_flight=in_flight)
        )

    def _baseline(self) -> dict[str, float | None]:
        return {
            "decode": self.signs.decode_baseline,
            "first_token": self.signs.first_token_baseline,
        }

    def _after_measured(self) -> None:
        """The restarted server's own baseline, once measured: recorded beside its restart."""
        number = self._waiting_after
        if number is None or self.signs.decode_baseline is None:
            return
        self._waiting_after = None
        self.run.service.death_log.write_rejuvenation_after(
            {"rejuvenation": number, "time": iso_time(time.time()), "after": self._baseline()}
        )

    def _scrape(self) -> Scrape | None:
        try:
            response = bounded_http.fetch(
                self.run.health.client, "GET", self.url, timeout=SCRAPE_TIMEOUT, cap=SCRAPE_CAP
            )
        except (httpx.HTTPError, OSError):
            return None
        if response.status_code != 200:
            return None
        scrape = parse(response.text, time.monotonic(), self.names)
        resident = self._resident()
        if resident is not None:
            scrape = Scrape(**{**asdict(scrape), "resident_bytes": float(resident)})
        return scrape

    def _pid(self) -> int | None:
        if not self.settings.pid_file:
            return None
        path = Path(self.run.plan.templar.render(self.settings.pid_file, self.run.plan.variables))
        path = path if path.is_absolute() else self.run.plan.workdir / path
        try:
            return int(path.read_text(encoding="utf-8").split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _resident(self) -> int | None:
        """The resident memory of the pid file's process and its children (vLLM's engine is
        a child of its API server); None without a pid file, or when it is gone."""
        pid = self._pid()
        if pid is None:
            return None
        try:
            process = psutil.Process(pid)
            tree = [process, *process.children(recursive=True)]
            return sum(p.memory_info().rss for p in tree)
        except psutil.Error:
            return None

    # -- the restart (the scheduler's thread, no attempt in flight) ------------------------
    def restart(self, variables: dict[str, object]) -> None:
        due = self.due
        if due is None:
            return
        run = self.run
        pid_before = self._pid()
        outcome = run.service.rejuvenate(due.signs, variables)
        with self._lock:
            self.count += 1
            self.by_sign.update(due.signs)
            self.last = time.monotonic()
            self.signs.reset()
            self.due = None
            self._waiting_after = self.count
        before = asdict(due.reading)
        pid_after = self._pid()
        service = str(run.plan.variables.get("service_name", run.plan.model.name))
        run.service.death_log.write_rejuvenation(
            {
                "rejuvenation": self.count,
                "time": iso_time(time.time()),
                "host": run.plan.host,
                "service": service,
                "signs": due.signs,
                "found": due.text,
                "before": before,
                "baseline": due.baseline,
                "pid_before": pid_before,
                "pid_after": pid_after,
                **Service.outcome_fields(outcome),
            }
        )
        self.last_fields = {
            "time": time.time(),
            "signs": due.signs,
            "found": due.text,
            "recovered": outcome.recovered,
            "seconds": round(outcome.seconds, 1),
        }
        run.bus.emit(
            events.Rejuvenated(
                rejuvenation=self.count,
                signs=due.signs,
                reason=due.text,
                recovered=outcome.recovered,
                seconds=round(outcome.seconds, 3),
                before=before,
                baseline=due.baseline,
                pid_before=pid_before,
                pid_after=pid_after,
                error=outcome.reason,
            )
        )
        run.save_status()
