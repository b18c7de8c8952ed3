"""Death reports: the human log (a Jinja template) and its JSONL twin, with secrets masked.

A death is written once, append-only, and fsynced before recovery starts: the point of the log is
to explain a death hours later, so a report must survive the crash that follows it, a full disk
and a kill -9 in the middle of the write.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ralph_runner.deaths.record import (
    DeathRecord,
    Record,
    RecoveryRecord,
    RejuvenationAfter,
    RejuvenationRecord,
    StartRecord,
    is_death,
    is_recovery,
)
from ralph_runner.durable import jsonl
from ralph_runner.durable.files import NotOurs, append_durably, check_own_file
from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import FatalError, Problem
from ralph_runner.output.text import columns, plural, shorten, step_ended

if TYPE_CHECKING:
    from ralph_runner.runbook.plan import Plan
    from ralph_runner.templating import Templar


def records_path(log_path: Path, records: str | Path | None = None) -> Path:
    """The JSONL twin of a death log: its suffix replaced by .jsonl, unless `records` names one.

    `records` is taken as given; the caller resolves it against the workdir like the log.
    """
    if records is not None:
        return Path(records)
    twin = log_path.with_suffix(".jsonl")
    # A log that is itself named *.jsonl must not share its file with its twin.
    return twin if twin != log_path else log_path.with_name(log_path.name + ".records.jsonl")


def default_template() -> str:
    """The death report template shipped with ralph-run (`template: default`)."""
    return resources.files("ralph_runner").joinpath("templates/default.j2").read_text("utf-8")


class DeathLog:
    """Appends deaths and recovery outcomes to the human log and to the JSONL records file."""

    def __init__(
        self,
        log_path: Path,
        records_path: Path,
        *,
        template: str,
        templar: Templar,
        redactor: Redactor,
        where: Problem | None = None,
    ) -> None:
        self.log_path = log_path
        self.records_path = records_path
        self.template = template
        self.templar = templar
        self.redactor = redactor
        self.where = where  # where the template came from, for its errors

    def write_death(self, record: DeathRecord) -> list[str]:
        """Write one death to both files, durably, before the caller starts recovery; what
        could not be written (file: why), empty when both were."""
        record = self.redactor.data({"event": "death", **record})
        block = self._render(record)
        return self._write(record, "death", self.redactor.text(block).rstrip("\n") + "\n\n")

    def write_recovery(self, record: RecoveryRecord) -> None:
        """Write a recovery outcome: the JSON record and a short line under its death's block."""
        record = self.redactor.data({"event": "recovery", **record})
        self._write(record, "recovery", self.redactor.text(recovery_text(record)))

    def write_start(self, record: StartRecord) -> None:
        """A start (the service was not running at the run's first check): a JSON record of
        its own event, which no death statistic counts, and one line in the log."""
        record = self.redactor.data({"event": "start", **record})
        done = "started" if record.get("recovered") else f"not started: {record.get('reason')}"
        line = f"===== {record.get('time')} {record.get('service')} was not running: {done}"
        self._write(
            record,
            "start",
            self.redactor.text(f"{line} ({seconds_text(record.get('seconds'))} s) =====\n\n"),
        )

    def write_rejuvenation(self, record: RejuvenationRecord) -> None:
        """A restart at an item boundary of a server that rots (no death): a JSON record of
        its own event and one line in the log."""
        record = self.redactor.data({"event": "rejuvenation", **record})
        done = "restarted" if record.get("recovered") else f"NOT restarted: {record.get('reason')}"
        line = (
            f"===== {record.get('time')} rejuvenation {record.get('rejuvenation')} of "
            f"{record.get('service')} ({', '.join(record.get('signs') or [])}): {done}"
        )
        text = f"{line} ({seconds_text(record.get('seconds'))} s) =====\n"
        self._write(
            record, "rejuvenation", self.redactor.text(f"{text}  {record.get('reason')}\n\n")
        )

    def write_rejuvenation_after(self, record: RejuvenationAfter) -> None:
        """The restarted server's baseline, once measured: the record alone (the report's)."""
        record = self.redactor.data({"event": "rejuvenation-after", **record})
        line = json.dumps(record, ensure_ascii=False, default=str)
        try:
            append_durably(self.records_path, line + "\n")
        except OSError as err:
            print(f"ralph-run: could not write {line}: {err}", file=sys.stderr, flush=True)

    def _render(self, record: DeathRecord) -> str:
        return render(record, self.template, self.templar, self.redactor, self.where)

    def _write(self, record: Record, kind: str, text: str) -> list[str]:
        line = json.dumps(record, ensure_ascii=False, default=str)
        errors = []
        for path, data in ((self.log_path, text), (self.records_path, line + "\n")):
            try:
                append_durably(path, data)
            except OSError as err:
                errors.append(f"{err.filename or path}: {err.strerror or err}")
        if errors:
            # Disk full or unwritable: the loop goes on to recovery; the record lives on stderr.
            print(
                f"ralph-run: could not write {kind} record ({'; '.join(errors)}): {line}",
                file=sys.stderr,
                flush=True,
            )
        return errors


def render(
    record: Mapping[str, Any],
    template: str,
    templar: Templar,
    redactor: Redactor,
    where: Problem | None = None,
) -> str:
    """The human report of one record (redacted); a broken template still keeps the facts."""
    record = redactor.data(record)
    try:
        text = templar.render(template, {**record, "record": record}, where=where)
    except FatalError as err:
        text = (
            f"===== death {record.get('death', '?')} at {record.get('time', '?')}"
            f" (report template failed: {err}) =====\n"
            f"{json.dumps(record, indent=2, ensure_ascii=False, default=str)}\n"
            "===== END =====\n"
        )
    return redactor.text(text)


