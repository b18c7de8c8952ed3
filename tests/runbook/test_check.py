"""`--check` validates and renders the whole plan, runs nothing and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from support.e2e import make_workspace
from support.standin import ROOT

RALPH = [sys.executable, "-m", "ralph_runner"]


def workspace(tmp_path: Path) -> Path:
    """A workdir a run accepts (a git repository with its CHECKLIST.md): --check refuses one
    without them, as the run does."""
    return make_workspace(tmp_path / "work", ["an item"])


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


def test_vllm_runbook_check_keeps_go_template_braces(tmp_path):
    work = workspace(tmp_path)
    before = files(tmp_path)
    done = subprocess.run(
        [*RALPH, str(ROOT / "runbooks/vllm.yaml"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=work,
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
    assert files(tmp_path) == before  # nothing written


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
        [*RALPH, str(runbook), "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=workspace(tmp_path),
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
        [*RALPH, str(runbook), "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=workspace(tmp_path),
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
    done = subprocess.run(
        [*RALPH, str(runbook), "--check"], capture_output=True, text=True, cwd=workspace(tmp_path)
    )
    assert done.returncode == 2
    assert "contaner" in done.stderr and "pause" in done.stderr, done.stderr


def _no_workdir(tmp_path: Path) -> Path:
    return tmp_path  # `workdir: nothere` below names a directory that is not there


def _no_checklist(tmp_path: Path) -> Path:
    work = workspace(tmp_path)
    (work / "CHECKLIST.md").unlink()
    return work


def _no_repository(tmp_path: Path) -> Path:
    work = tmp_path / "plain"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("- [ ] an item\n")
    return work


# What once passed --check and then failed the run at once (issue 31, item 3): the workdir, its
# checklist, its git repository for verify, a typo in the prompt's item. (setup, runbook's
# changes, where the error must point, a phrase of it)
AT_ONCE = {
    "no workdir": (
        _no_workdir,
        {"workdir": "nothere"},
        "2:1: workdir: the workdir",
        "nothere does not exist",
    ),
    "no checklist": (
        _no_checklist,
        {"checklist": {"path": "TODO.md"}},
        "4:3: checklist.path: no checklist at",
        "TODO.md; create it",
    ),
    "no git repository": (
        _no_repository,
        {},
        "9:5: loop.steps[1].verify: verify needs a commit",
        "is no git repository",
    ),
    "a typo in the prompt": (
        workspace,
        {"prompt": "Do {{ item.txt }}"},
        "5:1: prompt: undefined attribute 'txt'",
        "did you mean 'text'?",
    ),
}


@pytest.mark.parametrize("case", sorted(AT_ONCE))
def test_check_refuses_what_the_run_refuses_at_once(tmp_path, case):
    """--check fails (exit 2) where the run would fail before its first step, with the same
    message at the same file, line, column and key; and it still writes nothing."""
    setup, changes, where, phrase = AT_ONCE[case]
    work = setup(tmp_path)
    book = {  # `workdir:` on line 2: an error that fell back to line 1 would show
        "name": "at once",
        "workdir": ".",
        "checklist": {"path": "CHECKLIST.md"},
        "prompt": "Do {{ item.text }}",
        "loop": {"steps": [{"shell": f"touch {tmp_path}/RAN"}, {"verify": {}}]},
    }
    runbook = tmp_path / "runbook.yaml"
    runbook.write_text(yaml.safe_dump({**book, **changes}, sort_keys=False))
    before = files(tmp_path)
    checked = subprocess.run(
        [*RALPH, str(runbook), "--check"], capture_output=True, text=True, timeout=60, cwd=work
    )
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert f"{runbook}:{where}" in checked.stderr and phrase in checked.stderr, checked.stderr
    assert "Traceback" not in checked.stderr
    assert files(tmp_path) == before  # --check wrote nothing
    ran = subprocess.run(
        [*RALPH, str(runbook)], capture_output=True, text=True, timeout=60, cwd=work
    )
    assert ran.returncode == 2, ran.stdout + ran.stderr
    error = [line for line in checked.stderr.splitlines() if where in line]
    assert error and error[0] in ran.stderr, (checked.stderr, ran.stderr)  # the run's own words
    assert not (tmp_path / "RAN").exists()
