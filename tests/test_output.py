"""The event stream: listeners see every event, masked; a broken listener is dropped, not fatal."""

import io

from ralph_runner.output import Output
from ralph_runner.reports import Redactor


def test_listeners_get_masked_events_and_a_failing_one_is_dropped():
    stream = io.StringIO()
    output = Output(json_lines=True, stream=stream, redactor=Redactor(["hunter22"]))
    seen = []
    calls = []

    def broken(kind, fields):
        calls.append(kind)
        raise RuntimeError("boom")

    output.subscribe(lambda kind, fields: seen.append((kind, fields)))
    output.subscribe(broken)
    output.event("done", item="pass hunter22")
    output.event("done", item="second")
    assert seen[0] == ("done", {"item": "pass ****"})
    assert calls == ["done"]  # dropped after its first failure
    assert ("warning" in [kind for kind, _ in seen]) and seen[-1] == ("done", {"item": "second"})
    assert "event listener" in stream.getvalue()
