"""Usage limits: an agent that hit its provider's limit is waited out, not struck.

Why: a subscription's usage window (Claude's, ChatGPT's for codex, OpenCode Go's) or an
endpoint's HTTP 429 says nothing about the item or the agent's set-up: the same agent does the
same item once the limit resets. Counted as failures, two such items in a row looked like a
broken agent (exit 6) in the middle of the night. So a failed attempt whose output says "limit"
in one of the known ways below is no strike and no failure for the broken-agent rule: the loop
waits until the reset (plus a margin) and retries the item, or, when the reset is further away
than `limits.max_wait`, stops with its own exit code and says when to come back.

The messages are data (`KNOWN`, each from the agent's own source; a runbook adds its own with
`limits.patterns`); `find` is a pure function of a step's cleaned output, `plan` of a limit and
the runbook's `limits:`, so both are tested without a process. `wait_out` is the wait itself:
the loop's stop event, a countdown at most once a minute.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ralph_runner.output.durations import span
from ralph_runner.output.text import shorten

ResetKind = Literal["epoch", "duration", "retry-after", "clock", "none"]
EVIDENCE_CHARS = 200
COUNTDOWN_EVERY = 60.0  # seconds between two countdown lines of one wait

# A duration as agents print it: "3 hours 12 minutes", "20s", "1.898s", "1h30m", "2 days".
_UNIT = r"(?:ms|milliseconds?|seconds?|secs?|minutes?|mins?|hours?|hrs?|days?|s|m|h|d)(?![a-z])"
DURATION = (
    rf"(?:\d+(?:\.\d+)?\s*{_UNIT}(?:[\s,]*(?:and\s+)?\d+(?:\.\d+)?\s*{_UNIT})*"
    r"|less than a minute|an? (?:minute|hour))"
)
# A time of day, maybe with a date: codex's "3:04 PM", "Sep 5th, 2025 3:04 PM"; "3pm".
CLOCK = (
    r"(?:[A-Z][a-z]{2} \d{1,2}(?:st|nd|rd|th)?,? (?:\d{4},? )?(?:at )?)?"
    r"\d{1,2}(?::\d{2})?\s?[AaPp]\.?[Mm]\.?(?: \([A-Za-z_]+/[A-Za-z_/+-]+\))?"
)
HTTP_DATE = r"[A-Z][a-z]{2}, \d{1,2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT"


@dataclass(frozen=True)
class Pattern:
    """One way of saying "limit": `regex` searched in each line; its group `reset` (if any)
    read as `reset` says. Without a reset of its own, the output's other lines are searched
    for one (`RESETS`: a Retry-After header, "try again in 20s", ...)."""

    source: str
    regex: re.Pattern[str]
    reset: ResetKind = "none"


@dataclass(frozen=True)
class Limit:
    """A usage limit found in a step's output: when it resets (epoch seconds; None when the
    message does not say), the line that says so, and whose message it is."""

    reset_at: float | None
    evidence: str
    source: str


def _p(source: str, regex: str, reset: ResetKind = "none") -> Pattern:
    return Pattern(source, re.compile(regex, re.IGNORECASE), reset)


# The messages of the agents with recipes (runbooks/agents/) and of claude code, newest first
# where an agent has several. Where each comes from is in docs/agents.md "Agents that fail".
KNOWN: tuple[Pattern, ...] = (
    # claude -p: "Claude AI usage limit reached|1764612000" (the reset's epoch), exit 1
    _p("claude", r"Claude AI usage limit reached\|(?P<reset>\d{9,13})", "epoch"),
    # claude code's newer wordings, from its users' reports (the binary builds them from parts):
    # "5-hour limit reached ∙ resets 3pm (Europe/London)", "You've hit your limit · resets 10pm
    # (America/New_York)", "Claude usage limit reached. Your limit will reset at 3pm
    # (Europe/London)."; the zone named is the one the time is in
    _p("claude", rf"(?:limit reached|hit your limit)\s*\W\s*resets (?P<reset>{CLOCK})", "clock"),
    _p("claude", rf"limit reached\b.*\bwill reset at (?P<reset>{CLOCK})", "clock"),
    # claude code 2.1.332 once its retries are spent on a 429 (checked against the binary):
    # "API Error: Request rejected (429) · <the body's error.message>"; older ones print
    # "API Error: 429 {"type":"error","error":{"type":"rate_limit_error",...}}". The header
    # retry-after is not printed: a reset comes from the message's words (RESETS), else
    # limits.default_wait. Only after "API Error:": a bare rate_limit_error is any agent's 429
    # body (the http-429 patterns below)
    _p("claude", r"API Error:.{0,40}\b429\b"),
    # codex (codex-rs): "You’ve hit your usage limit. Upgrade to Plus ..., or try again at
    # 3:04 PM." / "... Try again at Sep 5th, 2025 3:04 PM." / "... try again in 3 hours."
    _p("codex", rf"You[’']ve hit your usage limit.*try again at (?P<reset>{CLOCK})", "clock"),
    _p("codex", rf"You[’']ve hit your usage limit.*try again in (?P<reset>{DURATION})", "duration"),
    _p("codex", r"You[’']ve (?:hit|reached) your usage limit"),
    # codex once its own retries are spent on a 429: "exceeded retry limit, last status: 429
    # Too Many Requests"
    _p("codex", r"exceeded retry limit, last status: 429"),
    # opencode (OpenCode Go): "Usage limit reached. It will reset in 3 hours 12 minutes. ..."
    # ("5-hour usage limit reached. ..."; "in ." when the server sent no retry-after)
    _p("opencode", rf"usage limit reached\. It will reset in (?P<reset>{DURATION})", "duration"),
    _p("opencode", r"usage limit reached\. It will reset in"),
    # aider (litellm): "litellm.RateLimitError: RateLimitError: OpenAIException - Error code:
    # 429 - {...}", then "The API provider has rate limited you. Try again later or check your
    # quotas." (aider exits 0 after it: verify then fails)
    _p("aider", r"litellm\.RateLimitError|The API provider has rate limited you"),
    # Any agent on an OpenAI-compatible endpoint: an HTTP 429 as it prints it.
    _p("http-429", r"\b429\b.{0,40}Too Many Requests|Too Many Requests.{0,40}\b429\b"),
    _p("http-429", r"(?:status(?: code)?|error code|HTTP/[\d.]+)\W{0,3}429\b"),
    _p("http-429", r"\brate[ _-]?limit(?:ed| exceeded| reached)\b|\bToo Many Requests\b"),
)

# Where a limit message says no reset of its own, these say it elsewhere in the output, first
# the most exact: a Retry-After header (seconds or an HTTP date), then the words around it.
RESETS: tuple[tuple[re.Pattern[str], ResetKind], ...] = (
    (
        re.compile(
            rf"retry[-_]after[\"']?\s*[:=]\s*[\"']?(?P<reset>{HTTP_DATE}|\d+(?:\.\d+)?)(?![\d.])",
            re.IGNORECASE,
        ),
        "retry-after",
    ),
    (re.compile(rf"try again in (?P<reset>{DURATION})", re.IGNORECASE), "duration"),
    (re.compile(rf"resets? in (?P<reset>{DURATION})", re.IGNORECASE), "duration"),
    (re.compile(rf"(?:try again|resets?) at (?P<reset>{CLOCK})", re.IGNORECASE), "clock"),
    (re.compile(rf"\bretry (?:after|in) (?P<reset>{DURATION})", re.IGNORECASE), "duration"),
    (
        re.compile(r"\bretry (?:after|in) (?P<reset>\d+(?:\.\d+)?)(?![\d.])", re.IGNORECASE),
        "retry-after",
    ),
)


def pattern(regex: str, reset: ResetKind = "none", source: str = "runbook") -> Pattern:
    """A runbook's own pattern (`limits.patterns`); the schema has checked that it compiles."""
    return Pattern(source, re.compile(regex), reset)


