"""`python -m bench.fleet [--hosts 20] [--seconds 300]`: a fleet under fire.

N local hosts, each with its own stand-in server and workspace, run by one
`ralph-run RUNBOOK -i INVENTORY --forks N`; for `--seconds` a chaos thread breaks a random
host's server every `--every` seconds (engine death, engine hang, 503s, plain death), then the
fleet gets SIGTERM. Measured: false skips (any strike or skip: the agent never fails on a
healthy server), deaths found vs. deaths recorded in the hosts' JSON records, recovery p50/p95
against the stand-in's own restart time, CPU of the controlling ralph-run processes (the fleet
parent and its per-host children; agents and servers excluded) as a share of one core, and RSS
per loop. Prints a markdown summary; `--json FILE` keeps the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.stand import START_SERVER, Server, bench_env, workspace

FAULTS = (
    {"engine_death": True},
    {"engine_hang": True},
    {"dead_503": True},
    {"die": True},
)
SAMPLE_EVERY = 2.0  # seconds between CPU/RSS samples of the ralph-run processes


def runbook(agent_seconds: float, watch: float) -> dict[str, Any]:
    """A loop per host: the stand-in agent (thinking `agent_seconds`, +/- 50%), the progress
    probe watching every `watch` s, the start script as recovery."""
    agent = (
        "{{ python }} -m ralph_runner.standin.agent --url {{ base_url }} --model stand-in"
        f" --timeout 60 --sleep {{{{ {agent_seconds:g} * (0.5 + (iteration % 3) / 2) }}}}"
        " -- {{ prompt }}"
    )
    return {
        "name": "fleet under fire",
        "hosts": "gpu",
        "workdir": "{{ work_root }}/{{ inventory_hostname }}",
        "vars": {"base_url": "http://127.0.0.1:{{ port }}/v1"},
        "checklist": {"path": "CHECKLIST.md", "strikes": 3},
        "prompt": "Do this item, tick it, commit: {{ item.text }}\n",
        "health": {
            "probes": [
                {"name": "models", "http": {"url": "{{ base_url }}/models"}, "timeout": 1},
                {
                    "name": "engine progress",
                    "progress": {
                        "metrics": "http://127.0.0.1:{{ port }}/metrics",
                        "completion": {"url": "{{ base_url }}", "model": "stand-in"},
                        "stall_after": 3,
                    },
                    "timeout": 2,
                },
            ],
            "failures_before_dead": 2,
            "interval": 0.2,
            "watch": watch,
        },
        "diagnostics": {
            "log": "logs/deaths.log",
            "timeout": 5,
            "collect": [{"name": "server log", "shell": "tail -n 20 {{ standin_dir }}/server.log"}],
        },
        "recovery": {
            "steps": [
                {
                    "name": "stop the hung stand-in",  # "already running" would be a lie
                    "shell": "kill -TERM $(cat {{ standin_dir }}/server.pid)",
                    "when": "death.hung",
                    "ignore_errors": True,
                },
                {
                    "name": "restart the stand-in",
                    "shell": "PYTHON={{ python }} HEALTH_TIMEOUT=1 {{ start }} {{ port }} "
                    "{{ standin_dir }}",
                    "timeout": 30,
                },
            ],
            "attempts": 3,
            "delay": 1,
            "healthy_within": 10,
            "crash_loop": {"deaths": 50, "within": 600},
        },
        "loop": {
            "steps": [
                {"ensure_alive": {"phase": "start"}},
                {"name": "agent", "shell": agent, "timeout": 120},
                {"ensure_alive": {"phase": "post-step"}},
                {"verify": {"checked": True, "committed": True}},
            ]
        },
    }


def restart_seconds(server: Server, times: int = 3) -> float:
    """The stand-in's own cold start through its start script: the floor of any recovery."""
    samples = []
    for _ in range(times):
        server.kill()
        started = time.monotonic()
        server.start()
        samples.append(time.monotonic() - started)
    return statistics.median(samples)


