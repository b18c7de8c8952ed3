"""The real llama-server for the llama.cpp tier: where ci/install-llamacpp.sh put it, how the
runbook's own start script serves it, a long generation that keeps its one slot busy, and a
loop of `ralph-run runbooks/llama-cpp.yaml` against it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from support.e2e import RalphRun, make_workspace
from support.standin import cmdline_of

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
OUT = CACHE / "llamacpp"
SERVER = OUT / "llama-server"  # a link into the build cache (~/.cache/ralph-run/...)
TINY = OUT / "tiny.gguf"  # 2 layers, hidden 128: loaded in about a second
SLOW = OUT / "slow.gguf"  # 8 layers, hidden 512: generations and prompts that last
UNAVAILABLE = CACHE / "llamacpp.unavailable"
START = ROOT / "runbooks" / "llama-cpp" / "start_llama_server.sh"
RUNBOOK = ROOT / "runbooks" / "llama-cpp.yaml"
SERVED_NAME = "tiny"
# One slot (a second request waits: deferred), room for a long prompt and its answer, both
# cores for the engine, and prompts read 8,192 tokens a batch: one engine step of the 8-layer
# model then lasts seconds (an 8,400-token prompt: 12 s in two batches, measured), longer than
# the hang bound's floor, as a big model's batch on a small box.
ARGS = "--ctx-size 32768 --parallel 1 --threads 2 --batch-size 8192 --ubatch-size 8192"
START_TIMEOUT = 120  # s for one start (a second or two when quiet)
WATCH, INTERVAL, TIMEOUT, FLOOR = 2, 1, 5, 4  # runbooks/llama-cpp.yaml's health block
FAILURES = 2  # its failures_before_dead
# The runbook's documented bound for a stall (docs/llama-cpp.md): watch + B rounded up to the
# watch + f x timeout + (f - 1) x interval, with B at its floor.
STALL_BOUND = WATCH + FLOOR + FAILURES * TIMEOUT + (FAILURES - 1) * INTERVAL
LOAD_MARGIN = 3  # s on top of a stated bound: two shared cores, an engine generating


def tier_missing() -> str | None:
    """Why the llama.cpp tier cannot run here, in one line; None when it can."""
    if UNAVAILABLE.exists():
        return f"llama.cpp unavailable here: {UNAVAILABLE.read_text().strip()}"
    if not (os.access(SERVER, os.X_OK) and TINY.exists() and SLOW.exists()):
        return "llama.cpp not installed: run ci/install-llamacpp.sh (llama-server, .cache/llamacpp)"
    return None


def wait_until(condition, timeout: float, what: str, every: float = 0.05):
    """Polls `condition()` until it is truthy; its value. Fails at the deadline."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
    return value


def alive(pid: int) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


