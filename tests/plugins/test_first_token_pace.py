"""The first token's pace (plugins/first_token.py), as pure functions: which source sets it,
what counts as overhead, and the engine's steps counted since a request was sent."""

from __future__ import annotations

from ralph_runner.plugins.first_token import (
    CALIBRATION,
    ENGINE,
    STREAMED,
    WHOLE,
    EngineCounts,
    EngineMeter,
    Measure,
    expected,
    knows_pace,
)

NOW = 10_000.0


def test_the_most_precise_source_sets_the_pace_its_slowest_measure():
    measures = [
        Measure(WHOLE, 10.0, 1000, NOW),  # 10 ms a token: a whole answer, generation included
        Measure(ENGINE, 0.2, 1000, NOW),
        Measure(ENGINE, 0.5, 1000, NOW),  # the slowest of the engine's
        Measure(STREAMED, 0.3, 1000, NOW),
    ]
    found = expected(measures, 2000, NOW)
    assert found is not None and found.source == ENGINE and found.seconds == 1.0


def test_a_canary_is_overhead_not_pace():
    """A 10-token request's 20 ms would make a 3,000-token prompt 6 s as a pace; as overhead it
    is the least any prompt takes, and a prompt with no pace measured still has none."""
    canary = Measure(ENGINE, 0.02, 10, NOW)
    assert expected([canary], 3000, NOW) is None
    small = expected([canary], 50, NOW)
    assert small is not None and small.source == "overhead" and small.seconds == 0.02
    assert not knows_pace([canary], NOW)


def test_the_calibration_is_the_least_pace_and_outlives_the_window():
    """The prefix cache makes an agent's later prompts look fast; the calibration's uncached
    pace stays the least the engine's or streamed measures are taken to be, for the run."""
    calibrated = Measure(CALIBRATION, 1.0, 1000, NOW - 5000)  # an hour and more ago
    cached = Measure(STREAMED, 0.1, 30000, NOW)
    found = expected([calibrated, cached], 2000, NOW)
    assert found is not None and found.source == CALIBRATION and found.seconds == 2.0
    old = Measure(ENGINE, 5.0, 1000, NOW - 5000)  # out of the window: no longer counts
    assert expected([old], 1000, NOW) is None


def test_a_whole_answer_is_used_only_where_nothing_finer_measured():
    whole = Measure(WHOLE, 4.0, 2000, NOW)
    found = expected([whole], 1000, NOW)
    assert found is not None and found.source == WHOLE and found.seconds == 2.0
    found = expected([whole, Measure(STREAMED, 0.2, 2000, NOW)], 1000, NOW)
    assert found is not None and found.source == STREAMED


def test_the_engines_sums_measure_the_requests_prefilled_between_scrapes():
    meter = EngineMeter()
    assert meter.read(EngineCounts(1.0, 1000, 2, 10), NOW, idle=True) is None  # a first look
    measured = meter.read(EngineCounts(3.0, 5000, 4, 20), NOW + 1, idle=True)
    assert measured == Measure(ENGINE, 2.0, 4000, NOW + 1, 2.0)
    assert meter.read(EngineCounts(0.1, 10, 1, 1), NOW + 2, idle=True) is None  # a new server


def test_steps_since_a_request_count_from_an_idle_scrape_after_the_last_request_ended():
    meter = EngineMeter()
    meter.read(EngineCounts(None, None, None, 100), NOW, idle=True)
    meter.read(EngineCounts(None, None, None, 130), NOW + 2, idle=False)
    sent = NOW + 1
    assert meter.steps_since(sent, settled=0.0) == 30  # idle before it: every step since is its
    # a request of the loop's ended after that idle scrape: its steps may be among them
    assert meter.steps_since(sent, settled=NOW + 0.5) == 0
    meter.read(EngineCounts(None, None, None, 135), NOW + 4, idle=False)
    assert meter.steps_since(sent, settled=NOW + 0.5) == 5  # from the first scrape after it
