"""The loop as Prometheus metrics: a node_exporter textfile, rewritten at each change.

node_exporter's textfile collector serves every `*.prom` file of a directory, so an operator's
existing Prometheus sees each loop with no server of ours. The file follows the run's events
(a follower of output.bus.EventBus); prometheus_client renders it, and it is replaced atomically by
a temp file of a random name made in the same directory without following a link (its own
writer followed one planted at its predictable temp name); an existing textfile must be a
regular file of ours (a link stops the run at its start, exit 2). A heartbeat rewrites it
every HEARTBEAT s so that `ralph_last_update_timestamp_seconds` tells a loop that hangs from one
that is busy.
Counters count from the start of this ralph-run process (Prometheus' `increase()` copes with
the reset of a restarted loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import ALLOWUTF8

from ralph_runner import events
from ralph_runner.durable.files import NotOurs, check_own_file, replace_own_file
from ralph_runner.errors import FatalError
from ralph_runner.runbook.plan import Plan

HEARTBEAT = 30.0  # seconds between rewrites while nothing happens
RECOVERY_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
SIGNATURES = 10  # distinct death signatures kept as label values; the rest count as "other"
SIGNATURE_CHARS = 80
# The events that move a metric: the file is rewritten after each.
MOVING = (
    events.IterationStarted, events.Summary, events.Done, events.Skip, events.Strike,
    events.UsageLimitHit, events.Death, events.Report, events.Recovery, events.Receipt,
    events.Paused, events.Resumed, events.Rejuvenated,
)  # fmt: skip


def textfile_path(plan: Plan) -> Path | None:
    """The runbook's textfile, rendered for the plan's host; its directory must exist (a typo
    there would silently feed no one, so it is an error at `--check`, not at the first write)."""
    if plan.model.metrics is None:
        return None
    path = plan.path(("metrics", "textfile"), plan.model.metrics.textfile)
    try:
        missing = not path.parent.is_dir()
    except OSError:  # a name the system refuses (too long)
        missing = True
    if missing:
        where = plan.runbook.where(("metrics", "textfile"))
        message = f"no such directory for the metrics textfile: {path.parent}"
        raise FatalError(replace(where, message=message))
    try:
        check_own_file(path)
    except NotOurs as err:
        where = plan.runbook.where(("metrics", "textfile"))
        raise FatalError(
            replace(where, message=f"the metrics textfile {path} {err.strerror}")
        ) from None
    return path


class Textfile:
    """Prometheus metrics of one loop, as an event follower; `close(code)` writes the last file."""

    def __init__(self, path: Path, host: str, warn: Callable[[str], None]) -> None:
        self.path, self.warn = path, warn
        registry = self.registry = CollectorRegistry()
        host_only = ["host"]
        self.up = Gauge(
            "ralph_up", "1 while the loop runs, 0 once it has exited.", host_only, registry=registry
        )
        self.iterations = Counter(
            "ralph_iterations", "Iterations started.", host_only, registry=registry
        )
        self.items = Gauge(
            "ralph_items",
            "Checklist items by state.",
            labelnames=["host", "state"],
            registry=registry,
        )
        self.deaths = Counter(
            "ralph_deaths", "Deaths of the service, by phase.", ["host", "phase"], registry=registry
        )
        self.by_signature = Counter(
            "ralph_deaths_by_signature",
            f"Deaths by signature (the first {SIGNATURES} seen; later ones as 'other').",
            ["host", "signature"],
            registry=registry,
        )
        self.last_death = Gauge(
            "ralph_last_death_timestamp_seconds",
            "When the last death was found.",
            host_only,
            registry=registry,
        )
        self.recoveries = Counter(
            "ralph_recoveries", "Recoveries by outcome.", ["host", "outcome"], registry=registry
        )
        self.rejuvenations = Counter(
            "ralph_rejuvenations",
            "Restarts at an item boundary of a server that rotted (no death), by sign.",
            ["host", "sign"],
            registry=registry,
        )
        self.recovery_seconds = Histogram(
            "ralph_recovery_duration_seconds",
            "Time from a death's capture to a healthy service (or giving up).",
            host_only,
            buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.attempts = Gauge(
            "ralph_item_attempts",
            "Strikes of the current item so far.",
            host_only,
            registry=registry,
        )
        self.exit_code = Gauge(
            "ralph_exit_code",
            "The loop's exit code; -1 while it runs.",
            host_only,
            registry=registry,
        )
        self.paused = Gauge(
            "ralph_paused",
            "1 while the loop waits paused (`ralph-run pause`).",
            host_only,
            registry=registry,
        )
        self.limited_until = Gauge(
            "ralph_limited_until_timestamp_seconds",
            "While the loop waits out an agent's usage limit: when it tries again; else 0.",
            host_only,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "ralph_agent_prompt_tokens",
            "Prompt tokens of this loop's own requests (its agent proxy, loop.proxy).",
            host_only,
            registry=registry,
        )
        self.generated_tokens = Counter(
            "ralph_agent_generated_tokens",
            "Generated tokens of this loop's own requests (its agent proxy, loop.proxy).",
            host_only,
            registry=registry,
        )
        self.updated = Gauge(
            "ralph_last_update_timestamp_seconds",
            "When this file was last written.",
            host_only,
            registry=registry,
        )
        self.host = host
        self._signatures: set[str] = set()
        self._lock = threading.Lock()
        self._failed = False
        self._stop = threading.Event()
        self.up.labels(host).set(1)
        self.exit_code.labels(host).set(-1)
        self.limited_until.labels(host).set(0)
        self.paused.labels(host).set(0)
        self.iterations.labels(host)  # present (as 0) from the first write
        self.prompt_tokens.labels(host)
        self.generated_tokens.labels(host)
        self.write()
        self._heartbeat = threading.Thread(target=self._beat, name="metrics", daemon=True)
        self._heartbeat.start()

    def on_event(self, event: events.Event) -> None:
        if not isinstance(event, MOVING):  # a warning this file's own write raised, among others
            return
        with self._lock:
            self._move_by(event)
        self.write()

    def close(self, code: int) -> None:
        self._stop.set()
        with self._lock:
            self.up.labels(self.host).set(0)
            self.paused.labels(self.host).set(0)
            self.exit_code.labels(self.host).set(code)
        self.write()

    def write(self) -> None:
        """Rewrite the file; a failure (full disk, directory gone) is one warning, not a stop."""
        with self._lock:
            self.updated.labels(self.host).set(time.time())
            try:
                data = generate_latest(self.registry, ALLOWUTF8)
                replace_own_file(self.path, data, durable=False)  # a gauge: the next one comes
            except OSError as exc:
                if not self._failed:
                    self.warn(f"metrics textfile {self.path}: {exc.strerror or exc}")
                self._failed = True
                return
            self._failed = False

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            self.write()

    # -- what each event kind moves ------------------------------------------------------
    def _move_by(self, event: events.Event) -> None:
        """Move the metrics `event` moves (one of MOVING)."""
        host = self.host
        match event:
            case events.IterationStarted():
                self.iterations.labels(host).inc()
                self.limited_until.labels(host).set(0)
                self._items(event.done, event.todo, event.skipped)
                self.attempts.labels(host).set(event.attempts)
            case events.Summary():
                self._items(event.done, event.todo, event.skipped)
                self.attempts.labels(host).set(0)
            case events.Done():
                self._move("todo", "done")
                self.attempts.labels(host).set(0)
            case events.Skip():
                self._move("todo", "skipped")
                self.attempts.labels(host).set(0)
            case events.Strike():
                self.attempts.labels(host).set(event.strikes)
            case events.UsageLimitHit():
                self.limited_until.labels(host).set(event.until)
            case events.Death():
                self.deaths.labels(host, event.phase).inc()
                self.last_death.labels(host).set(time.time())
            case events.Report():
                if not event.signature:
                    return
                signature = event.signature[:SIGNATURE_CHARS]
                if signature not in self._signatures and len(self._signatures) >= SIGNATURES:
                    signature = "other"
                self._signatures.add(signature)
                self.by_signature.labels(host, signature).inc()
            case events.Recovery():
                outcome = "recovered" if event.recovered else "gave_up"
                self.recoveries.labels(host, outcome).inc()
                self.recovery_seconds.labels(host).observe(event.seconds)
            case events.Receipt():  # an iteration's, from its history line
                self.prompt_tokens.labels(host).inc(event.prompt_tokens or 0)
                self.generated_tokens.labels(host).inc(event.generated_tokens or 0)
            case events.Rejuvenated():
                for sign in event.signs:
                    self.rejuvenations.labels(host, sign).inc()
            case events.Paused():
                self.paused.labels(host).set(1)
            case events.Resumed():
                self.paused.labels(host).set(0)

    def _items(self, done: int, todo: int, skipped: int) -> None:
        for state, count in (("done", done), ("todo", todo), ("skipped", skipped)):
            self.items.labels(self.host, state).set(count)

    def _move(self, source: str, target: str) -> None:
        self.items.labels(self.host, source).dec()
        self.items.labels(self.host, target).inc()
