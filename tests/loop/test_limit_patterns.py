"""Usage limits as data (loop/limits.py): each known message, its reset time, the wait planned
for it, the countdown, the runbook's own patterns, and the console lines. Pure functions."""

from __future__ import annotations

import dataclasses
import threading
from datetime import datetime, timedelta

import pytest

from ralph_runner import events
from ralph_runner.fleet.notify import Notifier
from ralph_runner.loop import limits
from ralph_runner.output.lines import human_line
from ralph_runner.runbook import schema

NOW = 1_764_600_000.0  # 2025-12-01, a fixed "now" for every reset


def found(text: str, **kwargs) -> limits.Limit:
    limit = limits.find(text, now=NOW, **kwargs)
    assert limit is not None, text
    return limit


def test_claude_p_prints_the_epoch_it_resets_at():
    limit = found("Claude AI usage limit reached|1764612000")
    assert (limit.source, limit.reset_at) == ("claude", 1764612000)
    assert limit.evidence == "Claude AI usage limit reached|1764612000"
    assert found("Claude AI usage limit reached|1764612000123").reset_at == 1764612000.123


def test_claude_code_newer_wording_resets_at_a_time_of_day():
    limit = found("5-hour limit reached ∙ resets 3pm (Europe/London)")
    reset = datetime.fromtimestamp(limit.reset_at, limits.ZoneInfo("Europe/London"))
    assert (limit.source, reset.hour, reset.minute) == ("claude", 15, 0)
    assert 0 < limit.reset_at - NOW <= 86400


@pytest.mark.parametrize(
    "line",
    [
        # codex-rs's UsageLimitReached, as codex exec prints it (its binary holds these words)
        "ERROR: You’ve hit your usage limit. Upgrade to Plus to continue using Codex "
        "(https://chatgpt.com/explore/plus), or try again at 3:04 PM.",
        "You've hit your usage limit. Try again at 3:04 PM.",
    ],
)
def test_codex_says_the_time_of_day_it_resets(line):
    limit = found(line)
    reset = datetime.fromtimestamp(limit.reset_at)
    assert (limit.source, reset.hour, reset.minute) == ("codex", 15, 4)
    assert 0 < limit.reset_at - NOW <= 86400  # today's 3:04 PM, or tomorrow's once it passed


def test_codex_with_a_date_and_in_words():
    limit = found("You’ve hit your usage limit. Try again at Sep 5th, 2030 3:04 PM.")
    assert datetime.fromtimestamp(limit.reset_at) == datetime(2030, 9, 5, 15, 4)
    limit = found("You've hit your usage limit ... try again in 3 hours 12 minutes")
    assert limit.reset_at == NOW + 3 * 3600 + 12 * 60
    # no time at all (a workspace limit): found, the loop waits its default
    limit = found(
        "You’ve hit your usage limit. To get more access now, send a request to your admin"
    )
    assert (limit.source, limit.reset_at) == ("codex", None)


def test_codex_after_its_own_retries_on_a_429():
    limit = found("ERROR: exceeded retry limit, last status: 429 Too Many Requests")
    assert (limit.source, limit.reset_at) == ("codex", None)


def test_opencode_go_says_when_it_resets_or_nothing():
    text = (
        "Error: 5-hour usage limit reached. It will reset in 3 hours 12 minutes. To continue "
        "using this model now, enable usage from your available balance - https://opencode.ai/"
    )
    limit = found(text)
    assert (limit.source, limit.reset_at) == ("opencode", NOW + 3 * 3600 + 12 * 60)
    assert found("Usage limit reached. It will reset in 2 days 1 hour. To").reset_at == (
        NOW + 2 * 86400 + 3600
    )
    assert found("Usage limit reached. It will reset in less than a minute.").reset_at == NOW + 60
    limit = found("Usage limit reached. It will reset in . To continue using this model now")
    assert (limit.source, limit.reset_at) == ("opencode", None)


def test_aider_through_litellm_takes_the_reset_from_the_providers_words():
    text = (
        "litellm.RateLimitError: RateLimitError: OpenAIException - Error code: 429 - {'error': "
        "{'message': 'Rate limit reached for requests. Please try again in 20s.'}}\n"
        "The API provider has rate limited you. Try again later or check your quotas.\n"
        "Retrying in 0.2 seconds..."  # aider's own backoff, not the reset
    )
    limit = found(text)
    assert limit.source == "aider" and limit.reset_at == NOW + 20
    assert limit.evidence.startswith("The API provider has rate limited you")


