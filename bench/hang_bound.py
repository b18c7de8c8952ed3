"""`python -m bench.hang_bound`: hang to death, and false deaths, with runbooks/vllm.yaml's
health block as shipped (the learned hang bound) and as it was before (watch 3, a fixed
`stall_after: 15`), on fast and slow stand-in engines, all in the same run.

The loop's health block is vllm.yaml's own, and so is its agent proxy; only the agent (the
stand-in agent, through the proxy), the collectors and the recovery are the stand-in's. Cases:

- fast engine, hang mid-generation: decode steps of milliseconds, the engine hangs 3 s into the
  agent's streamed answer (`engine_hang`: /health, /v1/models, /metrics 200, counters frozen);
- slow engine, hang mid-prefill: a 4,800-token prompt read in 6 s steps (vLLM's chunked prefill
  on a slow box), the engine hangs in its third step;
- slow engine, no hang: the same prompt read in 24 s steps (the 8-layer model on a loaded
  two-core box at vLLM's default chunk took 13-23 s; a fixed bound of 15 s tolerates steps up to
  about 15 + watch + interval): deaths counted until the item is done or 4 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
START = ROOT / "ralph_runner" / "standin" / "start_server.sh"
PROMPT_TOKENS = 4800  # the stand-in counts 4 characters a token
NO_HANG_LIMIT = 240.0  # s a no-hang case runs before it is cut


@dataclass(frozen=True)
class Case:
    name: str
    faults: tuple[tuple[str, object], ...]  # set when the agent step starts
    hang_after: float | None  # s into the agent step; None: no hang
    padding: int = 0  # prompt tokens added to the item's prompt


FAST = Case("fast engine, hang mid-generation", (("tokens_per_second", 5), ("busy", 100000)), 3.0)
SLOW = Case(
    "slow engine (6 s steps), hang mid-prefill",
    (("prefill_tokens_per_second", 100), ("prefill_chunk", 600)),
    15.0,
    PROMPT_TOKENS,
)
SLOWER = Case(
    "slow engine (24 s steps), no hang",
    (("prefill_tokens_per_second", 100), ("prefill_chunk", 2400)),
    None,
    PROMPT_TOKENS,
)


@dataclass
class Outcome:
    found_after: float | None  # s from the hang to the death
    deaths: int
    done: bool


def runbook(
    health: dict, work: Path, port: int, state: Path, padding: int, agent: list[str] | None = None
) -> Path:
    """vllm.yaml with `health`, the stand-in's recovery and `agent` (the stand-in agent,
    streaming, by default); its prompt the item's text with `padding` tokens of words."""
    book = yaml.safe_load((ROOT / "runbooks" / "vllm.yaml").read_text())
    book["health"] = health
    book["diagnostics"]["collect"] = [{"use": "checklist"}]
    book.pop("recorder", None)
    book["recovery"]["steps"] = [
        {"name": "start", "shell": f"PYTHON={sys.executable} {START} {port} {state}", "timeout": 30}
    ]
    book["recovery"]["crash_loop"] = {"deaths": 50, "within": 600}  # count them all
    if agent is None:
        agent = [sys.executable, "-m", "ralph_runner.standin.agent", "--url"]
        agent += ["{{ agent_base_url }}", "--model", "stand-in", "--timeout", "600", "--sleep"]
        agent += ["1", "--"]
    book["prompt"] = "{{ item.text }} " + "word " * (padding // 5 * 4)
    book["loop"]["steps"][1] = {
        "name": "agent",
        "shell": " ".join(agent) + " {{ prompt }}",
        "timeout": 600,
    }
    path = work / "bench-hang.yaml"
    path.write_text(yaml.safe_dump(book, sort_keys=False))
    return path


def measure(
    health: dict,
    case: Case,
    work: Path,
    port: int,
    state: Path,
    agent: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Outcome:
    facts = {"base_url": f"http://127.0.0.1:{port}/v1", "model": "stand-in"}
    book = runbook(health, work, port, state, case.padding, agent)
    command = [sys.executable, "-m", "ralph_runner", str(book), "--json", "-e", json.dumps(facts)]
    run = subprocess.Popen(
        command, cwd=work, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    admin = f"http://127.0.0.1:{port}/admin/fail"
    timer = threading.Timer(NO_HANG_LIMIT, lambda: os.killpg(run.pid, signal.SIGTERM))
    timer.start()
    outcome, hung, agent_steps = Outcome(None, 0, False), None, 0
    try:
        assert run.stdout is not None
        for line in run.stdout:
            event = json.loads(line)
            if os.environ.get("BENCH_DEBUG"):
                print(line.strip()[:1500], file=sys.stderr)
            if event["event"] == "step" and event["step"] == "agent":
                agent_steps += 1
                for mode, value in case.faults:  # a restarted server starts without them
                    httpx.post(admin, json={"mode": mode, "value": value})
                if case.hang_after is not None and agent_steps == 1:
                    time.sleep(case.hang_after)
                    httpx.post(admin, json={"mode": "engine_hang", "value": True})
                    hung = time.time()
            elif event["event"] == "death":
                outcome.deaths += 1
                if hung is not None:
                    outcome.found_after = event["time"] - hung
                    return outcome
            elif event["event"] == "summary":
                outcome.done = event["todo"] == 0
        return outcome
    finally:
        timer.cancel()
        os.killpg(run.pid, signal.SIGKILL)  # measured: the rest of the run is no concern here
        run.wait(30)


def one(
    health: dict,
    case: Case,
    agent: list[str] | None = None,
    env: dict[str, str] | None = None,
    early: bool = False,
) -> Outcome:
    """One case on a new stand-in and workspace (`early`: its faults set before the run too,
    so that the run's first checks see the engine as it will be)."""
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()
        state, work = Path(tmp, "vllm"), Path(tmp, "work")
        work.mkdir()
        (work / "CHECKLIST.md").write_text("- [ ] an item\n")
        for git in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "checklist"]):
            subprocess.run(
                ["git", "-c", "user.name=b", "-c", "user.email=b@b", *git], cwd=work, check=True
            )
        server_env = {**os.environ, "PYTHON": sys.executable, "HEALTH_TIMEOUT": "1"}
        subprocess.run(
            [str(START), str(port), str(state)], env=server_env, check=True, capture_output=True
        )
        if early:
            for mode, value in case.faults:
                admin = f"http://127.0.0.1:{port}/admin/fail"
                httpx.post(admin, json={"mode": mode, "value": value}).raise_for_status()
        try:
            return measure(health, case, work, port, state, agent, env)
        finally:
            subprocess.run(["pkill", "-f", "--", f"--state-dir {state}"], check=False)


def main() -> int:
    shipped = yaml.safe_load((ROOT / "runbooks" / "vllm.yaml").read_text())["health"]
    before = json.loads(json.dumps(shipped))
    before["watch"] = 3
    before["probes"][0]["progress"].pop("stall", None)
    before["probes"][0]["progress"]["stall_after"] = 15
    blocks = {"learned (watch 2, shipped)": shipped, "before (watch 3, stall_after 15)": before}
    print("| case | health block | hang to death | deaths | item done |")
    print("|---|---|---|---|---|")
    for case in (FAST, SLOW, SLOWER):
        for name, health in blocks.items():
            got = one(health, case)
            found = "-" if got.found_after is None else f"{got.found_after:.1f} s"
            done = "yes" if got.done else "no"
            print(f"| {case.name} | {name} | {found} | {got.deaths} | {done} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
