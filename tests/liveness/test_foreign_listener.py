"""Issue 37, High 1, written as the attack: another local user (made with `useradd` for the test)
holds the LLM server's loopback port and answers as a healthy server. ralph-run must trust a
loopback server only when its listening socket is ours: another user's is a death of its own
class ("port held by another user"), recorded as deaths are, no prompt sent, no agent step run,
and the run gives up (exit 4: no recovery can free a port another user holds).

- at the run's first check: their server was there before the run;
- after a crash: they bind the port within 20 ms of our server's death (the issue's attack),
  before any check could see it refused;
- when a start brings a server up: the one that answers is theirs, so nothing was started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.foreign import NEEDS_ROOT, Impostor, another_user
from support.standin import free_port, python_env

from ralph_runner.liveness import faults, port_owner
from ralph_runner.liveness.health import ProbeSpec
from ralph_runner.probes import KINDS, ProbeResult

FOREIGN = "port held by another user"
PROMPT = "the secret plan: {{ item.text }}"
# The agent: says it ran, then sends its prompt to the server, as every agent does.
AGENT = (
    "echo ran >> {log} && {python} -c 'import sys, urllib.request as u; "
    "u.urlopen(sys.argv[1], sys.argv[2].encode(), timeout=5).read()' "
    "{{{{ base_url }}}}/chat/completions {{{{ prompt }}}}"
)


@pytest.fixture
def user() -> Iterator:
    with another_user() as made:
        yield made


def write_runbook(
    tmp_path: Path, port: int, after_agent: str = "", start: str = "true", **health: object
) -> tuple[Path, Path]:
    """A runbook whose one probe asks 127.0.0.1:PORT, its recovery's step `start`, more
    `health` keys, and the agent's log (a line a run)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("- [ ] first\n- [ ] second\n")
    log = tmp_path / "agent.log"
    agent = AGENT.format(log=log, python=sys.executable) + after_agent
    runbook = {
        "workdir": str(work),
        "vars": {"base_url": f"http://127.0.0.1:{port}/v1"},
        "prompt": PROMPT,
        "health": {
            "probes": [{"name": "models", "http": {"url": "{{ base_url }}/models"}, "timeout": 1}],
            "failures_before_dead": 2,
            "interval": 0.1,
            "watch": 0,
            **health,
        },
        "diagnostics": {"log": "logs/deaths.log", "collect": []},
        "recovery": {"steps": [{"name": "start", "shell": start}], "healthy_within": 3},
        "loop": {
            "max_iterations": 4,
            "steps": [
                {"ensure_alive": {"phase": "start"}},
                {"name": "run the agent", "shell": agent, "timeout": 20},
                {"ensure_alive": {"phase": "post-step"}},
            ],
        },
    }
    path = tmp_path / "runbook.yaml"
    path.write_text(json.dumps(runbook))
    return path, log


def run(runbook: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(runbook)],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )


def records(runbook: Path) -> list[dict]:
    path = runbook.parent / "work" / "logs" / "deaths.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def agent_runs(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@NEEDS_ROOT
def test_another_users_server_at_the_first_check_is_a_death_and_no_prompt_is_sent(tmp_path, user):
    port = free_port()
    theirs = Impostor(port, user).listening()
    runbook, log = write_runbook(tmp_path, port)
    try:
        done = run(runbook)
    finally:
        theirs.stop()

    held = f"port {port} is held by uid {user.pw_uid}, not by us (uid {os.geteuid()})"
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert held in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert agent_runs(log) == 0
    assert theirs.posts() == [], theirs.lines  # no prompt reached them
    death, recovery = records(runbook)
    assert death["event"] == "death" and death["phase"] == "start", death
    assert death["fault"] == FOREIGN and held in death["evidence"], death
    (probe,) = death["probes"]
    assert probe["reason"] == "foreign" and not probe["ok"] and held in probe["detail"]
    assert recovery["recovered"] is False and recovery["attempts"] == 0, recovery
    assert recovery["steps"] == [] and held in recovery["reason"], recovery