@pytest.mark.parametrize(
    ("text", "after"),
    [
        ("HTTP/1.1 429 Too Many Requests\nRetry-After: 20", 20),
        ('Error: 429 Too Many Requests {"headers": {"retry-after": "45"}}', 45),
        ("APIError: status code 429\nretry-after: 7.5", 7.5),
        ("rate limit exceeded, retry after 20 seconds", 20),
        ("Rate limit exceeded, retry in 20s", 20),
        ("Error: Too Many Requests (429): please try again in 1.898s", 1.898),
    ],
)
def test_an_http_429_and_its_retry_after_in_seconds(text, after):
    limit = found(text)
    assert limit.source == "http-429" and limit.reset_at == pytest.approx(NOW + after)


def test_a_retry_after_http_date():
    limit = found("429 Too Many Requests\nRetry-After: Mon, 01 Dec 2025 15:20:00 GMT")
    assert limit.reset_at == datetime.fromisoformat("2025-12-01T15:20:00+00:00").timestamp()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Error: Model not found: vllm/qwen3",
        "implemented rate limiting middleware; 12 tests passed",
        "GET /v1/models 200 OK",
        "Retrying in 2.0 seconds...",  # a retry is no limit
    ],
)
def test_other_failures_are_no_limit(text):
    assert limits.find(text, now=NOW) is None


def test_the_last_line_that_matches_is_the_evidence():
    text = "429 Too Many Requests\nsomething else\nClaude AI usage limit reached|1764612000\nbye"
    assert found(text).source == "claude"


def test_a_runbooks_patterns_come_first():
    mine = limits.pattern(r"quota used up, back at (?P<reset>\d+)", "epoch", "my-proxy")
    limit = found("429 Too Many Requests\nquota used up, back at 1764603600", extra=[mine])
    assert (limit.source, limit.reset_at) == ("my-proxy", 1764603600)
    plain = limits.pattern(r"^LIMIT$")  # no reset of its own: the output's Retry-After
    assert found("Retry-After: 30\nLIMIT", extra=[plain]).reset_at == NOW + 30


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("20s", 20),
        ("1.5 s", 1.5),
        ("500ms", 0.5),
        ("3 hours 12 minutes", 3 * 3600 + 720),
        ("1h30m", 5400),
        ("2 days 3 hours", 2 * 86400 + 3 * 3600),
        ("1 hour and 5 minutes", 3900),
        ("an hour", 3600),
        ("less than a minute", 60),
        ("soon", None),
    ],
)
def test_durations(text, seconds):
    assert limits.duration(text) == seconds


def test_clock_is_the_next_time_it_names():
    today = datetime(2030, 6, 1, 10, 0)
    now = today.timestamp()
    assert limits.clock("3:04 PM", now) == today.replace(hour=15, minute=4).timestamp()
    tomorrow = today.replace(hour=9) + timedelta(days=1)
    assert limits.clock("9am", now) == tomorrow.timestamp()
    assert (
        limits.clock("12:30 AM", now)
        == (today.replace(hour=0, minute=30) + timedelta(1)).timestamp()
    )
    assert limits.clock("Jun 2nd 9:15 AM", now) == datetime(2030, 6, 2, 9, 15).timestamp()
    assert limits.clock("at noon", now) is None


def test_plan_waits_until_the_reset_plus_the_margin():
    limit = limits.Limit(NOW + 20, "x", "claude")
    wait = limits.plan(limit, now=NOW, since=NOW, max_wait=3600, default_wait=900, margin=10)
    assert (wait.until, wait.seconds, wait.guessed, wait.ends_run) == (NOW + 30, 30, False, False)
    past = limits.Limit(NOW - 100, "x", "claude")  # already reset: the margin only
    wait = limits.plan(past, now=NOW, since=NOW, max_wait=3600, default_wait=900, margin=10)
    assert wait.seconds == 10 and not wait.ends_run
    unknown = limits.Limit(None, "x", "http-429")
    wait = limits.plan(unknown, now=NOW, since=NOW, max_wait=3600, default_wait=900, margin=10)
    assert (wait.reset_at, wait.guessed) == (NOW + 900, True)


