"""A failed recovery step is shown with the line that explains it (issue 21): a start script
that wraps vLLM prints the server's traceback, whose root cause lies above its last line."""

from __future__ import annotations

import contextlib
import sys

import httpx
import yaml
from support.e2e import Scenario, runbook

VLLM_CPU_MEMORY = [
    "starting vLLM on http://127.0.0.1:8000",
    "Traceback (most recent call last):",
    '  File "cpu_worker.py", line 88, in init_device',
    "ValueError: Available memory on node 0 (8.19/9.59 GiB) on startup is less than desired"
    " CPU memory utilization (0.92, 8.82 GiB)",
    "RuntimeError: Engine core initialization failed. See root cause above.",
    "vLLM exited during start-up",
]


def test_a_failed_start_names_vllms_root_cause(scenario: Scenario) -> None:
    book = runbook(attempts=1, agent_sleep="2")
    script = scenario.root / "start.py"
    traceback = "\n".join(VLLM_CPU_MEMORY) + "\n"
    script.write_text(f"import sys\nsys.stderr.write({traceback!r})\nsys.exit(1)\n")
    book["recovery"]["steps"] = [{"name": "start vLLM", "shell": f"{sys.executable} {script}"}]
    scenario.prepare(["an item"])
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    run = scenario.start()
    run.wait_agent(1)
    with contextlib.suppress(httpx.HTTPError):  # it dies answering
        scenario.standin.admin("die")

    assert run.wait(60) == 4, run.stderr
    (failed,) = run.of("recovery-failed")
    assert failed["reason"].startswith(
        "step 'start vLLM' failed (exit 1): ValueError: Available"
    ), failed
    (recovery,) = scenario.records("recovery")
    assert "ValueError: Available memory on node 0" in recovery["reason"]