class Sampler:
    """CPU seconds and RSS of the ralph-run processes (parent + per-host children)."""

    def __init__(self, parent: psutil.Process) -> None:
        self.parent = parent
        self.cpu: dict[int, float] = {}
        self.rss: dict[int, list[int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def loops(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            children = self.parent.children()
            return [self.parent, *(c for c in children if "ralph_runner" in " ".join(c.cmdline()))]
        return []

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY):
            for process in self.loops():
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    self.cpu[process.pid] = times.user + times.system
                    if process.pid != self.parent.pid:
                        self.rss.setdefault(process.pid, []).append(process.memory_info().rss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__)
    parser.add_argument("--hosts", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--every", type=float, default=6.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--agent-seconds", type=float, default=10.0, help="the agent's mean time per item"
    )
    parser.add_argument("--watch", type=float, default=5.0, help="health.watch of the loops")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    scratch = Path(tempfile.mkdtemp(prefix="ralph-fleet-"))
    hosts = [f"gpu-{n:02d}" for n in range(1, args.hosts + 1)]
    servers = {h: Server(scratch / "vllm" / h) for h in hosts}
    for host in hosts:
        workspace(scratch / "work" / host, 2000)
        servers[host].start()
    floor = restart_seconds(servers[hosts[0]])
    inventory = {
        "all": {
            "vars": {
                "python": sys.executable,
                "start": str(START_SERVER),
                "work_root": str(scratch / "work"),
            },
            "children": {
                "gpu": {
                    "hosts": {
                        h: {
                            "ansible_connection": "local",
                            "port": s.port,
                            "standin_dir": str(s.state_dir),
                        }
                        for h, s in servers.items()
                    }
                }
            },
        }
    }
    (scratch / "inventory.yaml").write_text(yaml.safe_dump(inventory))
    (scratch / "runbook.yaml").write_text(
        yaml.safe_dump(runbook(args.agent_seconds, args.watch), sort_keys=False)
    )
    command = [sys.executable, "-m", "ralph_runner", str(scratch / "runbook.yaml"), "--json"]
    command += ["-i", str(scratch / "inventory.yaml"), "--forks", str(args.hosts)]
    out = (scratch / "events.jsonl").open("w")
    fleet = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=bench_env(scratch))
    sampler = Sampler(psutil.Process(fleet.pid))
    injected = []
    started = time.monotonic()
    while (left := args.seconds - (time.monotonic() - started)) > 0:
        time.sleep(min(args.every, left))
        if args.every > left:
            break
        host, fault = rng.choice(hosts), rng.choice(FAULTS)
        servers[host].state_dir.joinpath("control.json").write_text(json.dumps(fault))
        injected.append((round(time.monotonic() - started, 1), host, fault))
    wall = time.monotonic() - started
    cpu_before = dict(sampler.cpu)
    fleet.send_signal(signal.SIGTERM)
    code = fleet.wait(120)
    sampler.stop.set()
    out.close()
    for server in servers.values():
        server.kill()
    figures = summarise(scratch, hosts, injected, wall, cpu_before, sampler, floor, code)
    print(report(figures, args))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def summarise(
    scratch: Path,
    hosts: list[str],
    injected: list,
    wall: float,
    cpu: dict[int, float],
    sampler: Sampler,
    floor: float,
    code: int,
) -> dict[str, Any]:
    events = []
    for line in (scratch / "events.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    deaths = [e for e in events if e.get("event") == "death"]
    records, recoveries = 0, []
    for host in hosts:
        path = scratch / "work" / host / "logs" / "deaths.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                records += record["event"] == "death"
                if record["event"] == "recovery" and record["recovered"]:
                    recoveries.append(record["seconds"])
    rss = [max(samples) for samples in sampler.rss.values()]
    recoveries.sort()
    return {
        "hosts": len(hosts),
        "seconds": round(wall, 1),
        "faults_injected": len(injected),
        "deaths_found": len(deaths),
        "deaths_recorded": records,
        "false_skips": sum(e.get("event") == "skip" for e in events),
        "strikes": sum(e.get("event") == "strike" for e in events),
        "items_done": sum(e.get("event") == "done" for e in events),
        "recovery_p50": statistics.median(recoveries) if recoveries else None,
        "recovery_p95": recoveries[int(0.95 * (len(recoveries) - 1))] if recoveries else None,
        "restart_floor": round(floor, 2),
        "cpu_share_of_one_core": round(sum(cpu.values()) / wall, 3),
        "rss_per_loop_mib": round(statistics.median(rss) / 2**20, 1) if rss else None,
        "rss_per_loop_max_mib": round(max(rss) / 2**20, 1) if rss else None,
        "exit_code": code,
    }


def report(f: dict[str, Any], args: argparse.Namespace) -> str:
    p95, floor = f["recovery_p95"], f["restart_floor"]
    rows = [
        (
            "hosts x seconds (agent mean, watch)",
            f"{f['hosts']} x {f['seconds']:g} s ({args.agent_seconds:g} s, {args.watch:g} s)",
            "",
        ),
        (
            "faults injected / deaths found / recorded",
            f"{f['faults_injected']} / {f['deaths_found']} / {f['deaths_recorded']}",
            "yes" if f["deaths_found"] == f["deaths_recorded"] else "**no**",
        ),
        (
            "false skips (strikes)",
            f"{f['false_skips']} ({f['strikes']})",
            "yes" if f["false_skips"] == 0 else "**no**",
        ),
        ("items done", str(f["items_done"]), ""),
        (
            "recovery p50 / p95 (target p95 <= restart + 2 s)",
            f"{f['recovery_p50']} / {p95} s (restart {floor} s)",
            "yes" if p95 is not None and p95 <= floor + 2 else "**no**",
        ),
        (
            "ralph-run processes' CPU (target < 20% of one core)",
            f"{100 * f['cpu_share_of_one_core']:.1f}%",
            "yes" if f["cpu_share_of_one_core"] < 0.2 else "**no**",
        ),
        (
            "RSS per loop (median / max)",
            f"{f['rss_per_loop_mib']} / {f['rss_per_loop_max_mib']} MiB",
            "",
        ),
        ("fleet exit code after SIGTERM", str(f["exit_code"]), ""),
    ]
    lines = ["| measure | value | met |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