def test_plan_stops_past_max_wait_counted_from_the_first_limited_attempt():
    far = limits.Limit(NOW + 7200, "x", "claude")
    wait = limits.plan(far, now=NOW, since=NOW, max_wait=3600, default_wait=900, margin=10)
    assert wait.ends_run
    near = limits.Limit(NOW + 600, "x", "claude")  # near, but limited for an hour already
    wait = limits.plan(near, now=NOW, since=NOW - 3300, max_wait=3600, default_wait=900, margin=1)
    assert wait.ends_run
    message = limits.stop_message(near, wait, NOW - 3300, 3600)
    assert limits.when(NOW + 600) in message and "max_wait (1 h)" in message
    assert f"Run again after {limits.when(NOW + 601)}" in message


class FakeClock:
    """A clock that moves only when the stop event is waited on."""

    def __init__(self) -> None:
        self.now = NOW
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now


class FakeStop(threading.Event):
    def __init__(self, clock: FakeClock, set_after: int | None = None) -> None:
        super().__init__()
        self.clock, self.set_after = clock, set_after

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.clock.waits.append(timeout)
        self.clock.now += timeout
        return self.set_after is not None and len(self.clock.waits) >= self.set_after


def test_wait_out_counts_down_at_most_once_a_minute():
    clock = FakeClock()
    said: list[float] = []
    assert limits.wait_out(NOW + 150, FakeStop(clock), said.append, clock_=clock)
    assert clock.waits == [60, 60, 30] and said == [90, 30]
    clock = FakeClock()
    assert not limits.wait_out(NOW + 150, FakeStop(clock, set_after=1), said.append, clock_=clock)
    assert clock.waits == [60]


def test_span():
    assert [limits.span(s) for s in (0, 45, 60, 75, 3600, 3600 + 720)] == [
        "0 s",
        "45 s",
        "1 min",
        "1 min 15 s",
        "1 h",
        "1 h 12 min",
    ]


def test_the_limits_key_defaults_and_checks_its_patterns():
    config = schema.Limits()
    assert (config.max_wait, config.default_wait, config.margin, config.exit_code) == (
        14400,
        900,
        10,
        7,
    )
    with pytest.raises(ValueError, match="does not compile"):
        schema.LimitPattern(regex="(unclosed")
    with pytest.raises(ValueError, match=r"needs a group \(\?P<reset>"):
        schema.LimitPattern(regex="limit", reset="epoch")
    assert schema.LimitPattern(regex=r"back at (?P<reset>\d+)", reset="epoch").source == "runbook"
    assert "limited" in schema.NOTIFY_EVENTS


def test_the_console_lines():
    def paint(colour: str, text: str) -> str:
        return text

    waiting = events.UsageLimitHit(
        item="first",
        source="claude",
        line="Claude AI usage limit reached|1764612000",
        reset_at=1764612000.0,
        until=1764612010.0,
        reset="2025-12-01T18:00:00+00:00",
        seconds=3725,
        guessed=False,
        ends_run=False,
    )
    line = str(human_line(waiting, paint))
    assert "usage limit (claude): Claude AI usage limit reached|1764612000" in line
    assert "it resets at 2025-12-01T18:00:00+00:00: waiting 1 h 2 min, then the item again" in line
    stopped = dataclasses.replace(waiting, ends_run=True, exit_code=7)
    assert "stopped (exit 7)" in str(human_line(stopped, paint))
    guessed = dataclasses.replace(waiting, guessed=True)
    assert "no reset time given" in str(human_line(guessed, paint))
    tick = events.LimitedWait(item="first", seconds=125, until="2025-12-01T18:00:10+00:00")
    assert str(human_line(tick, paint)).strip().startswith("⏳ usage limit: 2 min 5 s left")


def test_the_notification():
    limited = events.UsageLimitHit(
        item="first",
        source="codex",
        line="You’ve hit your usage limit. Try again at 3:04 PM.",
        reset_at=1764601440.0,
        until=1764601500.0,
        reset="2025-12-01T15:04:00+00:00",
        seconds=610,
        guessed=False,
        ends_run=False,
    )
    host = type("Host", (), {"host": "gpu-1"})()
    message = Notifier._message(host, limited)  # type: ignore[arg-type]
    assert message is not None and message.event == "limited"
    assert message.title == "ralph-run: usage limit on gpu-1"
    assert "resets at 2025-12-01T15:04:00+00:00; waiting 610 s, then 'first' again" in message.body
    stopped = dataclasses.replace(limited, ends_run=True, exit_code=7)
    ended = Notifier._message(host, stopped)  # type: ignore[arg-type]
    assert ended is not None and "stopped (exit 7): run again later" in ended.body
