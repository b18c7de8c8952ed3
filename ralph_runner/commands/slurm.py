"""`ralph-run slurm submit|status|top|pause|resume|stop JOBS.yaml`: loops as Slurm jobs.

The jobs file (slurm/jobs.py) names the runbook and one loop per workdir; `submit` writes each
loop's batch script into its workdir (`.ralph/slurm/script.sh`) and sbatches it (`--check`
prints the scripts and submits nothing); the others act on every job of the file, or on the
one `--job NAME` picks. docs/slurm.md is the recipe.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from datetime import datetime

from ralph_runner.commands import pause as pause_command
from ralph_runner.commands import top
from ralph_runner.errors import ExitCode
from ralph_runner.slurm import client, jobs, script, submissions
from ralph_runner.workspace import status_file

ACTIONS = ("submit", "status", "top", "pause", "resume", "stop")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run slurm`'s options."""
    parser.add_argument("action", choices=ACTIONS, help="what to do with the jobs")
    parser.add_argument("jobs_file", metavar="JOBS.yaml", help="the jobs file (docs/slurm.md)")
    parser.add_argument("--job", metavar="NAME", help="only the job of this name")
    parser.add_argument(
        "--check", action="store_true", help="submit: print each job's batch script, submit none"
    )
    parser.add_argument("--now", action="store_true", help="pause: stop the running step now")
    parser.add_argument("--json", action="store_true", help="status: one JSON object per job")
    parser.add_argument("--once", action="store_true", help="top: one plain snapshot")


def main(args: argparse.Namespace) -> int:
    selected = jobs.pick(jobs.load(args.jobs_file), args.job)
    match args.action:
        case "submit":
            return _submit(selected, args.check)
        case "status":
            return _status(selected, args.json)
        case "top":
            targets = [str(job.workdir) for job in selected]
            return top.main(
                argparse.Namespace(
                    targets=targets, inventory=None, limit=None, timeout=5.0, once=args.once
                )
            )
        case "pause" | "resume":
            for job in selected:
                pause_command.control_main(
                    argparse.Namespace(
                        target=str(job.workdir), inventory=None, now=args.now, json=False
                    ),
                    args.action,
                )
            return 0
        case _:
            return _stop(selected)


def _submit(selected: list[jobs.Resolved], check: bool) -> int:
    for job in selected:
        text = script.render(job)
        if check:
            print(f"# ---- {job.name}: {submissions.script_path(job.workdir)} ----")
            print(text)
            continue
        path = submissions.write_script(job.workdir, text)
        job_id = client.submit(path)
        submissions.save(job.workdir, job_id, job.name, job.jobs_file)
        print(f"{job.name}: submitted job {job_id} ({path})")
    return 0


@dataclass
class Row:
    """One job as `status` shows it: Slurm's view joined with its loop's status.json."""

    name: str
    job_id: str | None
    slurm: str  # PENDING, RUNNING, COMPLETED, ...; "not submitted"
    where: str  # the node, or why it waits
    elapsed: str
    attempts: int  # starts of the job: 1 + its requeues that started
    requeues: int
    loop: str | None  # status.json's status; None: the loop never ran
    paused: bool
    done: int | None
    todo: int | None
    deaths: int
    workdir: str

    def loop_text(self) -> str:
        text = self.loop or "never ran"
        if self.done is not None:
            text += f", {self.done}/{self.done + (self.todo or 0)} items"
        return text + f", {self.deaths} deaths" + (", paused" if self.paused else "")


def rows(selected: list[jobs.Resolved]) -> list[Row]:
    records = {job.name: submissions.load(job.workdir) for job in selected}
    slurm = client.states([record.job_id for record in records.values() if record is not None])
    found = []
    for job in selected:
        record = records[job.name]
        loop = status_file.read(job.workdir) if job.workdir.is_dir() else None
        seen = submissions.attempts(job.workdir, record.job_id) if record else []
        state = slurm.get(record.job_id) if record else None
        found.append(
            Row(
                name=job.name,
                job_id=record.job_id if record else None,
                slurm=state.state if state else "not submitted",
                where=state.node if state else "",
                elapsed=state.elapsed if state else "",
                attempts=sum(1 for a in seen if a.event == "start"),
                requeues=sum(1 for a in seen if a.event.startswith("requeue")),
                loop=loop["status"] if loop else None,
                paused=bool(loop and loop["paused"]),
                done=loop.get("done") if loop else None,
                todo=loop.get("todo") if loop else None,
                deaths=loop["deaths"] if loop else 0,
                workdir=str(job.workdir),
            )
        )
    return found


def _status(selected: list[jobs.Resolved], as_json: bool) -> int:
    found = rows(selected)
    if as_json:
        for row in found:
            print(json.dumps(asdict(row), sort_keys=True))
    else:
        print(
            f"{'job':16} {'id':>7} {'slurm':11} {'node/reason':16} {'elapsed':>9} "
            f"{'tries':>5} {'requeues':>8}  loop"
        )
        for row in found:
            print(
                f"{row.name:16} {row.job_id or '-':>7} {row.slurm:11} {row.where[:16]:16} "
                f"{row.elapsed:>9} {row.attempts:>5} {row.requeues:>8}  {row.loop_text()}"
            )
        print(f"as of {datetime.now().strftime('%H:%M:%S')}")
    return ExitCode.PARTIAL if any(row.job_id is None for row in found) else 0


def _stop(selected: list[jobs.Resolved]) -> int:
    """scancel: the loop gets SIGTERM and runs its teardown; nothing is requeued."""
    code = 0
    for job in selected:
        record = submissions.load(job.workdir)
        if record is None:
            print(f"{job.name}: never submitted")
            code = ExitCode.PARTIAL
            continue
        client.cancel(record.job_id)
        print(f"{job.name}: job {record.job_id} cancelled (its loop runs its teardown)")
    return code
