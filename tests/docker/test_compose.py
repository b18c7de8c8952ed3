"""runbooks/vllm.yaml against a real docker daemon: the seed's set-up, a compose service.

The service runs the vLLM stand-in (runbooks/compose/standin.yml: `restart: "no"`, host network,
ralph_runner bind-mounted) and is started by runbooks/compose/start_vllm.sh, as an operator's
would be. ralph-run runs the shipped runbook (only the agent is the stand-in agent) through the
CLI; the server is broken through its control file at moments read from ralph-run's status file.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from docker_helpers import ComposeService, containers, run, vllm_runbook
from support.e2e import DEATH_LINE, RalphRun, collector_output, make_workspace, processes_in
from support.standin import ROOT, python_env, wait_for

pytestmark = pytest.mark.timeout(180)

ITEMS = ["add the road", "add the car", "add the controls"]
STATUS = "docker container status"
EXIT_STATE = "container exit state"
LOG = "container log (last lines)"
STOP_STEP = "stop the hung container"
PROMPT_LIMIT = 100  # characters: every agent prompt of vllm.yaml is longer


def start_ralph(
    tmp_path: Path,
    service: ComposeService,
    monkeypatch: pytest.MonkeyPatch,
    agent_sleep: str = "0",
    **extra: Any,
) -> tuple[RalphRun, Path, str]:
    """`ralph-run vllm.yaml --json -e ...` in a fresh workspace; the run, workspace, agent step."""
    workspace = make_workspace(tmp_path / "work", ITEMS)
    runbook = tmp_path / "vllm.yaml"
    agent_step = vllm_runbook(runbook, agent_sleep)
    for key, value in service.env.items():  # for start_vllm.sh and compose, in recovery
        if key != "CONTAINER":  # that one the runbook's start step passes on: `container`
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("CONTAINER", raising=False)
    facts = {
        "base_url": service.url,
        "model": service.server.model,
        "container": service.name,
        "start_vllm": str(service.start_script),
        "gpu_sched": str(tmp_path / "no-gpu-sched"),
        **extra,
    }
    command = [sys.executable, "-m", "ralph_runner", str(runbook), "--json"]
    return RalphRun([*command, "-e", json.dumps(facts)], workspace), workspace, agent_step


def records(workspace: Path, kind: str) -> list[dict[str, Any]]:
    lines = (workspace / "logs" / "vllm-deaths.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == kind]


def assert_item_retried_without_a_strike(run: RalphRun, workspace: Path) -> None:
    checklist = (workspace / "CHECKLIST.md").read_text(encoding="utf-8")
    assert checklist == "".join(f"- [x] {item}\n" for item in ITEMS)
    assert not run.of("strike") and not run.of("skip"), run.events
    assert [e["item"] for e in run.of("retry")] == [ITEMS[1]], run.events
    state = json.loads((workspace / ".ralph" / "state.json").read_text(encoding="utf-8"))
    assert (state["status"], state["deaths"], state["strikes"]) == ("finished", 1, {})


def assert_nothing_left(service: ComposeService, tmp_path: Path) -> None:
    """`docker compose down` leaves no container of the test, and no process works in it."""
    down = service.down()
    assert down.returncode == 0, down.stdout + down.stderr
    assert service.status() == "" and service.name not in containers()
    assert processes_in(tmp_path) == []


def test_container_death_is_recorded_with_its_log_and_recovered_by_compose(
    tmp_path: Path, service: ComposeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.start()
    assert service.status().startswith("Up")
    run, workspace, _ = start_ralph(tmp_path, service, monkeypatch)

    run.wait_status(lambda s: s.get("done", 0) >= 1, "the first item done", timeout=60)
    # the seed's death: the next agent's prompt trips the KV-cache assertion; the API server
    # exits 0. Probes never trip it: the progress probe's canary is "ping".
    service.server.trigger(die_on_prompt_chars=PROMPT_LIMIT)

    assert run.wait(120) == 0, run.stderr
    (death,) = records(workspace, "death")
    assert death["item"]["text"] == ITEMS[1]
    assert death["phase"] in ("during-step", "post-step")
    assert collector_output(death, STATUS).startswith("Exited (0) "), death["collectors"]
    assert collector_output(death, EXIT_STATE).startswith("exited, exit code 0, OOMKilled false")
    log = collector_output(death, LOG)
    assert DEATH_LINE in log and "vllm.v1.engine.exceptions.EngineDeadError" in log, log
    assert log.rstrip().endswith("Finished server process [1]"), log  # its last 60 lines

    (recovery,) = records(workspace, "recovery")
    assert (recovery["recovered"], recovery["attempts"]) == (True, 1)
    stop, start = recovery["steps"]
    assert (stop["name"], stop["skipped"]) == (STOP_STEP, True)  # dead is not hung
    assert f"[start_vllm] starting {service.name}" in start["output"]
    assert f"[start_vllm] healthy: {service.name}" in start["output"]
    # compose started the same container again: one log, two start-ups, one death between
    logs = service.logs()
    assert logs.count("Application startup complete.") == 2
    assert logs.index(DEATH_LINE) < logs.rindex("Application startup complete.")
    assert service.status().startswith("Up")

    report = (workspace / "logs" / "vllm-deaths.log").read_text(encoding="utf-8")
    assert f"--- {STATUS} ---\n Exited (0) " in report
    assert_item_retried_without_a_strike(run, workspace)
    assert_nothing_left(service, tmp_path)


def test_hung_engine_is_found_and_its_container_restarted(
    tmp_path: Path, service: ComposeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.start()
    run, workspace, agent_step = start_ralph(
        tmp_path, service, monkeypatch, agent_sleep="4 if iteration == 2 else 0", stall_after=5
    )

    run.wait_status(
        lambda s: s.get("iteration", 0) == 2 and s.get("phase") == agent_step,
        "the agent of iteration 2 thinking",
        timeout=60,
    )
    service.server.trigger(engine_hang=True)  # /health 200, the agent's generation blocks

    assert run.wait(150) == 0, run.stderr
    (death,) = records(workspace, "death")
    assert death["item"]["text"] == ITEMS[1]
    reasons = {p["name"]: p["reason"] for p in death["probes"]}
    assert reasons == {"engine progress": "stalled", "models endpoint": None}, death["probes"]
    assert collector_output(death, STATUS).startswith("Up "), death["collectors"]  # hung, not dead
    (recovery,) = records(workspace, "recovery")
    assert (recovery["recovered"], recovery["attempts"]) == (True, 1)
    stop, start = recovery["steps"]
    assert (stop["name"], stop["skipped"], stop["ok"]) == (STOP_STEP, False, True)
    assert f"[start_vllm] starting {service.name}" in start["output"]  # not "already running"
    logs = service.logs()
    assert logs.count("Application startup complete.") == 2
    assert service.status().startswith("Up")
    assert_item_retried_without_a_strike(run, workspace)
    assert_nothing_left(service, tmp_path)


def test_the_start_script_alone_calls_a_hung_engine_already_running(
    service: ComposeService,
) -> None:
    """Why the runbook stops a hung container first: /health answers, generation does not."""
    service.start()
    service.server.trigger(engine_hang=True)
    wait_for(lambda: not (service.state_dir / "control.json").exists(), 10, "the hang applied")
    again = service.start()
    assert "already running" in again.stdout
    with pytest.raises(httpx.TimeoutException):
        service.server.chat("hello", timeout=2)


def test_the_start_script_fails_at_once_when_the_container_exits(service: ComposeService) -> None:
    """A server that cannot start (its port taken) is exit 1 with its log, not a long wait."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", service.port))
        taken.listen()
        started = time.monotonic()
        done = run([str(service.start_script)], timeout=90, env=service.env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert time.monotonic() - started < 45  # START_TIMEOUT is 60
    assert f"container {service.name} is exited during start-up" in done.stderr
    assert "Address already in use" in done.stderr, done.stderr  # the end of its log
    assert service.status().startswith("Exited (1)")


def test_standin_compose_file_is_the_seed_shape(service: ComposeService) -> None:
    """Both shipped compose files parse, and keep what the runbook relies on."""
    for name in ("docker-compose.yml", "standin.yml"):
        env = {**service.env, "COMPOSE_FILE": str(service.start_script.parent / name)}
        done = run([*service.compose, "config"], env=env)
        assert done.returncode == 0, done.stderr
        assert "restart: 'no'" in done.stdout or 'restart: "no"' in done.stdout, done.stdout
        assert "network_mode: host" in done.stdout
        assert f"container_name: {service.name}" in done.stdout


def test_diagnose_reads_the_running_container(
    tmp_path: Path, service: ComposeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ralph-run diagnose` on the shipped runbook: the docker sections of a live service."""
    service.start()
    work = make_workspace(tmp_path / "work", ITEMS)
    facts = {"base_url": service.url, "container": service.name, "model": service.server.model}
    command = [sys.executable, "-m", "ralph_runner", "diagnose", str(ROOT / "runbooks/vllm.yaml")]
    done = run([*command, "--json", "-e", json.dumps(facts)], cwd=work, env=python_env())
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert collector_output(report, STATUS).startswith("Up "), report["collectors"]
    assert collector_output(report, EXIT_STATE).startswith("running, exit code 0, OOMKilled false")
    assert "Application startup complete." in collector_output(report, LOG)
