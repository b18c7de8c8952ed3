"""A death's signature: what kind of death it was, so that deaths of one kind group together.

The signature is the last exception line of the server's log in the death record, with what
changes from one death to the next masked (numbers, hex ids, pids, paths, timestamps), so that
`AssertionError: num_required_blocks 25 < len(req_blocks) 26` and the same assertion with other
numbers read the same. A death with no exception in its log (a hang, a kill) is signed by its
probe failure instead: `probe can generate: timeout`, `probe models endpoint: status 503`.

Which lines are the server's log: the flight recorder's followed log, when the record has one
(its lines are timestamped, so only those since the previous recovery count: an exception an
earlier death left in the log does not sign the next one), else the output of the collectors
whose name says `log` (`container log (last lines)`, `server log (last 60 lines)`); never other
collectors, whose output (a checklist, a git log) may quote an error as text.

An exception line that only points at another one (vLLM's `EngineDeadError: ... See stack trace
(above) for the root cause.`) is passed over for the one it points at.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ralph_runner.deaths.record import DeathRecord
from ralph_runner.durable.json_value import JSON
from ralph_runner.output.text import shorten

# `Name: message` or `pkg.module.Name: message` where Name looks like an exception class.
EXCEPTION = re.compile(
    r"(?:^|(?<=[\s\]|:>]))"
    r"((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Fault|Failure|Warning))"
    r"(?::\s+\S.*|:?\s*$)"
)
# An exception line that names its cause elsewhere: the root cause is the line it points at.
POINTER = re.compile(r"(?i)see (?:the )?stack ?trace|above for the root cause|see above")
# A word an exception line must hold: a fast test that spares most log lines the full regex.
EXCEPTION_WORD = re.compile(r"Error|Exception|Exit|Interrupt|Fault|Failure|Warning")
LOG_COLLECTOR = re.compile(r"(?i)\blogs?\b|journal")

MASKS = (
    # timestamps: ISO, vLLM's `05-04 01:46:37`, bare clock times
    (
        re.compile(
            r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
            r"|\b\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?|\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?"
        ),
        "<time>",
    ),
    (re.compile(r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<id>"),
    (re.compile(r"(?i)\b0x[0-9a-f]+\b"), "<hex>"),
    # a hex id: 8+ hex digits with at least one digit and one letter (not a plain word or number)
    (re.compile(r"(?i)\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b"), "<hex>"),
    (re.compile(r"(?i)\b(pid[=: ]\s*|process \[?)\d+"), r"\1<pid>"),
    (re.compile(r"(?:(?<=^)|(?<=[\s\"'(=:,\[]))(?:~|\.{1,2})?/[^\s\"',:)\]]*"), "<path>"),
    (re.compile(r"(?<![\w.<])[-+]?\d+(?:\.\d+)*(?:[eE][-+]?\d+)?(?![\w>])"), "<num>"),
)
MAX_SIGNATURE = 300  # characters: a signature names a kind of death, not its whole message


def mask(line: str) -> str:
    """The line with what varies between deaths of one kind replaced by <num>, <hex>, ..."""
    for pattern, replacement in MASKS:
        line = pattern.sub(replacement, line)
    return shorten(" ".join(line.split()), MAX_SIGNATURE)


def exception_of(line: str) -> str | None:
    """The exception part of a log line (`AssertionError: ...`), without its logger prefix."""
    if not EXCEPTION_WORD.search(line):
        return None
    found = EXCEPTION.search(line)
    return found.group(0).strip() if found else None


def last_exception(lines: Iterable[str]) -> str | None:
    """The last exception line that is a cause, not a pointer to one; None when there is none."""
    found = pointer = None
    for line in lines:
        exception = exception_of(line)
        if exception is None:
            continue
        if POINTER.search(exception):
            pointer = exception
        else:
            found = exception
    return found or pointer


def of_probes(probes: Sequence[Mapping[str, Any]]) -> str | None:
    """`probe NAME: REASON` of the first failing probe (a status with its code)."""
    failing = next((p for p in probes if isinstance(p, dict) and not p.get("ok")), None)
    if failing is None:
        return None
    reason = failing.get("reason") or "failed"
    if reason == "status":
        code = re.match(r"HTTP (\d{3})", str(failing.get("detail") or ""))
        reason = f"status {code.group(1)}" if code else "status"
    return f"probe {failing.get('name') or failing.get('kind') or '?'}: {reason}"


def recorder_lines(record: DeathRecord) -> list[str] | None:
    """The followed log's lines since the previous recovery; None when nothing was followed."""
    section = record.get("recorder")
    if not isinstance(section, dict) or not section.get("log_source"):
        return None
    since = section.get("since_recovery")
    log = section.get("log")
    lines = [
        entry[1]
        for entry in (log if isinstance(log, list) else [])
        if isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[1], str)
        and (since is None or _at_or_after(entry[0], since))
    ]
    return lines or None


def _at_or_after(at: JSON, since: JSON) -> bool:
    return isinstance(at, int | float) and isinstance(since, int | float) and at >= since


def collector_logs(record: DeathRecord) -> list[tuple[str, str]]:
    """(name, output) of the collectors that hold a log, in the record's order."""
    found = []
    for collector in record.get("collectors") or []:
        if not isinstance(collector, dict):
            continue
        name, output = str(collector.get("name") or ""), collector.get("output")
        if LOG_COLLECTOR.search(name) and isinstance(output, str):
            found.append((name, output))
    return found


def of_record(record: DeathRecord) -> DeathRecord:
    """{"signature": ..., "signature_from": {"source", "line"}} for one death record."""
    followed = recorder_lines(record)
    sources = (
        [("recorder log", followed)]  # timestamped and complete: it alone decides
        if followed is not None
        else [(name, output.splitlines()) for name, output in collector_logs(record)]
    )
    for source, lines in sources:
        line = last_exception(lines)
        if line is not None:
            return {"signature": mask(line), "signature_from": {"source": source, "line": line}}
    probe = of_probes(record.get("probes") or [])
    if probe is not None:
        return {"signature": probe, "signature_from": {"source": "probes", "line": None}}
    return {"signature": "unknown", "signature_from": {"source": None, "line": None}}


def signature(record: DeathRecord) -> str:
    """The record's stored signature, or computed now for a record written before there were."""
    stored = record.get("signature")
    return stored if isinstance(stored, str) and stored else of_record(record)["signature"]