def recovery_text(record: RecoveryRecord) -> str:
    """The human line for a recovery outcome, plus the output of failed steps when it gave up."""
    if record.get("recovered"):
        return (
            f"--- recovery: recovered after {record.get('attempts', '?')} attempt(s)"
            f" in {seconds_text(record.get('seconds'))} s ---\n\n"
        )
    lines = [f"--- recovery FAILED: {record.get('reason') or 'not recovered'} ---"]
    for step in record.get("steps") or []:
        if not step.get("ok", True):
            attempt = f"attempt {step['attempt']}, " if "attempt" in step else ""
            why = step_ended(step.get("exit_code"), bool(step.get("timed_out")), False) or "failed"
            lines.append(f" {attempt}step {step.get('name', '?')!r} failed ({why}):")
            lines.extend("  " + out for out in str(step.get("output") or "").splitlines())
    return "\n".join(lines) + "\n\n"


def seconds_text(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "?"


def read_records(path: Path) -> list[Record]:
    """The records of a JSONL death file, skipping a torn line (kill -9 mid-write) with a warning.

    A missing file means no death was recorded yet. A torn line is the last line until the next
    run appends after it (on a fresh line), so a bad line anywhere is skipped the same way.
    JSON from disk becomes typed records here, and only here: its keys are read with .get().
    """
    skipped = jsonl.Skipped(warn=_warn_torn)
    return [cast(Record, entry) for _, entry in jsonl.read(path, skipped)]


def _warn_torn(where: str, why: str) -> None:
    print(
        f"ralph-run: warning: {where}: skipped a torn record (an interrupted write?): {why}",
        file=sys.stderr,
    )


ITEM_WIDTH = 60  # of an item's text in the summary's last column


def summarize(records: Iterable[Record]) -> str:
    """One line per death with its recovery outcome, then totals (`ralph-run deaths`)."""
    deaths: list[DeathRecord] = []
    recoveries: dict[int, RecoveryRecord] = {}  # index in deaths -> its recovery
    latest: dict[Any, int] = {}  # death number -> index of the latest death with that number
    for record in records:
        if is_death(record):
            latest[record.get("death")] = len(deaths)
            deaths.append(record)
        elif is_recovery(record) and record.get("death") in latest:
            recoveries[latest[record.get("death")]] = record
    if not deaths:
        return "no deaths recorded"
    rows = [
        [
            f"#{death.get('death', '?')}",
            str(death.get("time", "?"))[:19].replace("T", " "),
            f"iter {death.get('iteration', '?')}",
            str(death.get("phase", "?")),
            first_failure(death),
            recovery_summary(recoveries.get(index)),
            shorten((death.get("item") or {}).get("text", "(no item)"), ITEM_WIDTH),
        ]
        for index, death in enumerate(deaths)
    ]
    return "\n".join([*columns(rows), totals(len(deaths), list(recoveries.values()))])


def first_failure(death: DeathRecord) -> str:
    for probe in death.get("probes") or []:
        if not probe.get("ok"):
            return f"{probe.get('name', '?')}: {probe.get('reason', '?')}"
    return "no failed probe"


def recovery_summary(recovery: RecoveryRecord | None) -> str:
    if recovery is None:
        return "no recovery recorded"
    if recovery.get("recovered"):
        attempts = plural(recovery.get("attempts", "?"), "attempt")
        return f"recovered in {seconds_text(recovery.get('seconds'))} s ({attempts})"
    return f"NOT recovered: {recovery.get('reason') or 'gave up'}"


def totals(deaths: int, recoveries: list[RecoveryRecord]) -> str:
    recovered = [r for r in recoveries if r.get("recovered")]
    failed = len(recoveries) - len(recovered)
    parts = [plural(deaths, "death"), f"{len(recovered)} recovered"]
    seconds = [r["seconds"] for r in recovered if isinstance(r.get("seconds"), int | float)]
    if seconds:
        parts[-1] += f" (mean {sum(seconds) / len(seconds):.1f} s, max {max(seconds):.1f} s)"
    parts.append(f"{failed} not recovered")
    if deaths > len(recoveries):
        parts.append(f"{deaths - len(recoveries)} without a recovery record")
    return "total: " + ", ".join(parts)


def for_plan(plan: Plan) -> DeathLog:
    """The plan's death log: its paths, its template (shipped or the runbook's), its secrets."""
    config = plan.model.diagnostics
    log, records = paths(plan)
    where = plan.runbook.where(("diagnostics", "template"))
    if config.template == "default":
        template = default_template()
    else:
        try:
            template = (plan.runbook.directory / config.template).read_text(encoding="utf-8")
        except OSError as exc:
            raise FatalError(replace(where, message=f"cannot read template: {exc}")) from None
    return DeathLog(
        log,
        records,
        template=template,
        templar=plan.templar,
        redactor=Redactor(plan.secret_values()),
        where=where,
    )


def paths(plan: Plan) -> tuple[Path, Path]:
    """The plan's death log and its JSONL records file, resolved against the workdir."""
    config = plan.model.diagnostics
    log = plan.path(("diagnostics", "log"), config.log)
    records = config.records and plan.path(("diagnostics", "records"), config.records)
    return log, records_path(log, records)


def unsafe(plan: Plan) -> list[Problem]:
    """The death log or records file, where one exists that ralph-run would not write (a
    symlink, another user's file, a hard link): found at the start, not at the first death."""
    found = []
    for key, path in zip(("log", "records"), paths(plan), strict=True):
        try:
            check_own_file(path)
        except NotOurs as err:
            where = plan.runbook.where(("diagnostics", key))
            found.append(replace(where, message=f"the death {key} {path} {err.strerror}"))
    return found
