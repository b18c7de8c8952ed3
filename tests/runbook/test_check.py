"""`--check` validates and renders the whole plan, runs nothing and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml
from standin_helpers import ROOT

RALPH = [sys.executable, "-m", "ralph_runner"]


def test_vllm_runbook_check_keeps_go_template_braces(tmp_path):
    done = subprocess.run(
        [*RALPH, str(ROOT / "runbooks/vllm.yaml"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    plan = yaml.safe_load(done.stdout)
    commands = {
        c["name"]: next(v for k, v in c.items() if k != "name")
        for c in plan["diagnostics"]["collect"]
    }
    assert commands["docker container status"].startswith(
        "status=$(docker ps -a --filter 'name=^vllm-spark-head$'"
        " --format '{{.Status}} / {{.RunningFor}}')"
    )
    assert commands["container exit state"].startswith(
        "docker inspect --format '{{.State.Status}}, exit code {{.State.ExitCode}}"
    )
    assert commands["container log (last lines)"] == "docker logs --tail 60 vllm-spark-head 2>&1"
    steps = {step["name"]: step for step in plan["recovery"]["steps"]}
    assert steps["stop the hung container"]["shell"] == "docker stop -t 10 vllm-spark-head"
    assert steps["stop the hung container"]["when"] == "death.hung"
    assert "~/gpu-scheduler/start_vllm.sh" in steps["start vLLM"]["shell"]  # ~/ left unquoted
    probes = {
        next(k for k in probe if k in ("http", "progress")): probe
        for probe in plan["health"]["probes"]
    }
    assert probes["http"]["http"]["url"] == "http://127.0.0.1:8000/v1/models"
    assert probes["progress"]["progress"]["metrics"] == "http://127.0.0.1:8000/metrics"
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    ("progress", "bound", "found"),
    [
        ({}, "within [4, 120] s", "17 to 133 s (2 + B rounded up to 2 s + 2 x 5 + 1 x 1)"),
        ({"stall_after": 5}, "B = 5 s (stall_after)", "19 s (2 + B rounded up to 2 s"),
        ({"stall": {"floor": 2, "ceiling": 30}}, "within [2, 30] s", "15 to 43 s"),
    ],
)
def test_check_prints_the_hang_bound_as_a_rule_and_its_detection_bound(
    tmp_path, progress, bound, found
):
    """--check prints the hang bound B (docs/hangs.md) and the worst case from a hang to its
    death: w + ceil(B / w) x w + f x T + (f - 1) x i, at B's floor and ceiling."""
    runbook = tmp_path / "runbook.yaml"
    probe = {"metrics": "http://127.0.0.1:9/metrics", **progress}
    runbook.write_text(
        yaml.safe_dump(
            {
                "health": {
                    "probes": [{"name": "p", "progress": probe, "timeout": 5}],
                    "watch": 2,
                    "interval": 1,
                    "failures_before_dead": 2,
                },
                "loop": {"steps": [{"shell": "true"}]},
            }
        )
    )
    done = subprocess.run(
        [*RALPH, str(runbook), "--check", "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    (plan,) = json.loads(done.stdout)
    assert bound in plan["health"]["hang_bound"], plan["health"]
    assert plan["health"]["hang_found_within"].startswith(found), plan["health"]


def test_check_runs_nothing_and_writes_nothing(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("- [ ] $(touch ITEM)\n")
    runbook = tmp_path / "runbook.yaml"
    runbook.write_text(
        textwrap.dedent(f"""\
        workdir: {work}
        secrets: [token]
        vars: {{ token: hunter2-secret, marker: {tmp_path}/RAN }}
        prompt: "{{{{ lookup('pipe', 'touch {tmp_path}/PIPE') }}}} {{{{ item.text }}}}"
        health:
          probes: [{{ name: c, command: "touch {{{{ marker }}}}" }}]
        diagnostics:
          collect: [{{ name: c, shell: "touch {{{{ marker }}}}; echo {{{{ token }}}}" }}]
        recovery:
          steps: [{{ shell: "touch {{{{ marker }}}}" }}]
        loop:
          steps:
            - shell: touch {{{{ marker }}}}; echo {{{{ item.text }}}}
        """)
    )
    before = sorted(p.name for p in tmp_path.rglob("*"))
    done = subprocess.run(
        [*RALPH, str(runbook), "--check", "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    (plan,) = json.loads(done.stdout)
    assert plan["loop"]["steps"][0]["shell"].endswith("echo '$(touch ITEM)'")
    assert "hunter2-secret" not in done.stdout and "****" in done.stdout


def test_schema_command_prints_json_schema():
    done = subprocess.run([*RALPH, "schema"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    schema = json.loads(done.stdout)
    assert schema["title"] == "ralph-run runbook"
    assert {"loop", "health", "diagnostics", "recovery"} <= set(schema["properties"])
    assert "loop" in schema["required"]


def uncommented_pause_blocks(name: str) -> str:
    """A shipped runbook with its commented `pause:`/`resume:` example uncommented."""
    lines = (ROOT / "runbooks" / name).read_text().splitlines()
    start = lines.index("# pause:")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("#"))
    block = [line[2:] if line.startswith("# ") else line[1:] for line in lines[start:end]]
    return "\n".join([*lines[:start], *block, *lines[end:]])


@pytest.mark.parametrize("name", ["vllm.yaml", "vllm-local.yaml"])
def test_the_shipped_pause_examples_render(tmp_path, name):
    runbook = tmp_path / name
    runbook.write_text(uncommented_pause_blocks(name))
    done = subprocess.run(
        [*RALPH, str(runbook), "--check", "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    (plan,) = json.loads(done.stdout)
    assert [step["name"] for step in plan["pause"]] == ["stop vLLM"]
    assert [step["name"] for step in plan["resume"]] == ["start vLLM"]
    if name == "vllm.yaml":
        assert plan["pause"][0]["shell"] == "docker stop -t 30 vllm-spark-head"


def test_check_fails_on_an_unknown_name_in_a_pause_step(tmp_path):
    """Not when the loop first pauses: at --check, with the key and line."""
    text = uncommented_pause_blocks("vllm.yaml")
    runbook = tmp_path / "vllm.yaml"
    runbook.write_text(text.replace("docker stop -t 30 {{ container }}", "stop {{ contaner }}"))
    done = subprocess.run([*RALPH, str(runbook), "--check"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "contaner" in done.stderr and "pause" in done.stderr, done.stderr