class Server:
    """One real llama-server on `port`, served by start_llama_server.sh from `state_dir`."""

    def __init__(self, state_dir: Path, port: int, model: Path = SLOW, args: str = ARGS) -> None:
        self.state_dir, self.port, self.model, self.args = state_dir, port, model, args
        self.root_url = f"http://127.0.0.1:{port}"
        self.url = f"{self.root_url}/v1"
        self.pids_seen: set[int] = set()  # every server it had: none may be left at the end

    @property
    def env(self) -> dict[str, str]:
        """The script's environment, the same the runbook's steps get from `facts`."""
        return {
            **os.environ,
            "LLAMA_SERVER": str(SERVER),
            "LLAMA_MODEL": str(self.model),
            "LLAMA_ALIAS": SERVED_NAME,
            "LLAMA_PORT": str(self.port),
            "LLAMA_DIR": str(self.state_dir),
            "LLAMA_ARGS": self.args,
            "START_TIMEOUT": str(START_TIMEOUT),
        }

    @property
    def facts(self) -> dict[str, Any]:
        """The -e variables that point runbooks/llama-cpp.yaml at this server."""
        return {
            "port": self.port,
            "model": SERVED_NAME,
            "model_path": str(self.model),
            "llama_server": str(SERVER),
            "llama_args": self.args,
            "llama_dir": str(self.state_dir),
        }

    def script(self, action: str, timeout: float = START_TIMEOUT + 30) -> str:
        """Runs `start_llama_server.sh ACTION`; its output. Fails the test on a non-zero exit."""
        done = subprocess.run(
            [str(START), action], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"start_llama_server.sh {action}: {done.stdout}{done.stderr}"
        self.note()
        return done.stdout

    @property
    def pid(self) -> int | None:
        try:
            return int((self.state_dir / "llama-server.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def note(self) -> None:
        if self.pid is not None:
            self.pids_seen.add(self.pid)

    def process(self) -> psutil.Process:
        assert self.pid is not None and alive(self.pid), "no llama-server running"
        return psutil.Process(self.pid)

    def replaced(self, before: int) -> bool:
        """Another server serves than the one of pid `before`, and that one is gone."""
        self.note()
        return self.pid is not None and self.pid != before and not alive(before)

    def metrics(self, timeout: float = 5) -> dict[str, float]:
        """Each `llamacpp:` sample of /metrics."""
        text = httpx.get(f"{self.root_url}/metrics", timeout=timeout).text
        found = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, _, value = line.partition(" ")
                found[name] = float(value)
        return found

    def processing(self) -> bool:
        """A request holds the slot (llamacpp:requests_processing)."""
        try:
            return self.metrics().get("llamacpp:requests_processing", 0) >= 1
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        path = self.state_dir / "llama-server.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """`start_llama_server.sh kill` (a test may leave it stopped), then every server this
        test session had is checked gone."""
        self.script("kill", timeout=60)
        for pid in self.pids_seen:
            wait_until(lambda pid=pid: not alive(pid), 15, f"llama-server {pid} to end")


def tokens_of(server: Server, text: str) -> int:
    answer = httpx.post(f"{server.root_url}/tokenize", json={"content": text}, timeout=30)
    return len(answer.json()["tokens"])


class Poller:
    """GETs `url` again and again from a thread of its own (each with `timeout`), noting the
    statuses and the slowest answer: how late /health or /metrics answered during a test."""

    def __init__(self, url: str, timeout: float = 60, every: float = 0.02) -> None:
        self.url, self.timeout, self.every = url, timeout, every
        self.statuses: list[int | str] = []
        self.bodies: dict[int, str] = {}
        self.answers: list[tuple[float, str]] = []  # (when it answered, its body), each 200
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    answer = client.get(self.url)
                    self.statuses.append(answer.status_code)
                    if answer.status_code == 200:
                        self.answers.append((time.monotonic(), answer.text))
                    self.bodies.setdefault(answer.status_code, answer.text)
                    self.slowest = max(self.slowest, time.monotonic() - sent)
                except httpx.ConnectError:
                    self.statuses.append("refused")
                except httpx.HTTPError as error:
                    self.statuses.append(type(error).__name__)
                    self.slowest = max(self.slowest, time.monotonic() - sent)
                self._stop.wait(self.every)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)

    def samples(self) -> list[tuple[float, dict[str, float]]]:
        """Each 200 answer of a /metrics poller: when, and its `llamacpp:` samples."""
        found = []
        for when, text in self.answers:
            values = {}
            for line in text.splitlines():
                if line.startswith("llamacpp:"):
                    name, _, value = line.partition(" ")
                    values[name] = float(value)
            found.append((when, values))
        return found


def longest_silence(samples: list[tuple[float, dict[str, float]]]) -> float:
    """The longest time a request was processing while no token counter moved (neither prompt
    tokens read nor tokens predicted): what the hang bound must outlast, as the loop saw it."""
    counters = ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")
    longest, last, moved_at = 0.0, None, None
    for when, values in samples:
        now = tuple(values.get(name) for name in counters)
        if now != last or moved_at is None:
            last, moved_at = now, when
        elif values.get("llamacpp:requests_processing", 0) > 0:
            longest = max(longest, when - moved_at)
    return longest


# The agent: ralph-run's stand-in (one streamed chat completion, tick, commit), after a long call
# of its own in the attempt a test hits, as a real agent spends minutes in its calls. Its calls
# go through the loop's proxy ($RALPH_BASE_URL, as a real agent's do): the loop sees them.
THINK_SECONDS = 20  # the long call lasts this long (curl's --max-time), however fast the CPU
THINK_TOKENS = 30000  # more than THINK_SECONDS of the 8-layer model give


def agent_command(
    server: Server, think: int | None, calls: Path, after: str = "", tokens: int | None = None
) -> str:
    """The runbook's `agent` variable (raw shell; the runbook appends the prompt). Call number
    `think` (counted in the file `calls`) first runs a long generation: in the background when
    `after` (shell) is to run beside it; of `tokens` tokens when given, else of THINK_SECONDS
    (llama-server goes on generating for a client that hung up on an unstreamed request:
    measured still at it 15 s later, through the loop's proxy or not)."""
    standin = shlex.join([sys.executable, "-m", "ralph_runner.standin.agent"])
    options = shlex.join(["--model", SERVED_NAME, "--timeout", "120", "--"])
    agent = f'{standin} --url "$RALPH_BASE_URL" {options}'  # through the loop's proxy
    if think is None:
        return agent
    body = {"model": SERVED_NAME, "prompt": "think", "max_tokens": tokens or THINK_TOKENS}
    body["ignore_eos"] = True
    seconds = 300 if tokens else THINK_SECONDS
    curl = ["curl", "-sS", "-f", "--max-time", str(seconds), "-o", "/dev/null"]
    curl += ["-H", "content-type: application/json", "-d", json.dumps(body)]
    counter = shlex.quote(str(calls))
    count = f"n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n >{counter}"
    # done, or cut off by --max-time (curl's 28): the agent goes on; any other error ends it
    long_call = f'{shlex.join(curl)} "$RALPH_BASE_URL/completions" || [ $? = 28 ]'
    if after:  # the long generation in the background, `after` beside it
        long_call = f"{{ {long_call}; }} & {after}"
    return f"{count}; if [ $n = {think} ]; then {long_call}; fi && {agent}"


class Loop:
    """One `ralph-run runbooks/llama-cpp.yaml --json` in a fresh git workspace."""

    def __init__(self, root: Path, server: Server, items: list[str], agent: str) -> None:
        self.root = root
        self.workspace = make_workspace(root / "work", items)
        self.server = server
        facts = {**server.facts, "agent": agent}
        command = [sys.executable, "-m", "ralph_runner", str(RUNBOOK), "--json"]
        self.run = RalphRun([*command, "-e", json.dumps(facts)], self.workspace)

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.run.wait(timeout)
        finally:
            self.run.kill()

    def marks(self) -> list[str]:
        text = (self.workspace / "CHECKLIST.md").read_text(encoding="utf-8")
        return [line[3] for line in text.splitlines() if line.startswith("- [")]

    def records(self, kind: str) -> list[dict[str, Any]]:
        path = self.workspace / "logs" / "llama-server-deaths.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        return [record for record in lines if record["event"] == kind]

    def strikes(self) -> dict[str, int]:
        state = json.loads((self.workspace / ".ralph" / "state.json").read_text())
        return {item: n for item, n in state.get("strikes", {}).items() if n}

    def ran_steps(self) -> list[str]:
        """The recovery steps that ran (their `when:` held), in order."""
        (recovery,) = self.records("recovery")
        return [step["name"] for step in recovery["steps"] if not step["skipped"]]

    def agents_left(self) -> list[int]:
        """The agent step's processes (its shell, curl, the stand-in agent) still alive: those
        working in the workspace or naming the test's files, but the server the recovery
        started there."""
        left = []
        for process in psutil.process_iter(["status", "cwd"]):
            mine = process.info["cwd"] == str(self.workspace)
            mine = mine or str(self.root) in " ".join(cmdline_of(process))
            alive = process.info["status"] != psutil.STATUS_ZOMBIE
            if mine and alive and process.pid != self.server.pid:
                left.append(process.pid)
        return left


def collector(record: dict[str, Any], name: str) -> str:
    (found,) = [c for c in record["collectors"] if c["name"] == name]
    return found["output"]
