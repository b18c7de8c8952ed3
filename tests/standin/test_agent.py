"""The stand-in agent (ralph_runner/standin/agent.py), driven as a real process against the
stand-in server: it ticks and commits as an agent does, and fails cleanly when the server does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.standin import StandIn, python_env, wait_for


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
    [
        ("die", []),
        ("dead_503", []),
        ("hang", []),
        ("engine_hang", []),
        ("engine_death", []),
        (None, ["--fail"]),
    ],
    ids=["refused", "503", "timeout", "engine-hang", "engine-death", "--fail"],
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


def test_agent_streams_and_a_death_mid_stream_fails_it(standin: StandIn, repo: Path) -> None:
    standin.start(TOKENS_PER_SECOND="10")
    before = (repo / "CHECKLIST.md").read_bytes()
    standin.admin("busy", 100)  # 16 tokens (the agent's max_tokens) at 10 tokens/s
    command = [sys.executable, "-m", "ralph_runner.standin.agent", "--url", standin.url]
    agent = subprocess.Popen(
        [*command, "--model", standin.model, "--timeout", "10", "--", "go"],
        cwd=repo,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: '"POST /v1/chat/completions HTTP/1.1" 200' in standin.log(), 20, "the call")
    standin.admin("engine_death")
    out, err = agent.communicate(timeout=20)
    assert agent.returncode == 1, out + err
    assert "error in the stream: EngineCore encountered an issue." in err
    assert (repo / "CHECKLIST.md").read_bytes() == before
