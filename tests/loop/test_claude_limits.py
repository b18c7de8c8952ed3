"""Claude Code's usage-limit wordings (loop/limits.py) read into a reset time, its time zone
included: the epoch form of `claude -p`, the "will reset at" and "resets" time-of-day forms in
a named zone, and a 429 `rate_limit_error` as the real binary prints it. Pure functions."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from ralph_runner.loop import limits

NOW = 1_764_600_000.0  # 2025-12-01 14:40 UTC (09:40 in New York, 14:40 in London)


def found(text: str) -> limits.Limit:
    limit = limits.find(text, now=NOW)
    assert limit is not None, text
    return limit


def in_zone(epoch: float | None, zone: str) -> datetime:
    assert epoch is not None
    return datetime.fromtimestamp(epoch, ZoneInfo(zone))


def test_the_epoch_form_resets_at_that_epoch():
    limit = found("Claude AI usage limit reached|1764612000")
    assert (limit.source, limit.reset_at) == ("claude", 1764612000)


def test_will_reset_at_3pm_in_london_is_today_at_15_00_london_time():
    limit = found("Claude usage limit reached. Your limit will reset at 3pm (Europe/London).")
    reset = in_zone(limit.reset_at, "Europe/London")
    assert (limit.source, reset.hour, reset.minute) == ("claude", 15, 0)
    assert (
        limit.reset_at == datetime(2025, 12, 1, 15, 0, tzinfo=ZoneInfo("Europe/London")).timestamp()
    )


def test_hit_your_limit_resets_10pm_new_york_is_that_time_in_new_york():
    limit = found("You've hit your limit · resets 10pm (America/New_York)")
    reset = in_zone(limit.reset_at, "America/New_York")
    assert (limit.source, reset.day, reset.hour) == ("claude", 1, 22)
    # 22:00 in New York is 03:00 the next day in UTC: the zone, not the machine's clock, counts
    assert in_zone(limit.reset_at, "UTC").hour == 3


def test_a_time_already_past_in_its_zone_is_tomorrows():
    limit = found("You've hit your limit · resets 9am (America/New_York)")  # 09:40 there now
    reset = in_zone(limit.reset_at, "America/New_York")
    assert (reset.day, reset.hour) == (2, 9)


@pytest.mark.parametrize(
    "output, seconds",
    [
        # claude code 2.1.332 after its retries, the stand-in's 429 body (its message's words)
        ("API Error: Request rejected (429) · Rate limited by the stand-in: retry after 20 s.", 20),
        # an older claude: the body as JSON, a Retry-After header in a debug line before it
        (
            "retry-after: 90\n"
            'API Error: 429 {"type":"error","error":{"type":"rate_limit_error",'
            '"message":"Number of request tokens has exceeded your per-minute rate limit"}}',
            90,
        ),
    ],
)
def test_a_429_rate_limit_error_resets_after_what_it_says(output: str, seconds: int):
    limit = found(output)
    assert limit.source == "claude"
    assert limit.reset_at == NOW + seconds


def test_a_429_that_says_no_time_is_a_limit_with_no_reset():
    limit = found('API Error: Request rejected (429) · {"type":"rate_limit_error"}')
    assert (limit.source, limit.reset_at) == ("claude", None)  # limits.default_wait then


def test_other_api_errors_are_no_limit():
    assert limits.find("API Error: Request rejected (400) · bad request", now=NOW) is None
    assert limits.find("API Error: 500 internal_error", now=NOW) is None
