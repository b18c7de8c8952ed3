"""Drive `ralph-run` end to end: a git workspace, the stand-in server, the CLI as a subprocess.

A `Scenario` owns one tmp directory: the agent's workspace (`work/`, a git repo with PLAN.md and
CHECKLIST.md), the stand-in server (`vllm/`, started by the real start script) and a runbook
shaped like runbooks/demo.yaml with every timeout scaled down to seconds. `Scenario.start()`
runs `python -m ralph_runner RUNBOOK --json -e {...}` in the workspace and returns a `RalphRun`
that collects the JSON events as they are printed, so a test waits on events or on
`.ralph/status.json` (never on a sleep) to break the server at the moment it chooses.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import psutil
import yaml

from support.standin import START_SCRIPT, StandIn, python_env, wait_for

AGENT_STEP = "run the agent"
SERVER_LOG_SECTION = "server log (last 60 lines)"
ENGINE_PROBE = {  # demo.yaml's
    "name": "engine progress",
    "progress": {
        "metrics": "{{ base_url | regex_replace('/v1/?$', '') }}/metrics",
        "completion": {"url": "{{ base_url }}", "model": "{{ model }}"},
        "stall_after": 3,
    },
    "timeout": 2,
}
ITEM_SECTION = "current item"
DEATH_LINE = "AssertionError: num_required_blocks"
GIT_IDENTITY = (("user.name", "ralph e2e"), ("user.email", "ralph-e2e@localhost"))


def make_workspace(path: Path, items: Sequence[str]) -> Path:
    """A git repository with PLAN.md and a CHECKLIST.md of `items`, all committed."""
    path.mkdir(parents=True)
    (path / "PLAN.md").write_text("# Plan\n\nOne small change per checklist item.\n")
    (path / "CHECKLIST.md").write_text("".join(f"- [ ] {item}\n" for item in items))
    git = ["git", "-C", str(path)]
    subprocess.run([*git, "init", "-q"], check=True)
    for key, value in GIT_IDENTITY:
        subprocess.run([*git, "config", key, value], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "plan and checklist"], check=True)
    return path


def runbook(
    *,
    agent_sleep: str = "0.1",
    agent_timeout: float = 5,
    after_agent: str = "",
    step_timeout: float = 20,
    probe_timeout: float = 1,
    failures_before_dead: int = 2,
    interval: float = 0.1,
    watch: float = 0.3,
    attempts: int = 2,
    delay: float = 0.2,
    healthy_within: float = 10,
    max_iterations: int = 20,
    variables: dict[str, Any] | None = None,
    engine_probe: bool = False,
) -> dict[str, Any]:
    """runbooks/demo.yaml in seconds: one probe, quick collectors, the stand-in agent.

    `engine_probe` adds demo.yaml's progress probe first: an engine death whose API server
    still answers for a moment (as vLLM's, --shutdown-delay) is seen by its 1-token canary.

    `agent_sleep` is a Jinja expression (it may use `iteration`), the agent's thinking time;
    `after_agent` is shell appended to the agent's command with `&&` (it keeps bash as the
    agent's parent, so the step is a process tree).
    """
    agent = (
        "{{ python }} -m ralph_runner.standin.agent --url {{ base_url }} --model {{ model }}"
        f" --timeout {agent_timeout:g} --sleep {{{{ {agent_sleep} }}}} -- {{{{ prompt }}}}"
    )
    if after_agent:
        agent += f" && {after_agent}"
    return {
        "name": "e2e loop on the vLLM stand-in",
        "hosts": "localhost",
        "vars": {
            "port": 8000,  # the stand-in's facts come with -e, as `ralph-run demo` passes them
            "base_url": "http://127.0.0.1:{{ port }}/v1",
            "model": "stand-in",
            "service_name": "vLLM stand-in",
            "standin_dir": ".standin",
            "standin_start": "start_server.sh",
            "python": "python3",
            **(variables or {}),
        },
        "workdir": ".",
        "checklist": {"path": "CHECKLIST.md", "strikes": 3},
        "prompt": "Read PLAN.md. Do exactly this item, tick it, commit: {{ item.text }}\n",
        "health": {
            "probes": [
                *([ENGINE_PROBE] if engine_probe else []),
                {
                    "name": "models endpoint",
                    "http": {"url": "{{ base_url }}/models", "status": 200},
                    "timeout": probe_timeout,
                },
            ],
            "failures_before_dead": failures_before_dead,
            "interval": interval,
            "watch": watch,
        },
        "diagnostics": {
            "log": "logs/deaths.log",
            "timeout": 5,
            "collect": [
                {"use": "checklist"},
                {"use": "git"},
                {"name": SERVER_LOG_SECTION, "shell": "tail -n 60 {{ standin_dir }}/server.log"},
                {"name": ITEM_SECTION, "shell": "printf '%s\\n' {{ item.text }}"},
            ],
        },
        "recovery": {
            "steps": [
                {
                    "name": "start the stand-in",
                    "shell": "PYTHON={{ python }} HEALTH_TIMEOUT=1"
                    " {{ standin_start }} {{ port }} {{ standin_dir }}",
                    "timeout": 30,
                }
            ],
            "attempts": attempts,
            "delay": delay,
            "healthy_within": healthy_within,
            "exit_code": 4,
        },
        "loop": {
            "max_iterations": max_iterations,
            "steps": [
                {"ensure_alive": {"phase": "start"}},
                {"name": AGENT_STEP, "shell": agent, "timeout": step_timeout},
                {"ensure_alive": {"phase": "post-step"}},
                {"verify": {"checked": True, "committed": True}},
            ],
        },
    }


class RalphRun:
    """One `ralph-run RUNBOOK --json` process; its events as they arrive, its status file."""

    started: ClassVar[list[RalphRun]] = []  # killed after each test (support/fixtures.py)

    def __init__(self, command: list[str], cwd: Path) -> None:
        RalphRun.started.append(self)
        self.cwd = cwd
        self.events: list[dict[str, Any]] = []
        self.noise: list[str] = []  # stdout lines that are not JSON events
        self.stderr = ""
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a signal from the terminal is for pytest, not for it
        )
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_events(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                try:
                    self.events.append(json.loads(line))
                except json.JSONDecodeError:
                    self.noise.append(line)
                self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        self.stderr = self.process.stderr.read()

    # looking

    def of(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        """The events of one kind so far, optionally only those with the given field values."""
        with self._changed:
            events = list(self.events)
        return [
            e
            for e in events
            if e["event"] == kind and all(e.get(k) == v for k, v in fields.items())
        ]

    def wait_event(self, kind: str, timeout: float = 20, **fields: Any) -> dict[str, Any]:
        """The first `kind` event with these fields; fails the test at the deadline or exit."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (found := self.of(kind, **fields)):
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._reading()):
                    raise AssertionError(
                        f"no {kind} event with {fields} (exit {self.process.poll()}); "
                        f"events: {self.events}; stderr: {self.stderr}"
                    )
                self._changed.wait(min(left, 0.1))
        return found[0]

    def _reading(self) -> bool:
        return self._readers[0].is_alive()

    def status(self) -> dict[str, Any]:
        """`.ralph/status.json` now; {} before the first write."""
        path = self.cwd / ".ralph" / "status.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_status(
        self, condition: Callable[[dict[str, Any]], bool], what: str, timeout: float = 20
    ) -> dict[str, Any]:
        def holds() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise AssertionError(f"ralph-run ended before {what}: {self.events} {self.stderr}")
            status = self.status()
            return status if status and condition(status) else None

        return wait_for(holds, timeout, what)

    def wait_agent(self, iteration: int, timeout: float = 20) -> dict[str, Any]:
        """Waits until the agent step of `iteration` or a later one runs (the run's phase, or
        one worker's with `loop.workers` > 1); the status then."""

        def phases(s: dict[str, Any]) -> list[str | None]:
            return [s.get("phase"), *(w.get("phase") for w in s.get("workers") or [])]

        return self.wait_status(
            lambda s: s.get("iteration", 0) >= iteration and AGENT_STEP in phases(s),
            f"the agent step of iteration {iteration}",
            timeout,
        )

    # ending

    def wait(self, timeout: float = 90) -> int:
        """The exit code, once the process and both readers are done."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"ralph-run still running after {timeout} s: {self.events}"
            ) from None
        for reader in self._readers:
            reader.join(10)
        return code

    def send(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, for a test that failed half-way: ralph-run and whatever it left running."""
        if self.process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                children = psutil.Process(self.process.pid).children(recursive=True)
                for process in [psutil.Process(self.process.pid), *children]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
            self.process.wait(10)


