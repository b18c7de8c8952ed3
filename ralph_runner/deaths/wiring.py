"""Deaths as data, wired to one run: the flight recorder, the iteration history, signatures.

`attached(plan, output, state_dir)` wraps a run: it starts the recorder (when the runbook has a
`recorder:`), subscribes the iteration history to the event stream, and notes in
`.ralph/sources.json` where this workdir's death records are, so that `ralph-run deaths WORKDIR`
and `ralph-run report WORKDIR` find them. `at_death(plan, record)` is what a death record gets
from it: the recorder's last minutes and the death's signature.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ralph_runner.deaths import signatures
from ralph_runner.deaths.history import History
from ralph_runner.deaths.log import for_plan as death_log_for
from ralph_runner.deaths.record import DeathRecord
from ralph_runner.deaths.recorder import DIRECTORY, Recorder, Settings
from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError
from ralph_runner.workspace.state_files import HISTORY_FILE, SOURCES_FILE

if TYPE_CHECKING:
    from ralph_runner.output import Output
    from ralph_runner.runbook.plan import Plan

MIB = 1024 * 1024
# How a run that ends inside an iteration closes its history line, by the exception's class.
ENDINGS = {"GaveUp": "gave-up", "Interrupted": "interrupted", "FatalError": "failed"}


@dataclass
class Session:
    plan: Plan
    history: History
    recorder: Recorder | None
    active: bool = True

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        if not self.active:
            return
        self.history.on_event(kind, fields)
        if kind == "recovery" and fields.get("recovered") and self.recorder is not None:
            self.recorder.mark_recovery(fields.get("death"))


_sessions: dict[Path, Session] = {}  # workdir -> the run attached to it in this process


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
def attached(plan: Plan, output: Output, state_dir: Path) -> Iterator[Session]:
    """Record this run: start the recorder, follow the events into the history."""
    write_sources(state_dir, plan, death_log_for(plan).records_path)
    settings = settings_for(plan)
    recorder = None
    if settings is not None:
        try:
            recorder = Recorder(settings, state_dir / DIRECTORY, output.event, output.redactor)
        except OSError as exc:  # an unwritable state dir: the loop matters more than its record
            output.event("warning", message=f"recorder not started: {exc}")
    history = History(
        state_dir / HISTORY_FILE,
        plan.host,
        tokens=recorder.prompt_tokens if recorder else None,
        warn=lambda message: output.event("warning", message=f"history: {message}"),
        workdir=plan.workdir,
        report=lambda receipt: output.event("receipt", **receipt),
    )
    session = Session(plan, history, recorder)
    output.subscribe(session.on_event)
    if recorder is not None and settings is not None:
        output.event("recorder", message=describe(settings))
        recorder.start()
    _sessions[plan.workdir] = session
    ending = "unknown"
    try:
        yield session
    except BaseException as exc:
        ending = next((v for k, v in ENDINGS.items() if _is(exc, k)), "failed")
        raise
    finally:
        _sessions.pop(plan.workdir, None)
        history.close(ending)
        session.active = False
        if recorder is not None:
            recorder.stop()


def _is(exc: BaseException, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def at_death(plan: Plan, record: DeathRecord) -> DeathRecord:
    """What a death record gets from here: the recorder's window and the signature."""
    session = _sessions.get(plan.workdir)
    fields: DeathRecord = {}
    if session is not None and session.recorder is not None:
        try:
            fields["recorder"] = session.recorder.window()
        except Exception as exc:  # the death must be recorded whatever became of the ring
            fields["recorder"] = {"error": f"the recorder's window could not be read: {exc}"}
    fields.update(signatures.of_record({**record, **fields}))
    return fields


def write_sources(state_dir: Path, plan: Plan, records: Path) -> None:
    """Where `deaths` and `report` find this workdir's records (a view: not fsynced)."""
    data = {"records": str(records), "host": plan.host, "runbook": str(plan.runbook.path)}
    with contextlib.suppress(FatalError):  # a full disk: the run goes on, records by runbook
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(state_dir / SOURCES_FILE, json.dumps(data).encode(), durable=False)
