"""`-v` on a line without a newline (issue 29, finding 9): the pending partial line grew
without limit and was copied at every chunk, so one 80 MB line took 113 s with `-v` (1 s
without). Now the pending line is cut at 64 KiB and shown in pieces marked cut: the same 80 MB
line arrives as its 64 KiB pieces, every byte of it, and the run ends as quickly as the line is
written. (The time with and without `-v`: bench/long_line.py.)"""

from __future__ import annotations

import json
import sys

import pytest
from support.e2e import RalphRun, Scenario, runbook

from ralph_runner.process.output_text import CUT_MARK, LINE_CAP

pytestmark = pytest.mark.timeout(90)  # before: 113 s for the line alone

SIZE = 80_000_000
STEP = "one long line"


def test_an_80_mb_line_without_a_newline_comes_in_bounded_pieces(scenario: Scenario) -> None:
    scenario.prepare(["one item"])
    document = runbook()
    writer = f"import sys; sys.stdout.write('x' * {SIZE})"
    document["loop"]["steps"].insert(
        1, {"name": STEP, "shell": f"{sys.executable} -c {json.dumps(writer)}", "timeout": 80}
    )
    scenario.runbook_path.write_text(json.dumps(document))
    command = [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path), "--json", "-v"]
    run = RalphRun([*command, "-e", json.dumps(scenario.facts)], scenario.workspace)
    scenario.runs.append(run)
    assert run.wait(80) == 0, run.stderr

    pieces = [e["text"] for e in run.of("output") if e.get("step") == STEP]
    cut = [text for text in pieces if text.endswith(CUT_MARK)]
    assert len(cut) == SIZE // LINE_CAP, len(cut)
    assert all(len(text) == LINE_CAP + len(CUT_MARK) for text in cut)
    assert len(pieces) == len(cut) + 1  # the line's end, under 64 KiB, when the step ended
    assert sum(len(text.removesuffix(CUT_MARK)) for text in pieces) == SIZE
