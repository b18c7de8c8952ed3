"""Run the vLLM stand-in for a test: start it on a free port, break it, and leave nothing behind.

Usage in a test module (a fixture cannot be shared by import without tripping ruff's F811):

    @pytest.fixture
    def server(tmp_path):
        with StandIn(tmp_path / "vllm") as standin:
            standin.start()
            yield standin
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from signal import SIGKILL, SIGTERM
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import psutil

if TYPE_CHECKING:
    from support.faithful import Target

ROOT = Path(__file__).resolve().parents[2]
START_SCRIPT = ROOT / "ralph_runner" / "standin" / "start_server.sh"
MODEL = "stand-in"
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Polls until `condition()` is truthy and returns its value; fails the test at the deadline.
    Every 20 ms at first, then less often, to once every 0.1 s: a scan of every process costs
    ~11 ms of CPU here, so a long wait polled every 20 ms took over half a core from the
    processes under test."""
    deadline = time.monotonic() + timeout
    pause = 0.02
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 1.25, 0.1)
    return value


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a stand-in process: this interpreter, this checkout on the path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path, **extra}


def ralph(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`ralph-run ARGS` (a command beside a running loop: pause, resume, status), from this
    checkout."""
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", *args],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class StandIn:
    """One stand-in server's port and state directory, whichever process currently serves them."""

    def __init__(self, state_dir: Path, port: int | None = None, model: str = MODEL) -> None:
        self.state_dir = state_dir
        self.port = port or free_port()
        self.model = model
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root_url}/v1"  # the OpenAI base URL, as a runbook's base_url
        self.log_path = state_dir / "server.log"
        state_dir.mkdir(parents=True, exist_ok=True)

    # starting

    @property
    def start_command(self) -> list[str]:
        return [str(START_SCRIPT), str(self.port), str(self.state_dir)]

    def run_start_script(self, **env: str) -> subprocess.CompletedProcess[str]:
        """Runs start_server.sh (env: START_TIMEOUT, HEALTH_TIMEOUT, ...), whatever its outcome."""
        return subprocess.run(
            self.start_command,
            env=python_env(MODEL=self.model, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def start(self, **env: str) -> subprocess.CompletedProcess[str]:
        result = self.run_start_script(**env)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    def spawn(self, *extra_args: str) -> subprocess.Popen[bytes]:
        """Starts the server as a child (to see its exit code) and waits until it answers."""
        command = [sys.executable, "-m", "ralph_runner.standin.server", "--port", str(self.port)]
        command += ["--state-dir", str(self.state_dir), "--model", self.model, *extra_args]
        child = subprocess.Popen(command, env=python_env(), start_new_session=True)
        wait_for(lambda: self.healthy() or child.poll() is not None, what="the server to answer")
        return child

    # looking

    @property
    def pid(self) -> int | None:
        try:
            return int((self.state_dir / "server.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def starts(self) -> int:
        path = self.state_dir / "starts"
        return int(path.read_text()) if path.exists() else 0

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8") if self.log_path.exists() else ""

    def exit_marker(self) -> dict[str, Any] | None:
        path = self.state_dir / "exit.json"
        return json.loads(path.read_text()) if path.exists() else None

    def get(self, path: str, timeout: float = 3.0) -> httpx.Response:
        return httpx.get(self.root_url + path, timeout=timeout)

    def chat(self, prompt: str, timeout: float = 3.0) -> httpx.Response:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}]}
        return httpx.post(f"{self.url}/chat/completions", json=body, timeout=timeout)

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            return self.get("/health", timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def processes(self) -> list[psutil.Process]:
        """Every live stand-in server process serving this state directory."""
        found = []
        for process in psutil.process_iter(["cmdline", "status"]):
            cmdline = process.info["cmdline"] or []
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if "ralph_runner.standin.server" in cmdline and str(self.state_dir) in cmdline:
                found.append(process)
        return found

    # breaking

    def trigger(self, **faults: Any) -> None:
        """Writes control.json atomically: e.g. trigger(die=True), trigger(slow_once=0.5)."""
        partial = self.state_dir / ".control.json.partial"
        partial.write_text(json.dumps(faults))
        partial.replace(self.state_dir / "control.json")

    def admin(self, mode: str, value: Any = True) -> httpx.Response:
        body = {"mode": mode, "value": value}
        return httpx.post(f"{self.root_url}/admin/fail", json=body, timeout=3.0)

    def engine_admin(self, mode: str) -> Callable[[], None]:
        return lambda: self.admin(mode).raise_for_status()

    def target(
        self, child: subprocess.Popen[bytes] | None = None, long_tokens: int = 300
    ) -> Target:
        """This stand-in as a Target for the shared checks, broken through its admin endpoint;
        its exit code is the child's (spawn) or else the exit marker's."""
        from support.faithful import Target  # it imports this module

        def exit_code(timeout: float) -> int | None:
            if child is None:
                with contextlib.suppress(AssertionError):
                    return wait_for(self.exit_marker, timeout, "the exit marker")["code"]
                return None
            try:
                return child.wait(timeout)
            except subprocess.TimeoutExpired:
                return None

        return Target(
            root_url=self.root_url,
            model=self.model,
            hang=self.engine_admin("engine_hang"),
            resume=self.engine_admin("resume"),
            kill=self.engine_admin("engine_death"),
            exit_code=exit_code,
            log=self.log,
            long_tokens=long_tokens,
        )

    def wait_dead(self, pid: int, timeout: float = 10.0) -> dict[str, Any]:
        """Waits until `pid` is gone; its exit marker."""
        wait_for(lambda: process_gone(pid), timeout, f"pid {pid} to end")
        return wait_for(self.exit_marker, timeout, "the exit marker")

    # stopping

    def stop(self) -> None:
        """TERM, then KILL, every server of this state directory; waits until they are gone."""
        processes = self.processes()
        for signal in (SIGTERM, SIGKILL):
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal)
            deadline = time.monotonic() + 5
            while not all(process_gone(process.pid) for process in processes):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            else:
                return

    def __enter__(self) -> StandIn:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def process_gone(pid: int) -> bool:
    """True once `pid` has ended; a zombie (not yet reaped by init) counts as ended."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# Reading another process races its end: between two reads it may exit, turn zombie (psutil
# then raises ZombieProcess from cmdline()) or be reaped (NoSuchProcess). A test that scans
# processes reads each through these, never through a bare psutil call.


def cmdline_of(process: psutil.Process) -> list[str]:
    """`process`'s command line; [] once it has ended, turned zombie or cannot be read."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def alive(process: psutil.Process) -> bool:
    """True while `process` runs; False once it has ended, been reaped or is a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def live_children(of: psutil.Process | None = None) -> list[psutil.Process]:
    """The live (not zombie) descendants of `of` (this process by default); [] once it ended."""
    try:
        children = (of or psutil.Process()).children(recursive=True)
    except psutil.Error:
        return []
    return [child for child in children if alive(child)]


def unique_token() -> str:
    """Twelve digits no other test's process has in its command line (pytest-xdist runs three
    tests at a time: a test that matched any `sleep 300` found another test's agent). Digits, so
    that it also makes a duration of its own: `sleep 300.{token}`."""
    return f"{uuid.uuid4().int % 10**12:012d}"
