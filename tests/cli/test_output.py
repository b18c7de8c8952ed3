"""The event stream: listeners see every event, masked; a broken listener is dropped, not fatal."""

import io

from ralph_runner import events
from ralph_runner.durable.redaction import Redactor
from ralph_runner.output.bus import EventBus
from ralph_runner.output.console import Console


class Seen:
    def __init__(self, broken: bool = False) -> None:
        self.events: list[events.Event] = []
        self.broken = broken

    def on_event(self, event: events.Event) -> None:
        self.events.append(event)
        if self.broken:
            raise RuntimeError("boom")


def test_followers_get_masked_events_and_a_failing_one_is_dropped():
    stream = io.StringIO()
    bus = EventBus(Console(json_lines=True, stream=stream), Redactor(["hunter22"]))
    seen, broken = Seen(), Seen(broken=True)
    bus.follow(seen)
    bus.follow(broken)
    bus.emit(events.Done(item="pass hunter22"))
    bus.emit(events.Done(item="second"))
    assert seen.events[0] == events.Done(item="pass ****")
    assert broken.events == [events.Done(item="pass ****")]  # dropped after its first failure
    assert isinstance(seen.events[1], events.Warned)
    assert seen.events[-1] == events.Done(item="second")
    assert "event listener" in stream.getvalue()


def human(kind: str, **fields) -> str:
    stream = io.StringIO()
    EventBus(Console(stream=stream)).emit(events.from_json({"event": kind, **fields}))
    return stream.getvalue()


def test_a_failed_recovery_attempt_says_why_and_how_long_until_the_next():
    line = human("recovery-failed", attempt=1, reason="exit 1", retry_in=30)
    assert line.endswith("]   attempt 1 failed (exit 1): retrying in 30 s\n")
    last = human("recovery-failed", attempt=3, reason="not healthy within 60 s", retry_in=None)
    assert "attempt 3 failed (not healthy within 60 s): no attempt left" in last


def test_a_failed_step_never_reads_exit_none():
    common = {"step": "verify", "ok": False, "timed_out": False, "seconds": 0.01, "status": ""}
    assert "exit None" not in human("step-done", exit_code=None, killed=False, **common)
    shown = human(
        "step-done", exit_code=None, killed=False, **{**common, "status": "no new commit"}
    )
    assert shown.rstrip().endswith("✗ verify 0.0s no new commit")
    assert "killed" in human("step-done", exit_code=None, killed=True, **common)


def test_counts_of_one_are_singular_in_the_receipt_and_the_throughput_line():
    """Issue 31, item 8: "1 requests" read wrong wherever a count was printed."""
    from ralph_runner.deaths import text

    spent = {"request_errors": 0, "tokens_estimated": False, "first_token_seconds": None}
    spent |= {"generation_seconds": 1.0, "request_seconds": 1.0, "iteration": 1, "item": "a"}
    one = human("receipt", requests=1, prompt_tokens=10, generated_tokens=2, **spent)
    assert "🧾 1 request: 10 prompt + 2 generated tokens" in one
    two = human("receipt", requests=2, prompt_tokens=1, generated_tokens=1, **spent)
    assert "🧾 2 requests:" in two
    throughput = {
        "items_per_hour": 1.0,
        "items_done": 1,
        "running_seconds": 3600,
        "tokens_per_item": 12,
        "prompt_tokens_per_item": 10,
        "generated_tokens_per_item": 2,
        "requests": 1,
        "estimated": 0,
    }
    assert "generated; 1 request)" in text.throughput_line(throughput)


def test_the_summary_says_one_iteration_and_one_death_in_the_singular():
    """Issue 42, newcomer item 9: "1 iterations", "1 deaths" in the run's last line."""
    counts = {"stopped_at_max": False, "done": 1, "todo": 0, "skipped": 0, "signatures": {}}
    one = human("summary", iterations=1, deaths=1, seconds=2.0, **counts)
    assert "finished: 1 iteration, 1 done" in one and ", 1 death, 2.0s" in one, one
    many = human("summary", iterations=10, deaths=2, seconds=2.0, **counts)
    assert "10 iterations" in many and "2 deaths" in many, many
