"""The stand-ins, driven as real processes: the vLLM-like server, its start script, the agent."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from standin_helpers import StandIn, process_gone, python_env, wait_for

ACCESS_LINE = re.compile(
    r'^\(APIServer pid=\d+\) INFO:     127\.0\.0\.1:\d+ - "GET /v1/models HTTP/1\.1" 200 OK$', re.M
)
DEATH_LINES = [
    "AssertionError: num_required_blocks",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    "INFO:     Shutting down",
    "INFO:     Application shutdown complete.",
]


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    """A stand-in state directory; every server it ran is gone when the test ends."""
    with StandIn(tmp_path / "vllm") as server:
        yield server
    assert server.processes() == []


@pytest.fixture
def server(standin: StandIn) -> StandIn:
    """A stand-in started by the start script."""
    standin.start()
    return standin


def assert_died_like_vllm(server: StandIn, pid: int, reason: str) -> None:
    marker = server.wait_dead(pid)
    assert (marker["pid"], marker["code"]) == (pid, 0)
    assert reason in marker["reason"]
    log = server.log()
    positions = [log.index(line) for line in DEATH_LINES]
    assert positions == sorted(positions), log
    assert server.pid is None
    assert not server.healthy()


# the server


def test_healthy_server_speaks_vllms_api_and_logs_like_it(server: StandIn) -> None:
    pid = server.pid
    assert pid is not None
    assert os.getsid(pid) == pid, "the server must lead its own session to outlive the start step"
    assert psutil.Process(pid).ppid() != os.getpid()

    health = server.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    models = server.get("/v1/models").json()
    assert [card["id"] for card in models["data"]] == [server.model]

    reply = server.chat("x" * 400)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    assert reply.json()["usage"]["prompt_tokens"] == 100

    metrics = server.get("/metrics").text
    for gauge in ("kv_cache_usage_perc", "gpu_cache_usage_perc", "num_requests_running"):
        assert re.search(rf"^vllm:{gauge}\{{.*\}} \d", metrics, re.M), gauge
    assert re.search(r"^vllm:kv_cache_usage_perc\{.*\} 0\.00[1-9]", metrics, re.M)

    wrong_model = httpx.post(
        f"{server.url}/chat/completions", json={"model": "other", "messages": []}, timeout=3
    )
    assert wrong_model.status_code == 404

    wait_for(lambda: "Avg prompt throughput" in server.log(), what="a stats line")
    log = server.log()
    assert "Application startup complete." in log
    assert ACCESS_LINE.search(log)
    assert re.search(r"Avg prompt throughput: [\d.]+ tokens/s, .* GPU KV cache usage: [\d.]+%", log)


def test_die_exits_0_and_logs_the_engine_death(standin: StandIn) -> None:
    child = standin.spawn()
    standin.trigger(die_at_request=2)
    assert standin.get("/v1/models").status_code == 200
    assert standin.get("/v1/models").status_code == 500
    assert child.wait(timeout=10) == 0
    assert_died_like_vllm(standin, child.pid, "die_at_request")
    assert "num_required_blocks 25 < len(req_blocks) 26" in standin.log()


def test_die_from_the_admin_endpoint(server: StandIn) -> None:
    pid = server.pid
    assert server.admin("die").status_code == 200
    assert_died_like_vllm(server, pid, "die")


def test_a_prompt_over_the_limit_kills_the_server(server: StandIn) -> None:
    pid = server.pid
    server.trigger(die_on_prompt_chars=1000)
    assert server.chat("x" * 1000).status_code == 200
    with pytest.raises(httpx.HTTPError):
        server.chat("x" * 2000).raise_for_status()
    assert_died_like_vllm(server, pid, "die_on_prompt_chars (2000 > 1000)")
    assert "num_required_blocks 32 < len(req_blocks) 33" in server.log()


def test_hang_holds_the_port_and_never_answers(server: StandIn) -> None:
    pid = server.pid
    server.admin("hang")
    with pytest.raises(httpx.ReadTimeout):
        server.get("/health", timeout=0.5)
    assert psutil.pid_exists(pid)
    socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 3, "a hung server still stops on SIGTERM"
    assert server.exit_marker()["reason"] == "SIGTERM"


def test_dead_engine_answers_503_while_the_process_lives(server: StandIn) -> None:
    server.trigger(dead_503=True)
    for path in ("/health", "/v1/models"):
        answer = server.get(path)
        assert answer.status_code == 503
        assert "EngineCore encountered an issue" in answer.json()["error"]["message"]
    assert server.chat("hi").status_code == 503
    assert psutil.pid_exists(server.pid)
    assert server.exit_marker() is None
    assert "EngineDeadError" in server.log()
    assert "Shutting down" not in server.log()


def test_slow_once_delays_one_request_only(server: StandIn) -> None:
    server.admin("slow_once", 0.6)
    started = time.monotonic()
    assert server.get("/v1/models").status_code == 200
    assert time.monotonic() - started >= 0.6
    started = time.monotonic()
    assert server.get("/v1/models").status_code == 200
    assert time.monotonic() - started < 0.5


def test_sigterm_shuts_down_cleanly(standin: StandIn) -> None:
    child = standin.spawn()
    child.terminate()
    assert child.wait(timeout=5) == 0
    assert standin.exit_marker()["reason"] == "SIGTERM"
    assert standin.log().rstrip().endswith(f"Finished server process [{child.pid}]")


def test_unknown_or_broken_faults_are_refused(server: StandIn) -> None:
    answer = server.admin("explode")
    assert answer.status_code == 400
    assert "unknown fault explode" in answer.json()["error"]
    (server.state_dir / "control.json").write_text("{broken")
    assert server.healthy()
    assert "WARNING" in server.log()
    assert "ignored control.json" in server.log()
    assert not (server.state_dir / "control.json").exists()


# the start script


def test_start_is_idempotent(server: StandIn) -> None:
    pid = server.pid
    again = server.start()
    assert "[start] already running" in again.stdout
    assert (server.starts, server.pid) == (1, pid)


def test_start_after_death_starts_a_new_server(server: StandIn) -> None:
    old = server.pid
    server.admin("die")
    server.wait_dead(old)
    server.start()
    assert server.starts == 2
    assert server.pid not in (None, old)
    assert server.healthy()


def test_failed_start_then_a_good_one(server: StandIn) -> None:
    old = server.pid
    server.admin("die")
    server.wait_dead(old)
    (server.state_dir / "fail_starts").write_text("1\n")

    failed = server.run_start_script()
    assert failed.returncode == 1
    assert "CUDA out of memory: another job holds 80 GiB" in failed.stderr
    assert server.starts == 1
    assert not server.healthy()

    server.start()
    assert server.starts == 2
    assert server.healthy()


def test_start_replaces_a_hung_server(server: StandIn) -> None:
    hung = server.pid
    server.admin("hang")
    result = server.start(HEALTH_TIMEOUT="0.5")
    assert f"server pid {hung} is up but not healthy" in result.stdout
    assert process_gone(hung)
    assert server.pid != hung
    assert server.healthy()


def test_start_reports_a_server_that_dies_while_starting(standin: StandIn) -> None:
    standin.trigger(die=True)
    result = standin.run_start_script()
    assert result.returncode == 1
    assert "server exited during startup" in result.stderr
    assert "EngineDeadError" in result.stderr


# the agent


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "work"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "ralph@example.com")
    git(repo, "config", "user.name", "Ralph")
    (repo / "CHECKLIST.md").write_bytes(b"# plan\r\n- [x] one\r\n  - [ ] two  \r\n- [ ] three\r\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "start")
    return repo


def run_agent(
    server: StandIn, repo: Path, *args: str, timeout: float = 3
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ralph_runner.standin.agent", "--url", server.url]
    command += ["--model", server.model, "--timeout", str(timeout), *args]
    return subprocess.run(
        command, cwd=repo, env=python_env(), input="do it", capture_output=True, text=True
    )


def test_agent_ticks_the_first_item_and_commits(server: StandIn, repo: Path) -> None:
    result = run_agent(server, repo)
    assert result.returncode == 0, result.stderr
    assert "5 chars of prompt" in result.stdout
    checklist = (repo / "CHECKLIST.md").read_bytes()
    assert checklist == b"# plan\r\n- [x] one\r\n  - [x] two  \r\n- [ ] three\r\n"
    assert git(repo, "log", "-1", "--format=%s") == "done: two"
    assert git(repo, "status", "--porcelain") == ""
    assert '"POST /v1/chat/completions HTTP/1.1" 200 OK' in server.log()


def test_agent_no_commit_ticks_only(server: StandIn, repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    result = run_agent(server, repo, "--no-commit", "--", "a", "prompt")
    assert result.returncode == 0
    assert "8 chars of prompt" in result.stdout
    assert b"- [x] two" in (repo / "CHECKLIST.md").read_bytes()
    assert git(repo, "rev-parse", "HEAD") == head


@pytest.mark.parametrize(
    ("fault", "agent_args"),
    [("die", []), ("dead_503", []), ("hang", []), (None, ["--fail"])],
    ids=["refused", "503", "timeout", "--fail"],
)
def test_agent_fails_cleanly_without_a_working_server(
    server: StandIn, repo: Path, fault: str | None, agent_args: list[str]
) -> None:
    before = (repo / "CHECKLIST.md").read_bytes(), git(repo, "rev-parse", "HEAD")
    pid = server.pid
    if fault:
        server.admin(fault)
    if fault == "die":
        server.wait_dead(pid)

    result = run_agent(server, repo, *agent_args, timeout=0.5)

    assert result.returncode == 1
    assert "Error:" in result.stderr
    assert ((repo / "CHECKLIST.md").read_bytes(), git(repo, "rev-parse", "HEAD")) == before
    assert git(repo, "status", "--porcelain") == ""
    if not fault:
        assert "/v1/chat/completions" not in server.log()