def find(output: str, extra: Iterable[Pattern] = (), now: float | None = None) -> Limit | None:
    """The usage limit a failed step's cleaned output reports, or None. The last line that
    matches is the evidence (a runbook's patterns before the known ones); its reset is its own
    group `reset`, else the first of `RESETS` found in the output."""
    now = time.time() if now is None else now
    patterns = (*extra, *KNOWN)
    lines = [line.strip() for line in output.split("\n") if line.strip()]
    for line in reversed(lines):
        for candidate in patterns:
            found = candidate.regex.search(line)
            if found is None:
                continue
            reset_at = None
            if candidate.reset != "none" and "reset" in candidate.regex.groupindex:
                reset_at = reset_time(found.group("reset") or "", candidate.reset, now)
            if reset_at is None:
                reset_at = _reset_in(lines, now)
            return Limit(
                reset_at, shorten(" ".join(line.split()), EVIDENCE_CHARS), candidate.source
            )
    return None


def _reset_in(lines: Sequence[str], now: float) -> float | None:
    for regex, kind in RESETS:
        for line in reversed(lines):
            found = regex.search(line)
            if found is not None:
                reset_at = reset_time(found.group("reset"), kind, now)
                if reset_at is not None:
                    return reset_at
    return None


def reset_time(text: str, kind: ResetKind, now: float) -> float | None:
    """`text` read as `kind`, as an epoch; None when it cannot be read."""
    text = text.strip()
    if not text or kind == "none":
        return None
    try:
        if kind == "epoch":
            value = float(text)
            return value / 1000 if value > 1e12 else value  # milliseconds
        if kind == "duration":
            seconds = duration(text)
            return None if seconds is None else now + seconds
        if kind == "retry-after":
            if re.fullmatch(r"\d+(?:\.\d+)?", text):
                return now + float(text)
            return parsedate_to_datetime(text).timestamp()
        return clock(text, now)
    except (ValueError, TypeError, OverflowError):
        return None


