"""runbooks/vllm-local/start_vllm.sh without vLLM: tests/data/fake-vllm-python serves the
stand-in as the API server, with two children titled VLLM::EngineCore and VLLM::Worker in its
group, so the script's process-group handling is tested on every machine. (The real-engine
tier, tests/real/, runs the same script against the real vLLM.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from standin_helpers import cmdline_of, free_port, python_env, wait_for

ROOT = Path(__file__).resolve().parents[2]
START_VLLM = ROOT / "runbooks" / "vllm-local" / "start_vllm.sh"
FAKE_PYTHON = ROOT / "tests" / "data" / "fake-vllm-python"


class Script:
    """start_vllm.sh on one port and state directory."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "vllm"
        self.port = free_port()
        self.env = python_env(
            VLLM_PYTHON=str(FAKE_PYTHON),
            VLLM_MODEL="/models/fake",
            VLLM_SERVED_MODEL_NAME="fake",
            VLLM_PORT=str(self.port),
            VLLM_DIR=str(self.dir),
            FAKE_VLLM_STATE=str(tmp_path / "standin"),
            HEALTH_TIMEOUT="1",
            START_TIMEOUT="30",
            STOP_TIMEOUT="3",
        )
        self.groups: set[int] = set()

    def run(self, action: str = "start") -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(START_VLLM), action], env=self.env, capture_output=True, text=True, timeout=60
        )
        if self.pgid:
            self.groups.add(self.pgid)
        return result

    def ok(self, action: str = "start") -> str:
        result = self.run(action)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    @property
    def pgid(self) -> int | None:
        path = self.dir / "vllm.pid"
        return int(path.read_text()) if path.exists() else None

    def titles(self, pgid: int) -> list[str]:
        """The titles of the group's live processes. One may end or turn zombie between the
        group's scan and this read (psutil.ZombieProcess failed a run): it is left out."""
        return sorted(Path(argv[0]).name for p in group(pgid) if (argv := cmdline_of(p)))

    def admin(self, mode: str) -> None:
        body = {"mode": mode, "value": True}
        url = f"http://127.0.0.1:{self.port}/admin/fail"
        httpx.post(url, json=body, timeout=3).raise_for_status()


def group(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                found.append(process)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Script]:
    served = Script(tmp_path)
    yield served
    served.run("stop")
    left = []
    for pgid in served.groups:
        # A process the stop killed ends a moment later, not at once (a loaded machine).
        with contextlib.suppress(AssertionError):
            wait_for(lambda pgid=pgid: not group(pgid), 5, f"group {pgid} to end")
        for process in group(pgid):
            left.append(f"{process.pid} {' '.join(cmdline_of(process))} (group {pgid})")
            with contextlib.suppress(psutil.Error):  # it may end by itself meanwhile
                process.kill()
    assert not left, f"left running after stop: {left}"


def test_start_is_idempotent_and_status_shows_the_tree(script: Script) -> None:
    assert "healthy: pid" in script.ok()
    first = script.pgid
    assert script.titles(first) == ["VLLM::EngineCore", "VLLM::Worker", "python3"]
    assert "already running: healthy" in script.ok()
    assert script.pgid == first
    status = script.ok("status")
    assert "VLLM::EngineCore" in status and "healthy: a 1-token generation answered" in status


def test_a_hung_engine_is_stopped_group_and_all_then_replaced(script: Script) -> None:
    script.ok()
    hung = script.pgid
    script.admin("engine_hang")  # /health and /metrics answer, generation blocks
    status = script.run("status")
    assert status.returncode == 1 and "hung: no token within 1 s" in status.stdout
    out = script.ok()
    assert "up but not healthy (hung" in out and f"stopping process group {hung}" in out
    assert script.pgid != hung and not group(hung)


def test_the_orphan_of_a_dead_server_is_cleared_before_a_start(script: Script) -> None:
    """The API server gone, a Worker left in its group (as after a killed EngineCore)."""
    script.ok()
    old = script.pgid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: script.titles(old) == ["VLLM::EngineCore", "VLLM::Worker"], 10, "orphans")
    out = script.ok()
    assert "up but not healthy (down" in out
    assert script.pgid != old and not group(old)


def test_stop_ends_a_stopped_engine_too(script: Script) -> None:
    script.ok()
    pgid = script.pgid
    (core,) = [p for p in group(pgid) if "VLLM::EngineCore" in " ".join(cmdline_of(p))]
    core.send_signal(signal.SIGSTOP)
    assert "stopped" in script.ok("stop")
    assert not group(pgid)
    assert script.run("status").returncode == 3


def test_a_server_that_dies_during_start_up_fails_the_start_with_its_log(script: Script) -> None:
    script.env["VLLM_PYTHON"] = "false"  # `false -m vllm...` exits 1 at once
    script.env["VLLM_ARGS"] = "--dtype bfloat16"
    result = script.run()
    assert result.returncode == 1
    assert "vLLM exited during start-up" in result.stderr
    assert "start_vllm.sh: --dtype bfloat16" in result.stderr
