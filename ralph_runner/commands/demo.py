"""`ralph-run demo`: the whole loop on the stand-in server, two deaths recovered, in a minute.

It makes a throw-away git workspace, starts the stand-in vLLM, runs runbooks/demo.yaml on it
and, like a bad day on a GPU host, breaks the server twice during the agent's call: its engine
hangs as vLLM's does (/health still 200, no token ever: the progress probe sees it), then a
prompt the stand-in's "KV cache" cannot hold kills it. Then it shows the death log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import threading
from pathlib import Path

from ralph_runner.deaths import log as death_log
from ralph_runner.errors import FatalError
from ralph_runner.loop import state
from ralph_runner.loop.runner import Runner
from ralph_runner.output.bus import EventBus
from ralph_runner.output.console import Console
from ralph_runner.process import execute
from ralph_runner.runbook import loader, plan

PACKAGE = Path(__file__).resolve().parents[1]
RUNBOOK = loader.shipped("runbooks") / "demo.yaml"
START_SCRIPT = PACKAGE / "standin" / "start_server.sh"
ITEMS = [
    "README: say what the game is",
    "src/road.js: scrolling road",
    "src/car.js: the player's car",
    "src/input.js: left/right arrows and A/D",
    "src/collision.js: aabb()",
    "src/game.js: the state machine",
    "tests/collision.test.js",
    "src/score.js: score and best score",
]
MARKER = ".ralph-demo"  # written into the workspace: a folder with it is the demo's to remake
PLAN = "# Plan\n\nA tiny road game, one small file at a time.\n"
AGENT_STEP = "run the agent"
CHAOS: dict[int, dict[str, object]] = {  # iteration -> the fault set of its agent step
    3: {"engine_hang": True},  # /health 200, generation blocked: the progress probe sees it
    6: {"die_on_prompt_chars": 10},  # the KV-cache assertion on the agent's prompt; exit 0
}
WHAT = {  # each fault, as the introduction tells it
    "engine_hang": "its engine hangs, /health still 200",
    "die_on_prompt_chars": "a prompt its KV cache cannot hold kills it",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run demo`'s options."""
    parser.add_argument(
        "--dir",
        default="demo-workspace",
        help="the demo's throw-away workspace (default: demo-workspace): a new or empty "
        "folder, or one an earlier demo made, whose contents it deletes; any other "
        "folder is refused",
    )
    parser.add_argument(
        "--json", action="store_true", help="the loop's events as JSON, one per line"
    )


def main(args: argparse.Namespace) -> int:
    workspace = Path(args.dir).resolve()
    _make_workspace(workspace)
    port = _free_port()
    standin = workspace / ".standin"
    extra = [
        json.dumps(
            {
                "port": port,
                "standin_dir": str(standin),
            }
        )
    ]
    started = execute.run(
        ["bash", str(START_SCRIPT), str(port), str(standin)],
        env={"PYTHON": sys.executable},
        timeout=30,
    )
    if not started.ok:
        print(started.output, file=sys.stderr)
        return 1
    if not args.json:
        _introduce(workspace, port)
    cwd = Path.cwd()
    try:
        os.chdir(workspace)
        (selected,) = plan.build(RUNBOOK, None, None, extra)
        bus = EventBus(Console(json_lines=args.json))
        chaos = threading.Thread(target=_chaos, args=(workspace, standin), daemon=True)
        chaos.start()
        code = Runner(selected, bus).run()
    finally:
        os.chdir(cwd)
        _stop_server(standin)
    _show(workspace, args.json)
    return code


def _introduce(workspace: Path, port: int) -> None:
    """What the newcomer is about to see, before the loop's own lines."""
    breaks = "; ".join(f"iteration {n}: {WHAT[next(iter(f))]}" for n, f in CHAOS.items())
    print(
        f"ralph-run demo: a throw-away git workspace in {workspace},\n"
        f"a stand-in vLLM server on 127.0.0.1:{port}, and the loop of {RUNBOOK.name} over"
        f" {len(ITEMS)} checklist items.\n"
        f"The server is broken on purpose, twice ({breaks}):\n"
        "watch ralph-run find each death, record it, bring the server back and go on.\n",
        flush=True,
    )