class Scenario:
    """A workspace, a stand-in server and the runbook that ties them, under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.workspace = root / "work"
        self.standin = StandIn(root / "vllm")
        self.runbook_path = root / "runbook.yaml"
        self.runs: list[RalphRun] = []

    def prepare(self, items: Sequence[str], **settings: Any) -> Scenario:
        """Workspace, runbook (`settings`: see `runbook`) and a healthy stand-in."""
        make_workspace(self.workspace, items)
        self.runbook_path.write_text(yaml.safe_dump(runbook(**settings), sort_keys=False))
        self.standin.start(HEALTH_TIMEOUT="1")
        return self

    @property
    def facts(self) -> dict[str, Any]:
        """What `ralph-run demo` passes with -e: where the stand-in is, how to start it."""
        return {
            "port": self.standin.port,
            "standin_dir": str(self.standin.state_dir),
            "standin_start": str(START_SCRIPT),
            "python": sys.executable,
        }

    def start(self, **extra_vars: Any) -> RalphRun:
        command = [sys.executable, "-m", "ralph_runner", str(self.runbook_path), "--json"]
        command += ["-e", json.dumps({**self.facts, **extra_vars})]
        run = RalphRun(command, self.workspace)
        self.runs.append(run)
        return run

    # the files a run leaves

    def command(self, *args: str) -> str:
        """`ralph-run ARGS` run to its end in the workspace (exit 0 or 1): what it printed,
        stdout then stderr, for the tests that search every stream."""
        done = subprocess.run(
            [sys.executable, "-m", "ralph_runner", *args],
            cwd=self.workspace,
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode in (0, 1), done.stderr
        return done.stdout + done.stderr

    def checklist(self) -> str:
        return (self.workspace / "CHECKLIST.md").read_text(encoding="utf-8")

    def marks(self) -> list[str]:
        """The marker of every checklist item, in order: " ", "x" or "!"."""
        return [line[3] for line in self.checklist().splitlines() if line.startswith("- [")]

    def death_log(self) -> str:
        path = self.workspace / "logs" / "deaths.log"
        return path.read_text(encoding="utf-8") if path.exists() else ""

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The JSON twin's records (`kind`: "death" or "recovery" only)."""
        path = self.workspace / "logs" / "deaths.jsonl"
        if not path.exists():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        return [r for r in records if kind is None or r["event"] == kind]

    def state(self) -> dict[str, Any]:
        return json.loads((self.workspace / ".ralph" / "state.json").read_text(encoding="utf-8"))

    # processes

    def agent_processes(self) -> list[psutil.Process]:
        """Live processes of the agent step: the stand-in agent and a shell running it."""
        return [p for p in _live() if _mentions(p, "ralph_runner.standin.agent", self.standin.url)]

    def wait_agent_tree(self, timeout: float = 10) -> list[psutil.Process]:
        """The agent step's shell and the agent under it, once both run."""

        def tree() -> list[psutil.Process] | None:
            found = self.agent_processes()
            return found if len(found) >= 2 else None

        return wait_for(tree, timeout, "the agent and its shell")

    def leftovers(self) -> list[str]:
        """Every live process of this scenario: one working in or naming its directory (the
        stand-in servers, ralph-run, the agent's tree) or an agent calling its server."""
        agents = {p.pid for p in self.agent_processes()}
        return processes_in(self.root, also=lambda p: p.pid in agents)

    def assert_nothing_left(self) -> None:
        """Stops the stand-in (as its owner would), then: no process of this scenario remains."""
        self.standin.stop()
        leftovers: list[str] = []

        def none_left() -> bool:
            leftovers[:] = self.leftovers()
            return not leftovers

        with contextlib.suppress(AssertionError):
            wait_for(none_left, 5, "no process left")
        assert not leftovers, f"processes left behind: {leftovers}"

    def close(self) -> None:
        """Teardown after a failure too: kill what is still running."""
        for run in self.runs:
            run.kill()
        self.standin.stop()


