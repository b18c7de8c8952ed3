"""Two workers on the real vLLM (`ralph-run runbooks/vllm-local.yaml --workers 2`), its engine
killed while both attempts call it: one death, one restart, both items land, no strike.

The runbook is the shipped one, unchanged: `-e` points it at the session's engine (the 8-layer
model, `--max-num-seqs 1`: one request generates, the other waits in vLLM's queue, and vLLM's
death fails both) and replaces the agent with AGENT: the stand-in agent's call, then the item's
file, its tick and a commit, as a real agent in a worktree does (a file of its own per item:
the stand-in agent alone only ticks). Each item's first call asks for far more tokens than the
test waits for, so both are in flight when the engine is killed; the retries ask for 16.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_helpers import RUNBOOK, SERVED_NAME, Engine, gone, wait_until
from support.e2e import RalphRun, make_workspace

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

AGENT_STEP = "run the agent"
FIRST_CALL_TOKENS = 20000  # ~100 s of the 8-layer model alone: cut by the kill
RUN_TIMEOUT = 420  # s for the run, one cold restart included
AGENT = r"""#!/bin/bash
# $1: the prompt; its item follows "and commit: " (runbooks/vllm-local.yaml's prompt).
item=$(printf '%s\n' "$1" | sed -n 's/.*and commit: //p' | head -n 1)
[ -n "$item" ] || { echo "no item in the prompt" >&2; exit 2; }
name=$(printf '%s' "$item" | tr ' ' _)
tokens=16
[ -e "$MARKS/$name" ] || { touch "$MARKS/$name"; tokens=$FIRST_CALL_TOKENS; }
"$PYTHON" -m ralph_runner.standin.agent --url "$URL" --model "$MODEL" --timeout 600 \
  --checklist /dev/null --no-commit --max-tokens "$tokens" -- x || exit 1
echo "$item" > "$name.txt"
sed -i "s/^- \[ \] $item\$/- [x] $item/" CHECKLIST.md
git add -A && git commit -qm "work: $item"
"""


def agent_command(root: Path, engine: Engine) -> str:
    """The `agent` variable: AGENT with its settings (the runbook appends the prompt)."""
    script = root / "agent.sh"
    script.write_text(AGENT)
    script.chmod(0o755)
    marks = root / "first-calls"
    marks.mkdir()
    settings = {
        "MARKS": str(marks),
        "FIRST_CALL_TOKENS": str(FIRST_CALL_TOKENS),
        "PYTHON": sys.executable,
        "URL": engine.url,
        "MODEL": SERVED_NAME,
    }
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items()) + f" {script}"


def records(work: Path, kind: str) -> list[dict[str, Any]]:
    path = work / "logs" / "vllm-deaths.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == kind]


def queued_or_running(engine: Engine) -> float:
    """Requests in the engine, running or waiting; 0 when a scrape fails (a CPU engine that
    generates can starve its API server)."""
    try:
        sums = engine.metrics()
    except httpx.HTTPError:
        return 0
    return sums.get("vllm:num_requests_running", 0) + sums.get("vllm:num_requests_waiting", 0)


def test_two_workers_engine_killed_while_both_call_it(
    healthy_engine: Engine, tmp_path: Path
) -> None:
    work = make_workspace(tmp_path / "work", ["kill one", "kill two"])
    facts = {**healthy_engine.facts, "agent": agent_command(tmp_path, healthy_engine)}
    command = [sys.executable, "-m", "ralph_runner", str(RUNBOOK), "--json", "--workers", "2"]
    run = RalphRun([*command, "-e", json.dumps(facts)], work)
    try:
        run.wait_status(
            lambda s: sum(w["phase"] == AGENT_STEP for w in s.get("workers") or []) == 2,
            "both workers in their agent step",
            timeout=120,
        )
        wait_until(lambda: queued_or_running(healthy_engine) >= 2, 120, "both requests in vLLM")
        before = healthy_engine.serving()
        healthy_engine.signal_engine(signal.SIGKILL)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == 0, f"exit {code}: {run.events[-5:]} {run.stderr[-2000:]}"
    text = (work / "CHECKLIST.md").read_text(encoding="utf-8")
    assert text == "- [x] kill one\n- [x] kill two\n", text
    assert sorted(e["item"] for e in run.of("worker-landed")) == ["kill one", "kill two"]
    for item in ("kill one", "kill two"):
        assert (work / f"{item.replace(' ', '_')}.txt").read_text() == f"{item}\n"
        outcomes = [e["outcome"] for e in run.of("iteration-ended", item=item)]
        assert outcomes == ["death", "done"], (item, outcomes)  # in flight at the kill
    deaths = records(work, "death")
    assert len(deaths) == 1, [(d["phase"], d.get("reason")) for d in deaths]
    assert len(run.of("death")) == 1
    (recovery,) = records(work, "recovery")
    assert recovery["recovered"] is True, recovery
    started = [s["name"] for s in recovery["steps"] if not s["skipped"]]
    assert started == ["start vLLM"], recovery["steps"]  # one restart
    assert not run.of("strike")
    state = json.loads((work / ".ralph" / "state.json").read_text())
    assert not any(state.get("strikes", {}).values()), state
    assert healthy_engine.replaced(before), ("the server was not restarted", before)
    assert wait_until(lambda: not gone(before[1]), 15, "the old server's group to end")
