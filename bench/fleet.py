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
import compileall
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
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from bench.stand import ROOT, START_SERVER, Server, bench_env, workspace

FAULTS = (
    {"engine_death": True},
    {"engine_hang": True},
    {"dead_503": True},
    {"die": True},
)
SAMPLE_EVERY = 2.0  # seconds between CPU/RSS samples of the ralph-run processes
SPARE_EVERY = 8.0  # seconds between the spare stand-in's faults


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


class Spare:
    """A stand-in outside the fleet that gets the same faults, in a loop, and is brought back
    by the runbook's own recovery commands run by hand (a hung one stopped with SIGTERM, then
    the start script): the restart time under the same load, the floor of any recovery."""

    def __init__(self, server: Server, rng: random.Random) -> None:
        self.server, self.rng = server, rng
        self.seconds: dict[str, list[float]] = {}
        self.stop = threading.Event()
        server.start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(SPARE_EVERY):
            fault = self.rng.choice(FAULTS)
            (kind,) = fault
            self.server.state_dir.joinpath("control.json").write_text(json.dumps(fault))
            if not self._broken(kind):
                continue
            started = time.monotonic()
            if kind == "engine_hang":  # the runbook's `when: death.hung` step
                pid = self.server.state_dir.joinpath("server.pid").read_text().strip()
                subprocess.run(["kill", "-TERM", pid], check=False)
            env = {**bench_env(self.server.state_dir), "HEALTH_TIMEOUT": "1"}
            subprocess.run(
                ["bash", str(START_SERVER), str(self.server.port), str(self.server.state_dir)],
                env=env,
                capture_output=True,
                timeout=60,
                check=False,
            )
            self.seconds.setdefault(kind, []).append(time.monotonic() - started)

    def _broken(self, kind: str) -> bool:
        """Until the fault shows (as a probe sees it): up to 10 s."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if kind == "engine_hang":
                    body = {"model": "stand-in", "prompt": "ping", "max_tokens": 1}
                    httpx.post(f"{self.server.url}/completions", json=body, timeout=1)
                else:
                    httpx.get(f"{self.server.url}/models", timeout=1).raise_for_status()
            except httpx.HTTPError:
                return True
            time.sleep(0.1)
        return False

    def figures(self) -> dict[str, Any]:
        every = sorted(x for samples in self.seconds.values() for x in samples)
        return {
            "restarts": len(every),
            "p50": round(statistics.median(every), 2) if every else None,
            "p95": round(_p95(every), 2) if every else None,
            "by_fault": {k: round(statistics.median(v), 2) for k, v in self.seconds.items()},
        }


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.95 * (len(ordered) - 1))]


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
    compileall.compile_dir(ROOT / "ralph_runner", quiet=1)  # as installed: bytecode compiled
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
    spare = Spare(Server(scratch / "vllm" / "spare"), random.Random(args.seed + 1))
    injected = []
    started = time.monotonic()
    while (left := args.seconds - (time.monotonic() - started)) > 0:
        time.sleep(min(args.every, left))
        if args.every > left:
            break
        host, fault = rng.choice(hosts), rng.choice(FAULTS)
        servers[host].state_dir.joinpath("control.json").write_text(json.dumps(fault))
        injected.append((time.time(), host, fault))
    wall = time.monotonic() - started
    cpu_before = dict(sampler.cpu)
    spare.stop.set()
    spare.thread.join(120)
    fleet.send_signal(signal.SIGTERM)
    code = fleet.wait(120)
    sampler.stop.set()
    out.close()
    for server in servers.values():
        server.kill()
    figures = summarise(scratch, hosts, injected, wall, cpu_before, sampler, floor, code)
    figures["restart_under_fire"] = spare.figures()
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
    by_fault: dict[str, list[float]] = {}
    for host in hosts:
        path = scratch / "work" / host / "logs" / "deaths.jsonl"
        if not path.exists():
            continue
        died_at: dict[int, float] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "death":
                records += 1
                died_at[record["death"]] = datetime.fromisoformat(record["time"]).timestamp()
            elif record["event"] == "recovery" and record["recovered"]:
                recoveries.append(record["seconds"])
                kind = _fault_before(injected, host, died_at.get(record["death"]))
                by_fault.setdefault(kind, []).append(record["seconds"])
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
        "recovery_p95": _p95(recoveries) if recoveries else None,
        "recovery_by_fault": {
            k: {"n": len(v), "p50": statistics.median(v), "max": max(v)}
            for k, v in sorted(by_fault.items())
        },
        "restart_floor": round(floor, 2),
        "cpu_share_of_one_core": round(sum(cpu.values()) / wall, 3),
        "rss_per_loop_mib": round(statistics.median(rss) / 2**20, 1) if rss else None,
        "rss_per_loop_max_mib": round(max(rss) / 2**20, 1) if rss else None,
        "exit_code": code,
    }


def _fault_before(injected: list, host: str, when: float | None) -> str:
    """The kind of the last fault injected into `host` before a death (1 s of clock slack:
    death times are whole seconds)."""
    if when is None:
        return "unknown"
    kinds = [next(iter(f)) for at, h, f in injected if h == host and at <= when + 1]
    return kinds[-1] if kinds else "none injected"


def report(f: dict[str, Any], args: argparse.Namespace) -> str:
    p95, floor = f["recovery_p95"], f["restart_floor"]
    spare = f.get("restart_under_fire") or {}
    bar = spare.get("p95") or floor  # the restart under the same load, else the quiet one
    by_fault = ", ".join(
        f"{k} {v['p50']:.1f} / {v['max']:.1f} s ({v['n']})"
        for k, v in f["recovery_by_fault"].items()
    )
    spared = ", ".join(f"{k} {v:.1f} s" for k, v in spare.get("by_fault", {}).items())
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
            f"{f['recovery_p50']} / {p95} s (the same restart without ralph-run, under the "
            f"same load: p50 {spare.get('p50')} / p95 {spare.get('p95')} s over "
            f"{spare.get('restarts', 0)}; on a quiet machine {floor} s)",
            "yes" if p95 is not None and p95 <= bar + 2 else "**no**",
        ),
        ("recovery by fault: p50 / max (n)", by_fault, ""),
        ("the same restart by hand, by fault (p50)", spared, ""),
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