def _make_workspace(workspace: Path) -> None:
    """A fresh workspace: in a new or empty folder, or in place of an earlier demo's."""
    _refuse_foreign(workspace)
    try:
        if workspace.exists():
            _empty(workspace)
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / MARKER).write_text(
            "made by `ralph-run demo`: a later demo with this --dir deletes and remakes it\n"
        )
        (workspace / "PLAN.md").write_text(PLAN)
        (workspace / "CHECKLIST.md").write_text("".join(f"- [ ] {item}\n" for item in ITEMS))
        (workspace / ".gitignore").write_text(f".standin/\n{MARKER}\n")
    except OSError as exc:
        raise FatalError(f"cannot make the demo workspace {workspace}: {exc}") from None
    for argv in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        [
            "git",
            "-c",
            "user.name=demo",
            "-c",
            "user.email=demo@localhost",
            "commit",
            "-q",
            "-m",
            "plan and checklist",
        ],
    ):
        execute.run(argv, cwd=workspace, timeout=30)
    for key, value in (("user.name", "ralph demo"), ("user.email", "ralph@localhost")):
        execute.run(["git", "config", key, value], cwd=workspace, timeout=30)


def _refuse_foreign(workspace: Path) -> None:
    """The demo deletes what its --dir holds: only a new or empty folder, or one a demo made
    (its marker; before the marker, its exact PLAN.md and .standin/), is the demo's to take."""
    if workspace.exists() and not workspace.is_dir():
        raise FatalError(f"demo: {workspace} is not a folder: give --dir a new or empty folder")
    try:
        if not workspace.is_dir() or not any(workspace.iterdir()):
            return
        if (workspace / MARKER).is_file():
            return
        plan = workspace / "PLAN.md"  # a workspace a demo made before it wrote the marker:
        if (
            (workspace / ".standin").is_dir()
            and plan.is_file()
            and plan.read_text(errors="replace") == PLAN
        ):
            return
    except OSError as exc:
        raise FatalError(f"demo: cannot read {workspace}: {exc}") from None
    raise FatalError(
        f"demo: {workspace} is not empty and no earlier demo made it; the demo would delete"
        " what is in it, so it leaves it alone: give --dir a new or empty folder"
    )


def _empty(workspace: Path) -> None:
    """What an earlier demo left, deleted; the folder itself stays (it may be the cwd)."""
    for entry in workspace.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _chaos(workspace: Path, standin: Path) -> None:
    """Break the server at the iterations of CHAOS, through its control file."""
    store = state.Store(workspace)
    pending = dict(CHAOS)
    stop = threading.Event()
    while pending and not stop.wait(0.05):
        status = store.read_status()
        if status is None:  # the loop has not written it yet
            continue
        if status["iteration"] in pending and status["phase"] == AGENT_STEP:
            (standin / "control.json").write_text(json.dumps(pending.pop(status["iteration"])))
        if not status["running"]:
            return


def _stop_server(standin: Path) -> None:
    pid_file = standin / "server.pid"
    if pid_file.is_file():
        with contextlib.suppress(ValueError):
            execute.kill_tree(int(pid_file.read_text().strip()))


def _show(workspace: Path, json_lines: bool) -> None:
    """The deaths in a few lines, where the records are, and what to try next: the summary
    stays on screen (a whole death record is ~100 lines: `ralph-run deaths` shows them)."""
    log = workspace / "logs" / "vllm-deaths.log"
    records = death_log.read_records(death_log.records_path(log))
    from ralph_runner.deaths import html as html_report
    from ralph_runner.deaths import stats  # the demo ends with its report

    report = workspace / "report.html"
    html_report.write(stats.load([str(workspace)]), report)
    if json_lines:
        print(json.dumps({"event": "demo", "log": str(log), "report": str(report)}))
        return
    print()
    print(death_log.summarize(records))
    print(f"\ndeath log: {log}\njson records: {death_log.records_path(log)}\nreport: {report}")
    print(
        "\nnext:\n"
        f"  ralph-run deaths {workspace}     each death: its class, evidence, recovery\n"
        f"  less {log}     the reports, as the bash loop's death log had them\n"
        f"  cp {RUNBOOK} my-runbook.yaml     a runbook of your own (docs: getting-started)"
    )
