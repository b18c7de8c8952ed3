"""What recovery steps see: `death` (its phase, probes, reasons, hung), `when:` on it, and
`--check` refusing a field a death does not have, at its line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from engine_helpers import Engine
from support.e2e import make_workspace
from support.http_post import post_command
from support.standin import START_SCRIPT, StandIn, python_env

from ralph_runner.liveness import recovery
from ralph_runner.probes import ProbeResult
from ralph_runner.runbook import schema

RALPH = [sys.executable, "-m", "ralph_runner"]


def ralph(*args: str, cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RALPH, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=python_env()
    )


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def records(work: Path) -> list[dict]:
    lines = (work / "logs" / "deaths.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_death_has_exactly_the_fields_the_loader_allows():
    results = [
        ProbeResult("models", "http", True, None, "HTTP 200", 0.01),
        ProbeResult("engine progress", "progress", False, "stalled", "no token for 15.0 s", 0.01),
        ProbeResult("port", "tcp", False, "timeout", "timed out", 1.0),
    ]
    death = recovery.death_of(3, "during-step", "2026-12-01T08:00:00+00:00", results)
    assert tuple(death) == schema.DEATH_FIELDS
    assert death["reasons"] == ["stalled", "timeout"] and death["hung"] is True
    assert death["probes"][1] == {
        "name": "engine progress",
        "kind": "progress",
        "ok": False,
        "reason": "stalled",
        "detail": "no token for 15.0 s",
    }
    refused = [ProbeResult("models", "http", False, "refused", "connection refused", 0.0)]
    assert recovery.death_of(1, "start", "t", refused)["hung"] is False
    dead = [ProbeResult("models", "http", False, "status", "HTTP 500", 0.0)]
    assert recovery.death_of(1, "start", "t", dead)["hung"] is False


@pytest.mark.parametrize(
    ("when", "field", "hint"),
    [
        ("death.hungg", "hungg", "did you mean death.hung? "),
        ("death['fase'] == 'start'", "fase", "did you mean death.phase? "),
        ("death.hung and death.probes[0].status == 500", None, None),  # a probe's own keys
        ("death.zzz", "zzz", ""),
    ],
)
def test_check_refuses_a_when_naming_a_field_a_death_does_not_have(tmp_path, when, field, hint):
    work = make_workspace(tmp_path / "work", ["one"])
    runbook = write(
        tmp_path / "runbook.yaml",
        f"""\
        workdir: {work}
        recovery:
          steps:
            - name: start
              shell: "true"
            - name: stop the hung server
              shell: echo stop
              when: {json.dumps(when)}
        loop:
          steps: [{{ shell: "true" }}]
        """,
    )
    done = ralph(str(runbook), "--check", cwd=tmp_path)
    if field is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip().splitlines() == [
        f"ralph-run: error: {runbook}:8:7: recovery.steps[1].when: a death has no field {field!r}; "
        f"{hint}(it has: number, phase, time, probes, reasons, hung, fault)"
    ]


def test_an_included_recovery_step_is_checked_in_its_own_file(tmp_path):
    work = make_workspace(tmp_path / "work", ["one"])
    steps = write(tmp_path / "recover.yaml", "- shell: echo stop\n  when: death.hunged\n")
    runbook = write(
        tmp_path / "runbook.yaml",
        f"""\
        workdir: {work}
        recovery: {{ steps: [{{ include: {steps.name} }}] }}
        loop: {{ steps: [{{ shell: "true" }}] }}
        """,
    )
    done = ralph(str(runbook), "--check", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"ralph-run: error: {steps}:2:3: tasks[0].when: a death has no field"
    )


def test_check_shows_the_when_and_renders_death_in_recovery_steps(tmp_path):
    work = make_workspace(tmp_path / "work", ["one"])
    runbook = write(
        tmp_path / "runbook.yaml",
        f"""\
        workdir: {work}
        recovery:
          steps:
            - name: stop the hung server
              shell: echo {{{{ death.phase }}}} {{{{ death.reasons | join(',') }}}}
              when: death.hung
        loop:
          steps: [{{ shell: "true" }}]
        """,
    )
    done = ralph(str(runbook), "--check", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (step,) = yaml.safe_load(done.stdout)["recovery"]["steps"]
    assert step == {
        "name": "stop the hung server",
        "shell": "echo during-step ''",
        "when": ("death.hung"),
    }


def hang_then_recover_runbook(work: Path, engine: Engine, start: str) -> dict:
    """The agent's first attempt hangs the engine (its request active); the recovery steps
    record what they saw of the death."""
    admin = f"{engine.root_url}/admin"
    agent = (
        "if [ ! -e ../hung-once ]; then touch ../hung-once; "
        f"{post_command(f'{admin}/hang')}; exec sleep 60; fi; "
        "sed -i 's/- \\[ \\]/- [x]/' CHECKLIST.md && git commit -qam done"
    )
    return {
        "workdir": str(work),
        "health": {
            "probes": [
                {
                    "name": "engine progress",
                    "progress": {
                        "metrics": engine.metrics_url,
                        "completion": {"url": engine.url, "model": "m"},
                        "stall_after": 1,
                    },
                    "timeout": 1,
                },
            ],
            "failures_before_dead": 2,
            "interval": 0.2,
            "watch": 0.2,
        },
        "diagnostics": {"log": "logs/deaths.log", "collect": []},
        "recovery": {
            "steps": [
                {
                    "name": "stop the hung server",
                    "shell": "echo {{ death.number }} {{ death.phase }}"
                    " {{ death.reasons | join(',') }} > ../stopped;"
                    f" {post_command(f'{admin}/resume')}",
                    "when": "death.hung",
                },
                {"name": "start", "shell": start},
            ],
            "healthy_within": 10,
        },
        "loop": {
            "max_iterations": 5,
            "steps": [
                {"ensure_alive": {"phase": "start"}},
                {"name": "agent", "shell": agent, "timeout": 120},
                {"ensure_alive": {"phase": "post-step"}},
                {"verify": {"checked": True, "committed": True}},
            ],
        },
    }


def test_a_hung_engine_is_stopped_by_the_when_death_hung_step(tmp_path):
    work = make_workspace(tmp_path / "work", ["one"])
    with Engine() as engine:
        runbook = tmp_path / "runbook.yaml"
        runbook.write_text(yaml.safe_dump(hang_then_recover_runbook(work, engine, "true")))
        done = ralph(str(runbook), "--json", cwd=work)

    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "stopped").read_text() == "1 during-step stalled\n"
    death, recovered = records(work)
    assert death["phase"] == "during-step" and death["probes"][0]["reason"] == "stalled"
    assert recovered["recovered"] is True
    assert [(s["name"], s["skipped"]) for s in recovered["steps"]] == [
        ("stop the hung server", False),
        ("start", False),
    ]
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["event"] for e in events if e["event"] in ("retry", "strike", "done")] == [
        "retry",
        "done",
    ]
    assert engine.admin_calls == ["hang", "resume"]


def test_a_refused_server_is_started_without_the_hung_step(tmp_path):
    """A server that is not there (refused) is no hung one: `when: death.hung` skips. At the
    run's first check it is a start, not a death: recorded as such, counted nowhere."""
    work = make_workspace(tmp_path / "work", ["one"])
    with StandIn(tmp_path / "vllm") as server:
        runbook = write(
            tmp_path / "runbook.yaml",
            f"""\
            workdir: {work}
            health:
              probes: [{{ name: models, http: {{ url: "{server.url}/models" }}, timeout: 1 }}]
              interval: 0.1
            diagnostics: {{ log: logs/deaths.log, collect: [] }}
            recovery:
              steps:
                - name: stop the hung server
                  shell: touch ../stopped
                  when: death.hung
                - name: start
                  shell: PYTHON={sys.executable} {START_SCRIPT} {server.port} {server.state_dir}
                  timeout: 60
              healthy_within: 20
            loop:
              steps:
                - ensure_alive: {{ phase: start }}
                - name: agent
                  shell: sed -i 's/- \\[ \\]/- [x]/' CHECKLIST.md && git commit -qam done
                - verify: {{ checked: true, committed: true }}
            """,
        )
        done = ralph(str(runbook), "--json", cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "stopped").exists()
    (start,) = records(work)
    assert start["event"] == "start" and start["probes"][0]["reason"] == "refused"
    assert start["recovered"] is True
    assert [(s["name"], s["skipped"]) for s in start["steps"]] == [
        ("stop the hung server", True),
        ("start", False),
    ]
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["event"] for e in events if e["event"] in ("start", "started", "death")] == [
        "start",
        "started",
    ]
    skipped = [e for e in events if e["event"] == "recovery-step" and e.get("skipped")]
    assert [e["skipped"] for e in skipped] == ["when: death.hung"]
    assert json.loads((work / ".ralph" / "state.json").read_text())["deaths"] == 0
    status = json.loads((work / ".ralph" / "status.json").read_text())
    assert status["deaths"] == 0 and status["last_start"]["recovered"] is True
    shown = ralph("status", str(work), cwd=work)
    assert "start:      the service was not running at" in shown.stdout, shown.stdout
