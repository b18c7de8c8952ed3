"""C1 controls are controls (issue 37, lower findings): the one-character forms of CSI (U+009B)
and OSC (U+009D), which some terminals obey as ESC [ and ESC ], passed `-v` output and strike
reasons, where their C0 forms were already removed. A real agent prints them, and fails."""

from __future__ import annotations

import json
import sys

import pytest
from support.e2e import AGENT_STEP, RalphRun, Scenario

pytestmark = pytest.mark.timeout(120)

# "boom", CSI 2J (erase the screen), OSC 2;pwn BEL (set the title), NEL, "end": bash's printf
# writes them UTF-8 encoded, as a Python agent would
PRINTS = r"printf 'boom \302\2332J\302\2352;pwn\007 x\302\205 end\n'; exit 1"
C1 = [chr(c) for c in range(0x80, 0xA0)]


def test_c1_controls_reach_neither_verbose_output_nor_a_strike(scenario: Scenario) -> None:
    scenario.prepare(["one item"], after_agent=PRINTS, max_iterations=1)
    command = [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path), "--json", "-v"]
    run = RalphRun([*command, "-e", json.dumps(scenario.facts)], scenario.workspace)
    scenario.runs.append(run)
    run.wait(90)

    shown = [e["text"] for e in run.of("output") if e.get("step") == AGENT_STEP]
    strikes = [e["reason"] for e in run.of("strike")]
    assert "boom  x end" in shown, shown  # the two escapes gone whole, NEL with them
    assert strikes and all("boom x end" in reason for reason in strikes), strikes
    said = json.dumps(shown + strikes, ensure_ascii=False)
    assert not [c for c in C1 if c in said], said
