"""Helpers of the `ralph-run top` tests: a tmux pane to run it in, the screen's rows, and
workdirs whose files a thread keeps rewriting as a running loop does."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml
from support.e2e import AGENT_STEP, Scenario
from support.standin import python_env, wait_for

from ralph_runner.durable.files import write_atomic


class Pane:
    """One tmux server of its own (-L), one 80x24 window running a command."""

    def __init__(
        self, name: str, command: list[str], cwd: Path, env: dict[str, str] | None = None
    ) -> None:
        self.tmux = ["tmux", "-L", name]
        values = {**tmux_env(), **(env or {})}
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in values.items())
        shell = f"cd {shlex.quote(str(cwd))} && exec env {exports} {shlex.join(command)}"
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-x", "80", "-y", "24", "-s", "top", shell],
            check=True,
        )

    def text(self) -> str:
        done = subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True
        )
        return done.stdout

    def wait_text(self, *needles: str, timeout: float = 20, row: str = "") -> str:
        """The screen once it shows every needle (and a line starting with `row` that holds
        the first needle, when given)."""

        def shows(text: str) -> str | None:
            if row and not any(
                line.startswith(row) and needles[0] in line for line in text.splitlines()
            ):
                return None
            return text if all(n in text for n in needles) else None

        return self.wait_screen(shows, timeout, f"{needles} on the screen")

    def wait_screen(self, condition: Any, timeout: float, what: str) -> Any:
        """condition(screen text) polled until truthy; the failure shows the last screen."""
        try:
            return wait_for(lambda: condition(self.text()), timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n{self.text()}") from None

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "top", *keys], check=True)

    def alive(self) -> bool:
        found = subprocess.run([*self.tmux, "has-session", "-t", "top"], capture_output=True)
        return found.returncode == 0

    def process(self) -> psutil.Process:
        """The process in the pane (the shell exec'd it)."""
        done = subprocess.run(
            [*self.tmux, "display", "-p", "-t", "top", "#{pane_pid}"],
            capture_output=True,
            text=True,
            check=True,
        )
        return psutil.Process(int(done.stdout.strip()))

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


def tmux_env() -> dict[str, str]:
    env = python_env()
    return {"PYTHONPATH": env["PYTHONPATH"], "TERM": "xterm-256color", "LANG": "C.UTF-8"}


def row_of(screen: str, name: str) -> str | None:
    """The table's line of the loop `name` (selected or not)."""
    for line in screen.splitlines():
        if line[1:].split(" ", 1)[0] == name and line[:1] in (">", " "):
            return line
    return None


STATE = re.compile(r"(no answer \S+|recovering \S+|limited \S+|\S+)")


def state_of(screen: str, name: str) -> str | None:
    """The state cell of a loop's row: it starts under the `state` header."""
    header, line = _header(screen), row_of(screen, name)
    if header is None or line is None:
        return None
    found = STATE.match(line[header.index(" state ") + 1 :])
    return found.group(1) if found else None


def iteration_of(screen: str, name: str) -> int | None:
    return number_of(screen, name, "it")


def number_of(screen: str, name: str, column: str) -> int | None:
    """A right-justified cell of a loop's row (it, deaths): it ends under its header's end."""
    header, line = _header(screen), row_of(screen, name)
    if header is None or line is None:
        return None
    words = line[: header.index(f" {column} ") + 1 + len(column)].split()
    return int(words[-1]) if words and words[-1].isdigit() else None


def _header(screen: str) -> str | None:
    return next((line for line in screen.splitlines() if line.startswith("loop ")), None)


class Rewriter(threading.Thread):
    """Keeps the files of workdirs changing as their loops' would: status.json rewritten every
    `period` s (a new iteration each time: iteration, item, step start), a line appended to
    iterations.jsonl and a sample to the recorder's ring per iteration. The templates are the
    files of a real run (`template`, a workdir a loop ran in)."""

    def __init__(self, template: Path, workdirs: list[Path], period: float = 0.5) -> None:
        super().__init__(daemon=True)
        for workdir in workdirs:
            shutil.copytree(template / ".ralph", workdir / ".ralph", dirs_exist_ok=True)
        state = template / ".ralph"
        self.status = json.loads((state / "status.json").read_text())
        self.line = json.loads((state / "iterations.jsonl").read_text().splitlines()[-1])
        samples = [
            json.loads(line)
            for segment in sorted((state / "recorder").glob("segment-*.jsonl"))
            for line in segment.read_text().splitlines()
            if '"sample"' in line
        ]
        self.sample = samples[-1]
        self.workdirs, self.period = workdirs, period
        self.iteration = {workdir: 0 for workdir in workdirs}
        self.held: set[Path] = set()  # workdirs not rewritten for now
        self.stop = threading.Event()
        self.writes = 0

    def run(self) -> None:
        while not self.stop.wait(self.period):
            for workdir in self.workdirs:
                if workdir not in self.held:
                    self.write(workdir)
            self.writes += 1

    def write(self, workdir: Path) -> None:
        now = time.time()
        self.iteration[workdir] += 1
        n = self.iteration[workdir]
        status = {
            **self.status,
            "status": "running",
            "running": True,
            "pid": os.getpid(),  # alive: this test
            "iteration": n,
            "item": f"{workdir.name}: item {n}",
            "phase": "run the agent",
            "step_started": now,
            "updated": now,
            "paused": False,
            "pause": None,
            "workdir": str(workdir),
        }
        state = workdir / ".ralph"
        write_atomic(state / "status.json", json.dumps(status, indent=2).encode())
        line = {**self.line, "iteration": n - 1, "started": now - self.period, "outcome": "done"}
        with open(state / "iterations.jsonl", "a") as history:
            history.write(json.dumps(line) + "\n")
        metrics = dict(self.sample["sample"].get("metrics") or {})
        metrics["vllm:generation_tokens_total"] = 50.0 * n
        sample = {"t": round(now, 3), "sample": {**self.sample["sample"], "metrics": metrics}}
        segment = sorted((state / "recorder").glob("segment-*.jsonl"))[-1]
        with open(segment, "a") as ring:
            ring.write(json.dumps(sample) + "\n")

    def close(self) -> None:
        self.stop.set()
        self.join(5)


RECORDED = [  # demo.yaml's recorder metrics
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
]


def watched_runbook(path: Path, recovery_delay: float = 0.0) -> None:
    """The e2e runbook at `path` with what top shows: the flight recorder (a sample every
    0.5 s, the server's log), the agent through the loop's proxy (its receipts) and, with
    `recovery_delay`, a recovery that takes that many seconds more (for the screen to see)."""
    book = yaml.safe_load(path.read_text())
    book["recorder"] = {
        "url": "http://127.0.0.1:{{ port }}/metrics",
        "metrics": RECORDED,
        "period": 0.5,
        "gpu": False,
        "file": "{{ standin_dir }}/server.log",
    }
    book["loop"]["proxy"] = True
    agent = next(s for s in book["loop"]["steps"] if s.get("name") == AGENT_STEP)
    agent["shell"] = agent["shell"].replace("--url {{ base_url }}", "--url {{ agent_base_url }}")
    if recovery_delay:
        start = book["recovery"]["steps"][0]
        start["shell"] = f"sleep {recovery_delay:g} && {start['shell']}"
    path.write_text(yaml.safe_dump(book, sort_keys=False))


@contextlib.contextmanager
def recorded_workdir(root: Path) -> Iterator[Path]:
    """A workdir a real loop ran in, two items, with the recorder and the agent proxy: the
    files that workdirs of busy loops start from (Rewriter)."""
    scenario = Scenario(root)
    try:
        scenario.prepare(["one", "two"], agent_sleep="0.6")
        watched_runbook(scenario.runbook_path)
        run = scenario.start()
        assert run.wait(60) == 0, run.stderr
        yield scenario.workspace
    finally:
        scenario.close()
