"""The jobs file and the batch script it becomes, without Slurm: options resolved (job, then
`defaults:`), every value shell-quoted, the rules in the script, and every mistake in the jobs
file reported with its file, line, column and key path."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from ralph_runner.errors import FatalError
from ralph_runner.slurm import jobs, script

RUNBOOK = "name: x\nloop:\n  steps: []\n"


def jobs_file(tmp_path: Path, text: str) -> Path:
    (tmp_path / "runbook.yaml").write_text(RUNBOOK)
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(FatalError) as raised:
        jobs.load(jobs_file(tmp_path, text))
    assert raised.value.exit_code == 2
    return [str(problem) for problem in raised.value.problems]


def test_a_job_takes_its_own_options_then_the_defaults(tmp_path: Path) -> None:
    path = jobs_file(
        tmp_path,
        "runbook: runbook.yaml\n"
        "defaults: {partition: gpu, gpus: 2, time: '4:00:00', vars: {model: m, port: 8000}}\n"
        "jobs:\n"
        "  - {name: a, workdir: loops/a, vars: {port: 8001}}\n"
        "  - {name: b, workdir: /shared/b, gpus: 1, account: lab, exclude_failed_node: true}\n",
    )
    a, b = jobs.load(path)
    assert (a.partition, a.gpus, a.time, a.account) == ("gpu", 2, "4:00:00", None)
    assert a.vars == {"model": "m", "port": 8001}
    assert a.workdir == tmp_path / "loops" / "a" and a.runbook == tmp_path / "runbook.yaml"
    assert (b.gpus, b.account, b.exclude_failed_node, b.max_requeues) == (1, "lab", True, 3)
    assert str(b.workdir) == "/shared/b"
    options = script.sbatch_options(a)
    for option in ("--gres=gpu:2", "--partition=gpu", "--time=4:00:00", "--requeue"):
        assert option in options
    assert "--signal=B:USR1@120" in options
    assert f"--output={tmp_path}/loops/a/.ralph/slurm/job-%j.out" in options


@pytest.mark.system  # bash -n reads the script
def test_the_script_quotes_every_value_and_is_valid_bash(tmp_path: Path) -> None:
    hostile = "$(touch pwned); `id` 'quote"
    path = jobs_file(
        tmp_path,
        "runbook: runbook.yaml\n"
        f"jobs: [{{name: a, workdir: 'w x', vars: {{note: {hostile!r}}}, "
        "sbatch: ['--qos=long; rm -rf /']}]\n",
    )
    (job,) = jobs.load(path)
    text = script.render(job)
    assert f"#SBATCH {shlex.quote('--qos=long; rm -rf /')}" in text
    assert f"workdir={shlex.quote(str(tmp_path / 'w x'))}" in text
    extra = next(line for line in text.splitlines() if line.startswith("extra_vars="))
    assert shlex.split(extra.removeprefix("extra_vars=")) == ['{"note": "' + hostile + '"}']
    checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert not (tmp_path / "pwned").exists()


def test_the_script_holds_the_rules(tmp_path: Path) -> None:
    """Requeue on exit 4 up to max_requeues, the time limit's USR1 as a pause, scancel's TERM
    forwarded to the loop, the helper that starts a requeued job at once."""
    path = jobs_file(
        tmp_path,
        "runbook: runbook.yaml\n"
        "jobs: [{name: a, workdir: w, max_requeues: 5, exclude_failed_node: true}]\n",
    )
    text = script.render(jobs.load(path)[0])
    assert "max_requeues=5\n" in text and "exclude_failed_node=1\n" in text
    assert "trap on_time_limit USR1" in text and "trap on_term TERM" in text
    assert "if [[ $code == 4 && -z $stopping ]]" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "StartTime=now" in text
    assert '"$ralph_run" pause "$workdir"' in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("jobs: []\n", "jobs.yaml:1:1: runbook: required key is missing"),
        (
            "runbook: runbook.yaml\njobs:\n  - {name: a, workdir: w, gpu: 2}\n",
            "jobs.yaml:3:27: jobs[0].gpu: unknown key 'gpu'",
        ),
        (
            "runbook: runbook.yaml\njobs:\n  - {name: a, workdir: w, time: 'two hours'}\n",
            "time 'two hours' is not sbatch's",
        ),
        (
            "runbook: runbook.yaml\njobs:\n  - {name: a, workdir: w}\n  - {name: a, workdir: v}\n",
            "jobs.yaml:4:6: jobs[1].name: job name 'a' is also jobs[0]'s",
        ),
        ("runbook: missing.yaml\njobs: [{name: a, workdir: w}]\n", "runbook: no such runbook"),
        ("runbook: runbook.yaml\njobs: [{name: 'a b', workdir: w}]\n", "jobs[0].name:"),
        ("runbook: runbook.yaml\njobs: [{name: a, workdir: w, gpus: -1}]\n", "jobs[0].gpus:"),
        ("- a list\n", "jobs.yaml:1:1: a jobs file must be a mapping of keys"),
    ],
)
def test_a_mistake_in_the_jobs_file_names_its_place(
    tmp_path: Path, text: str, expected: str
) -> None:
    found = problems(tmp_path, text)
    assert any(expected in problem for problem in found), found


def test_an_unknown_job_name_is_an_error_that_lists_the_jobs(tmp_path: Path) -> None:
    path = jobs_file(tmp_path, "runbook: runbook.yaml\njobs: [{name: a, workdir: w}]\n")
    with pytest.raises(FatalError, match=r"no job named 'z' .* \(its jobs: a\)"):
        jobs.pick(jobs.load(path), "z")
