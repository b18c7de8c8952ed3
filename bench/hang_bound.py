"""`python -m bench.hang_bound`: hang-to-death with runbooks/vllm.yaml's health block, as shipped
and as it was (watch 5, stall_after 60), on the stand-in, in the same run.

The agent's request generates slowly (a long generation), then the engine hangs mid-generation
(`engine_hang`: /health, /v1/models and /metrics keep answering, the counters freeze with one
request running): the worst place for a hang, which waits out `stall_after`. The loop's health
block is vllm.yaml's own; only the agent, the collectors and the recovery are the stand-in's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
START = ROOT / "ralph_runner" / "standin" / "start_server.sh"


def measure(health: dict, work: Path, port: int, state: Path) -> float:
    """Seconds from the hang to the loop's death event."""
    book = yaml.safe_load((ROOT / "runbooks" / "vllm.yaml").read_text())
    book["health"] = health
    book["diagnostics"]["collect"] = [{"use": "checklist"}]
    book.pop("recorder", None)
    book["recovery"]["steps"] = [
        {"name": "start", "shell": f"PYTHON={sys.executable} {START} {port} {state}", "timeout": 30}
    ]
    agent = [
        sys.executable,
        "-m",
        "ralph_runner.standin.agent",
        "--url",
        f"http://127.0.0.1:{port}/v1",
    ]
    agent += ["--model", "stand-in", "--timeout", "600", "--sleep", "1", "--"]
    book["loop"]["steps"][1] = {
        "name": "agent",
        "shell": " ".join(agent) + " {{ prompt }}",
        "timeout": 600,
    }
    runbook = work / "bench-hang.yaml"
    runbook.write_text(yaml.safe_dump(book, sort_keys=False))
    facts = {"base_url": f"http://127.0.0.1:{port}/v1", "model": "stand-in"}
    command = [
        sys.executable,
        "-m",
        "ralph_runner",
        str(runbook),
        "--json",
        "-e",
        json.dumps(facts),
    ]
    run = subprocess.Popen(
        command, cwd=work, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    admin = f"http://127.0.0.1:{port}/admin/fail"
    try:
        assert run.stdout is not None
        for line in run.stdout:
            event = json.loads(line)
            if os.environ.get("BENCH_DEBUG"):
                print(line.strip()[:300], file=sys.stderr)
            if event["event"] == "step" and event["step"] == "agent":
                httpx.post(admin, json={"mode": "tokens_per_second", "value": 5})
                httpx.post(admin, json={"mode": "busy", "value": 100000})
                time.sleep(3)  # the agent's call is generating
                httpx.post(admin, json={"mode": "engine_hang", "value": True})
                hung = time.time()
            elif event["event"] == "death":
                return event["time"] - hung
        raise SystemExit("the loop ended without a death")
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # measured: the rest of the run is no concern here
        run.wait(30)


def main() -> int:
    shipped = yaml.safe_load((ROOT / "runbooks" / "vllm.yaml").read_text())["health"]
    before = json.loads(json.dumps(shipped))
    before["watch"] = 5
    before["probes"][0]["progress"]["stall_after"] = 60
    results = {}
    for name, health in (
        ("shipped (watch 3, stall_after 15)", shipped),
        ("before (watch 5, stall_after 60)", before),
    ):
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
            env = {**os.environ, "PYTHON": sys.executable, "HEALTH_TIMEOUT": "1"}
            subprocess.run(
                [str(START), str(port), str(state)], env=env, check=True, capture_output=True
            )
            try:
                results[name] = measure(health, work, port, state)
            finally:
                subprocess.run(["pkill", "-f", "--", f"--state-dir {state}"], check=False)
    for name, seconds in results.items():
        print(f"hang mid-generation -> death, vllm.yaml health {name}: {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