@NEEDS_ROOT
def test_a_port_taken_after_a_crash_ends_the_run_before_another_prompt(tmp_path, user):
    """Our server serves the first item, then dies; their server, retrying the port every
    20 ms, takes it at once. Whatever the next check sees first (refused, or their healthy
    server), the run gives up, and their server gets no prompt."""
    port = free_port()
    ours = Impostor(port).listening()  # a healthy server of ours (the same code, as us)
    theirs = Impostor(port, user)  # retrying the port every 20 ms
    runbook, log = write_runbook(tmp_path, port, f" && kill -9 {ours.process.pid}")
    try:
        done = run(runbook)
    finally:
        ours.stop()
        theirs.stop()

    held = f"port {port} is held by uid {user.pw_uid}, not by us (uid {os.geteuid()})"
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert held in done.stderr, done.stderr
    assert "LISTENING" in theirs.lines  # the attack happened: they held the port
    assert agent_runs(log) == 1
    assert len(ours.posts()) == 1 and "the secret plan: first" in ours.posts()[0]
    assert theirs.posts() == [], theirs.lines
    death = next(r for r in records(runbook) if r["event"] == "death")
    recovery = next(r for r in records(runbook) if r["event"] == "recovery")
    assert death["phase"] == "post-step", death
    assert recovery["recovered"] is False and held in recovery["reason"], recovery
    # Seen as theirs at once, or first as gone and then theirs once "recovered"
    assert death["fault"] == FOREIGN or death["fault"] == faults.GONE, death


@NEEDS_ROOT
def test_a_start_that_brings_up_another_users_server_starts_nothing(tmp_path, user):
    """Nothing listens at the first check, so the recovery's steps run as the start; the
    server that then answers is theirs (they bound the port first): not started, exit 4."""
    port = free_port()
    go = Path(tempfile.mkdtemp(prefix="rr-go-", dir="/tmp"))  # /tmp: they may look in it
    go.chmod(0o755)
    theirs = Impostor(port, user, after=str(go / "bind"))
    runbook, log = write_runbook(tmp_path, port, start=f"touch {go / 'bind'}")
    try:
        done = run(runbook)
    finally:
        theirs.stop()
        shutil.rmtree(go)

    held = f"port {port} is held by uid {user.pw_uid}, not by us (uid {os.geteuid()})"
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert f"service not started: models: foreign: {held}" in done.stderr, done.stderr
    assert agent_runs(log) == 0 and theirs.posts() == [], theirs.lines
    (start,) = records(runbook)
    assert start["event"] == "start" and start["recovered"] is False, start
    assert held in start["reason"] and [s["name"] for s in start["steps"]] == ["start"], start


@NEEDS_ROOT
def test_a_user_the_runbook_trusts_may_run_the_server(tmp_path, user):
    """A service account that runs the server for the operator (`health.trusted_users`): its
    server is theirs to use, as before."""
    port = free_port()
    theirs = Impostor(port, user).listening()
    runbook, log = write_runbook(tmp_path, port, trusted_users=[user.pw_name])
    try:
        done = run(runbook)
    finally:
        theirs.stop()

    assert done.returncode == 5, (done.stdout, done.stderr)  # max_iterations: the items stay
    assert agent_runs(log) == 4 and len(theirs.posts()) == 4, theirs.lines
    assert not (runbook.parent / "work" / "logs" / "deaths.jsonl").exists()


def test_the_loopback_ports_of_the_probes_are_their_urls_and_tcp_ports():
    def spec(kind: str, params: dict) -> ProbeSpec:
        return ProbeSpec("p", kind, KINDS[kind].Params.model_validate(params))

    assert port_owner.loopback_ports(
        spec(
            "progress",
            {
                "metrics": "http://localhost:8000/metrics",
                "completion": {"url": "http://[::1]:8001/v1", "model": "m"},
            },
        ).params
    ) == [8000, 8001]
    assert port_owner.loopback_ports(spec("http", {"url": "http://127.0.0.1/v1"}).params) == [80]
    assert port_owner.loopback_ports(spec("http", {"url": "https://gpu-box:8000/"}).params) == []
    assert port_owner.loopback_ports(spec("tcp", {"port": 9000}).params) == [9000]
    assert port_owner.loopback_ports(spec("tcp", {"host": "10.0.0.2", "port": 9}).params) == []


def test_a_foreign_probe_result_is_its_own_fault_class():
    held = ProbeResult("models", "http", False, "foreign", "port 8000 is held by uid 1002", 0.0)
    refused = ProbeResult("metrics", "http", False, "refused", "connection refused", 0.0)

    assert faults.classify([refused, held]) == (FOREIGN, f"models: foreign: {held.detail}")
    assert not faults.not_serving_yet(held)
