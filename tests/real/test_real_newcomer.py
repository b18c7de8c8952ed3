"""runbooks/vllm-local.yaml as a newcomer meets it (issue 21): the CPU command line its header
comment shows, run exactly as written (only $RALPH, the clone's path, is given), in a fresh
repository, starts the real vLLM through the runbook's own recovery-as-start and reaches the
agent step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from real_helpers import ENGINE_ENV, RUNBOOK, START_VLLM, wait_until
from support.e2e import make_workspace

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def documented_command() -> str:
    """The `ralph-run` command of the runbook's "No GPU at hand?" comment, lines joined."""
    lines = RUNBOOK.read_text(encoding="utf-8").splitlines()
    start = next(
        i for i, line in enumerate(lines) if "ralph-run $RALPH/runbooks/vllm-local" in line
    )
    command = []
    for line in lines[start:]:
        text = re.sub(r"^#\s*", "", line)
        command.append(text.removesuffix("\\").strip())
        if not text.endswith("\\"):
            break
    return " ".join(command)


def test_the_documented_cpu_command_starts_vllm_and_reaches_the_agent(tmp_path: Path) -> None:
    command = documented_command()
    assert command.startswith("VLLM_CPU_KVCACHE_SPACE=1 ralph-run "), command
    work = make_workspace(tmp_path / "repo", ["first item", "second item"])
    home = tmp_path / "home"  # the runbook's vllm_dir lies under $HOME: a fresh one
    home.mkdir()
    env = {
        # a newcomer's shell: without the tier's VLLM_CPU_KVCACHE_SPACE (the command sets it);
        # offline, as this machine is
        **{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
        "HF_HUB_OFFLINE": ENGINE_ENV["HF_HUB_OFFLINE"],
        "RALPH": str(ROOT),
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        started = time.monotonic()
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "run the agent" in line or time.monotonic() - started > 400:
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        stop = {**env, "VLLM_DIR": str(home / ".local/state/vllm-local-8000"), "VLLM_PORT": "8000"}
        subprocess.run([str(START_VLLM), "stop"], env=stop, capture_output=True, timeout=120)
    text = "".join(seen)
    assert "vLLM is not running: starting it" in text, text
    assert "started in" in text, text
    assert "run the agent" in text, text
    assert "death #" not in text, text
    wait_until(lambda: proc.poll() is not None, 10, "ralph-run to end")