def report_blocks(log: str) -> list[dict[str, str]]:
    """The death log's reports, each as {section name: its text}; "" holds the header lines.

    Lines between reports (the recovery outcome lines) belong to none.
    """
    blocks: list[dict[str, str]] = []
    sections: dict[str, str] | None = None
    name = ""
    for line in log.splitlines():
        if line.startswith("=====") and "down detected" in line:
            sections, name = {"": line + "\n"}, ""
            blocks.append(sections)
        elif line == "===== END =====":
            sections = None
        elif sections is None:
            continue
        elif line.startswith("--- ") and line.endswith(" ---"):
            name = line[4:-4]
            sections[name] = ""
        else:
            sections[name] += line + "\n"
    return blocks


def recovery_lines(log: str) -> list[str]:
    """The death log's recovery outcome lines, in order."""
    return [line for line in log.splitlines() if line.startswith("--- recovery")]


def collector_output(death: dict[str, Any], name: str) -> str:
    (found,) = [c for c in death["collectors"] if c["name"] == name]
    return found["output"]


def processes_in(
    directory: Path, also: Callable[[psutil.Process], bool] = lambda _: False
) -> list[str]:
    """Live processes (not this one) whose command line names `directory` or whose current
    directory is inside it, plus those `also` picks; as "PID: COMMAND" lines."""
    found = []
    for process in _live():
        if process.pid == _SELF:
            continue
        if _mentions(process, str(directory)) or _works_in(process, directory) or also(process):
            found.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])}")
    return found


_SELF = psutil.Process().pid


def _live() -> list[psutil.Process]:
    processes = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] != psutil.STATUS_ZOMBIE:  # a zombie has ended (process_gone)
            processes.append(process)
    return processes


def _mentions(process: psutil.Process, *needles: str) -> bool:
    command = " ".join(process.info["cmdline"] or [])
    return all(needle in command for needle in needles)


def _works_in(process: psutil.Process, directory: Path) -> bool:
    try:
        cwd = Path(process.cwd())
    except (psutil.Error, OSError):
        return False
    return cwd == directory or directory in cwd.parents