_UNITS = {"ms": 0.001, "millisecond": 0.001, "s": 1, "sec": 1, "second": 1}
_UNITS |= {"m": 60, "min": 60, "minute": 60, "h": 3600, "hr": 3600, "hour": 3600}
_UNITS |= {"d": 86400, "day": 86400}


def duration(text: str) -> float | None:
    """Seconds in "3 hours 12 minutes", "20s", "1h30m", "less than a minute"; None if none."""
    text = text.strip().lower()
    if text in ("less than a minute", "a minute", "an minute"):
        return 60.0
    if text in ("an hour", "a hour"):
        return 3600.0
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text)
    total, seen = 0.0, False
    for number, unit in parts:
        factor = _UNITS.get(unit) or _UNITS.get(unit.rstrip("s"))
        if factor is None:
            continue
        total, seen = total + float(number) * factor, True
    return total if seen else None


_MONTHS = {
    month: number
    for number, month in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1
    )
}
_CLOCK = re.compile(
    r"(?:(?P<month>[a-z]{3}) (?P<day>\d{1,2})(?:st|nd|rd|th)?,? (?:(?P<year>\d{4}),? )?(?:at )?)?"
    r"(?P<hour>\d{1,2})(?::(?P<minute>\d{2}))?\s?(?P<ampm>[ap])\.?m\.?"
    r"(?: \((?P<tz>[a-z_]+/[a-z_/+-]+)\))?",
    re.IGNORECASE,
)


def clock(text: str, now: float) -> float | None:
    """A time of day (local, or in the named zone), maybe with a date, as the next epoch it
    names: "3:04 PM" is today's, or tomorrow's once it has passed."""
    found = _CLOCK.fullmatch(text.strip())
    if found is None:
        return None
    zone = None
    if found["tz"]:
        try:
            zone = ZoneInfo(found["tz"])
        except (ZoneInfoNotFoundError, ValueError):
            zone = None
    current = datetime.fromtimestamp(now, zone) if zone else datetime.fromtimestamp(now)
    hour = int(found["hour"]) % 12 + (12 if found["ampm"].lower() == "p" else 0)
    minute = int(found["minute"] or 0)
    if found["month"]:
        month = _MONTHS.get(found["month"].lower())
        if month is None:
            return None
        year = int(found["year"] or current.year)
        moment = current.replace(year=year, month=month, day=int(found["day"]))
        moment = moment.replace(hour=hour, minute=minute, second=0, microsecond=0)
        if found["year"] is None and moment.timestamp() < now - 86400:
            moment = moment.replace(year=year + 1)
        return moment.timestamp()
    moment = current.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if moment.timestamp() <= now:
        moment += timedelta(days=1)
    return moment.timestamp()


@dataclass(frozen=True)
class Wait:
    """What the loop does about a limit: wait until `until`, or stop (`ends_run`)."""

    reset_at: float  # the reset (or now + default_wait when the message gave none)
    until: float  # reset_at plus the margin: when the item is tried again
    seconds: float  # from now to `until`
    guessed: bool  # the message gave no reset time: default_wait
    ends_run: bool  # beyond max_wait (counted from the first limited attempt of the streak)


def plan(
    limit: Limit,
    *,
    now: float,
    since: float,
    max_wait: float,
    default_wait: float,
    margin: float,
) -> Wait:
    """The wait for `limit` found at `now`, in a streak of limited attempts that began at
    `since`: a reset already past is waited for by the margin only."""
    guessed = limit.reset_at is None
    reset_at = now + default_wait if limit.reset_at is None else max(limit.reset_at, now)
    until = reset_at + margin
    return Wait(reset_at, until, until - now, guessed, ends_run=reset_at - since > max_wait)


def wait_out(
    until: float,
    stop: threading.Event,
    countdown: Callable[[float], None],
    every: float = COUNTDOWN_EVERY,
    clock_: Callable[[], float] = time.time,
) -> bool:
    """Sleep until the epoch `until` on `stop` (a signal's Interrupted is raised out of the
    wait; a set `stop` ends it early: False), calling `countdown(seconds left)` at most once
    every `every` seconds. True when the time came."""
    while True:
        left = until - clock_()
        if left <= 0:
            return True
        if stop.wait(min(every, left)):
            return False
        left = until - clock_()
        if left > 1:
            countdown(left)


def stop_message(limit: Limit, wait: Wait, since: float, max_wait: float) -> str:
    """Why a limit ended the run, and when to come back."""
    reset = "no reset time given" if wait.guessed else f"it resets at {when(wait.reset_at)}"
    waited = wait.reset_at - since - wait.seconds + (wait.until - wait.reset_at)
    streak = f", limited since {when(since)}" if waited >= 1 else ""
    return (
        f"the agent hit a usage limit ({limit.source}: {limit.evidence!r}): {reset}"
        f"{streak}, more than limits.max_wait ({span(max_wait)}) away; stopped with no strike. "
        f"Run again after {when(wait.until)}."
    )


def when(epoch: float) -> str:
    """An epoch as local ISO time, to the second: what a person reads in messages."""
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")
