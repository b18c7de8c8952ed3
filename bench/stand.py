"""What every case stands on: the stand-in server, git workspaces, timed processes, timestamps.

Every process the bench starts runs in its own session and is killed with it, so a peer that
hangs (the seed's diagnostics block does, by design) leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SEED_LOOP = BENCH / "seed" / "ralph-loop.sh"
SEED_START = BENCH / "seed" / "start_vllm.sh"
STUBS = BENCH / "stubs"
AGENTS = BENCH / "agents"
RUNBOOKS = BENCH / "runbooks"
ANSIBLE = BENCH / "ansible"
START_SERVER = ROOT / "ralph_runner" / "standin" / "start_server.sh"
HUNG_COLLECTOR = "nvidia-smi-hung"  # the process name of bench/stubs/nvidia-smi when it hangs


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bench_env(scratch: Path, **extra: Any) -> dict[str, str]:
    """The environment of every peer: stub tools first on PATH, this Python, a scratch dir."""
    path = os.pathsep.join([str(STUBS), str(Path(sys.executable).parent), os.environ["PATH"]])
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    base = {
        **os.environ,
        "PATH": path,
        "PYTHONPATH": python_path,
        "PYTHON": sys.executable,
        "BENCH_STATE": str(scratch),
        "ANSIBLE_HOME": str(scratch / "ansible-home"),
        "ANSIBLE_LOCALHOST_WARNING": "False",
        "ANSIBLE_NOCOLOR": "1",
    }
    return {**base, **{key: str(value) for key, value in extra.items()}}


class Server:
    """One stand-in server (port + state directory), whichever process currently serves them."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root_url}/v1"
        state_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """start_server.sh: idempotent, replaces a hung server, returns once healthy."""
        result = subprocess.run(
            ["bash", str(START_SERVER), str(self.port), str(self.state_dir)],
            env=bench_env(self.state_dir),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"stand-in did not start: {result.stdout}{result.stderr}")

    def healthy(self, timeout: float = 0.5) -> bool:
        try:
            return httpx.get(f"{self.root_url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def processes(self) -> list[psutil.Process]:
        """Every live process serving (or about to serve) this state directory."""
        found = []
        for process in psutil.process_iter(["cmdline", "status"]):
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if str(self.state_dir) in " ".join(process.info["cmdline"] or []):
                found.append(process)
        return found

    def kill(self) -> None:
        """TERM, then KILL, every process of this server; returns once none answers."""
        processes = self.processes()
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signum)
            deadline = time.monotonic() + 3
            while any(alive(p) for p in processes) and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.healthy():
            raise RuntimeError(f"stand-in on port {self.port} survived SIGKILL")


def alive(process: psutil.Process) -> bool:
    """A zombie counts as gone: PID 1 here reaps orphans slowly."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class HealthyAgain:
    """Polls /health every 10 ms from a thread; `at` is the wall time of the first 200 seen."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="healthy-again", daemon=True)

    def __enter__(self) -> HealthyAgain:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        with httpx.Client() as client:
            while not self._stop.wait(0.01):
                try:
                    ok = client.get(f"{self.server.root_url}/health", timeout=0.2).status_code
                except httpx.HTTPError:
                    continue
                if ok == 200:
                    self.at = time.time()
                    return


def workspace(path: Path, items: int, done: int = 0) -> Path:
    """A git work tree with PLAN.md and a CHECKLIST.md of `items` items, `done` of them ticked."""
    path.mkdir(parents=True)
    (path / "PLAN.md").write_text("# Plan\n\nA tiny road game, one small file at a time.\n" * 20)
    lines = [
        f"- [{'x' if n < done else ' '}] item {n + 1}: write part {n + 1}" for n in range(items)
    ]
    (path / "CHECKLIST.md").write_text("\n".join(lines) + "\n")
    (path / ".gitignore").write_text("logs/\n")
    for argv in (
        ["git", "init", "-q"],
        ["git", "config", "user.name", "bench"],
        ["git", "config", "user.email", "bench@localhost"],
        ["git", "add", "-A"],
        ["git", "commit", "-q", "-m", "plan and checklist"],
    ):
        subprocess.run(argv, cwd=path, check=True, capture_output=True)
    return path


def ticked(path: Path) -> int:
    return (path / "CHECKLIST.md").read_text().count("- [x]")


@dataclass
class Finished:
    code: int | None  # None: killed at the time limit
    seconds: float
    stdout: str
    stderr: str


def run_timed(argv: list[str], *, cwd: Path, env: dict[str, str], limit: float) -> Finished:
    """Run in a new session; past `limit` s the whole session is killed (code None)."""
    started = time.perf_counter()
    child = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=limit)
        code: int | None = child.returncode
    except subprocess.TimeoutExpired:
        kill_session(child.pid)
        stdout, stderr = child.communicate()
        code = None
    seconds = time.perf_counter() - started
    kill_session(child.pid)  # whatever it left running in its session
    return Finished(code, seconds, stdout, stderr)


def kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def require(finished: Finished, what: str, code: int | None = 0) -> Finished:
    """The run ended as expected, or the bench stops saying why (a broken peer is no baseline)."""
    if finished.code != code:
        tail = (finished.stdout + finished.stderr)[-2000:]
        raise RuntimeError(f"{what}: exit {finished.code}, expected {code}:\n{tail}")
    return finished


def events(stdout: str) -> list[dict[str, Any]]:
    """ralph-run --json's events."""
    found = []
    for line in stdout.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and "event" in event:
                found.append(event)
    return found


def first(found: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any]:
    for event in found:
        if event["event"] == kind and all(event.get(k) == v for k, v in match.items()):
            return event
    raise RuntimeError(f"no {kind} event {match or ''} in ralph-run's output")


def marks(path: Path) -> dict[str, float]:
    """The seed loop's bench_mark lines: the first time of each mark."""
    found: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            stamp, what = line.split(" ", 1)
            found.setdefault(what, float(stamp))
    return found


def ralph_run(runbook: str, *options: str) -> list[str]:
    """ralph-run as users run it, one JSON event per line."""
    return [sys.executable, "-m", "ralph_runner", str(RUNBOOKS / runbook), "--json", *options]


def runbook_vars(server: Server, **more: Any) -> str:
    """The -e JSON that points a bench runbook at `server` and this checkout."""
    values = {
        "port": server.port,
        "standin_dir": str(server.state_dir),
        "standin_start": str(START_SERVER),
        "python": sys.executable,
        "agent": str(AGENTS / "instant.sh"),
        "gpu_sched": str(STUBS / "gpu-sched"),
        **more,
    }
    return json.dumps(values)


def leftovers() -> list[str]:
    """Hung collectors still running: each one is a process a peer failed to clean up."""
    found = []
    for process in psutil.process_iter(["cmdline", "pid"]):
        cmdline = process.info["cmdline"] or []
        if cmdline and cmdline[0] == HUNG_COLLECTOR and alive(process):
            found.append(f"pid {process.info['pid']}: {' '.join(cmdline)}")
    return found
