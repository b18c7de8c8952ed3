"""Deaths as data, wired to one run: the flight recorder, the iteration history, signatures.

`attached(plan, bus, state_dir, meter)` wraps a run: it starts the recorder (when the runbook
has a `recorder:`), makes the iteration history follow the run's events, and notes in
`.ralph/sources.json` where this workdir's death records are, so that `ralph-run deaths WORKDIR`
and `ralph-run report WORKDIR` find them. It gives the run its `Session`, which the runner hands
to the service's death path: `Session.at_death(record)` is what a death record gets from it,
the recorder's last minutes and the death's signature.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ralph_runner import events
from ralph_runner.deaths import signatures
from ralph_runner.deaths.history import History, Meter
from ralph_runner.deaths.log import for_plan as death_log_for
from ralph_runner.deaths.record import DeathRecord
from ralph_runner.deaths.recorder import DIRECTORY, Recorder, Settings
from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError
from ralph_runner.workspace.state_files import HISTORY_FILE, SOURCES_FILE

if TYPE_CHECKING:
    from ralph_runner.output.bus import EventBus
    from ralph_runner.runbook.plan import Plan

MIB = 1024 * 1024


@dataclass
class Session:
    """One run's records: its iteration history and its flight recorder; a follower of its
    events while the run lasts."""

    plan: Plan
    history: History
    recorder: Recorder | None
    active: bool = True

    def on_event(self, event: events.Event) -> None:
        if not self.active:
            return
        self.history.on_event(event)
        if isinstance(event, events.Recovery) and event.recovered and self.recorder is not None:
            self.recorder.mark_recovery(event.death)

    def at_death(self, record: DeathRecord) -> DeathRecord:
        """What a death record gets from here: the recorder's window and the signature."""
        fields: DeathRecord = {}
        if self.recorder is not None:
            try:
                fields["recorder"] = self.recorder.window()
            except Exception as exc:  # the death must be recorded whatever became of the ring
                fields["recorder"] = {"error": f"the recorder's window could not be read: {exc}"}
        fields.update(signatures.of_record({**record, **fields}))
        return fields


def settings_for(plan: Plan) -> Settings | None:
    """The runbook's `recorder:` rendered for the plan's host; None when it has none."""
    config = plan.model.recorder
    if config is None:
        return None
    where = plan.runbook.where

    def text(key: str, shell: bool = False) -> str | None:
        value = getattr(config, key)
        if value is None:
            return None
        return plan.templar.render(
            value, plan.variables, shell=shell, where=where(("recorder", key))
        )

    return Settings(
        url=text("url"),
        metrics=list(config.metrics),
        period=config.period,
        gpu=config.gpu,
        follow=text("follow", shell=True),
        file=plan.path(("recorder", "file"), config.file) if config.file else None,
        window=config.window,
        max_lines=config.max_lines,
        max_bytes=int(config.max_mb * MIB),
        connection=plan.connection_for(None),
    )


def describe(settings: Settings) -> str:
    parts = []
    if settings.url:
        parts.append(
            f"{len(settings.metrics)} metrics from {settings.url} every {settings.period:g} s"
        )
    if settings.gpu:
        parts.append("GPU memory (NVML)")
    if settings.log_source:
        parts.append(f"log ({settings.log_source})")
    bound = settings.max_bytes / MIB
    what = ", ".join(parts) or "nothing"
    return f"recording {what}; ring ≤ {bound:g} MiB, {settings.window:g} s into each death record"


@contextlib.contextmanager
def attached(
    plan: Plan, bus: EventBus, state_dir: Path, meter: Meter | None = None
) -> Iterator[Session]:
    """Record this run: start the recorder, make the history follow the events (with `meter`,
    the agent proxy's counters, for its receipts)."""
    write_sources(state_dir, plan, death_log_for(plan).records_path)
    settings = settings_for(plan)
    recorder = None
    if settings is not None:
        try:
            recorder = Recorder(settings, state_dir / DIRECTORY, bus.warn, bus.redactor)
        except OSError as exc:  # an unwritable state dir: the loop matters more than its record
            bus.warn(f"recorder not started: {exc}")
    history = History(
        state_dir / HISTORY_FILE,
        plan.host,
        tokens=recorder.prompt_tokens if recorder else None,
        warn=lambda message: bus.warn(f"history: {message}"),
        workdir=plan.workdir,
        report=bus.emit,
        meter=meter,
    )
    session = Session(plan, history, recorder)
    bus.follow(session)
    if recorder is not None and settings is not None:
        bus.emit(events.Recorder(message=describe(settings)))
        recorder.start()
    try:
        yield session
    finally:
        history.close("unknown")  # the loop ended its iteration; a line left open is unknown
        session.active = False
        if recorder is not None:
            recorder.stop()


def write_sources(state_dir: Path, plan: Plan, records: Path) -> None:
    """Where `deaths` and `report` find this workdir's records (a view: not fsynced)."""
    data = {"records": str(records), "host": plan.host, "runbook": str(plan.runbook.path)}
    with contextlib.suppress(FatalError):  # a full disk: the run goes on, records by runbook
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(state_dir / SOURCES_FILE, json.dumps(data).encode(), durable=False)
