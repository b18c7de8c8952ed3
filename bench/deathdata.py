"""Deaths as data at scale: the flight recorder's cost, `deaths` and `report` on a big night.

A "night" is made up here (seeded): 10,000 iterations with 500 deaths, each death record the
size of a real one (collectors as the demo's runbook takes them, a ten-minute recorder window of
120 samples of six metrics and 300 log lines), so the files are as heavy as a real night's.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from bench.stand import bench_env, kill_session, require, run_timed
from bench.table import Row
from ralph_runner.deaths import signatures

ITERATIONS, DEATHS = 10_000, 500
DEATHS_REPS, REPORT_REPS = 5, 3
RECORDER_SECONDS, RECORDER_WARMUP = 60.0, 5.0
RECORDER_PERIOD = 5.0
METRICS = [
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
]
SIGNATURE_LINES = [
    "AssertionError: num_required_blocks {n} < len(req_blocks) {m}",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {n}.00 MiB",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
]
LOG_LINE = (
    '(APIServer pid={pid}) INFO:     127.0.0.1:{port} - "POST /v1/chat/completions HTTP/1.1" 200 OK'
)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def night(workdir: Path, iterations: int = ITERATIONS, deaths: int = DEATHS) -> Path:
    """Write a workdir's history and death records (with sources.json); the workdir."""
    rng = random.Random(12)
    dying = set(rng.sample(range(1, iterations + 1), deaths))
    now = 1_800_000_000.0
    history, records = [], []
    for number in range(1, iterations + 1):
        chars = rng.randrange(1_000, 20_000)
        seconds = rng.uniform(20, 300)
        entry = {
            "event": "iteration", "time": _iso(now), "started": round(now, 3),
            "host": "gpu-a", "machine": "gpu-a", "iteration": number,
            "item": f"src/module_{number % 400}.py: implement feature {number}",
            "strikes_before": 0, "prompt_chars": chars, "prompt_bytes": chars,
            "deaths_before": len(records) // 2, "deaths": [], "outcome": "done",
            "seconds": round(seconds, 3), "prompt_tokens": chars // 4, "tokens_note": None,
        }  # fmt: skip
        if number in dying:
            death = len(records) // 2 + 1
            records += death_records(rng, death, now + seconds / 2, number, chars)
            entry.update(outcome="death", deaths=[death])
        history.append(entry)
        now += seconds
    state = workdir / ".ralph"
    state.mkdir(parents=True)
    logs = workdir / "logs"
    logs.mkdir()
    lines = "".join(json.dumps(e) + "\n" for e in history)
    (state / "iterations.jsonl").write_text(lines)
    (logs / "vllm-deaths.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sources = {"records": str(logs / "vllm-deaths.jsonl"), "host": "gpu-a"}
    (state / "sources.json").write_text(json.dumps(sources))
    return workdir


def death_records(rng: random.Random, death: int, at: float, iteration: int, chars: int):
    pid = rng.randrange(1000, 99999)
    blocks = rng.randrange(10, 400)
    kind = SIGNATURE_LINES[death % len(SIGNATURE_LINES)].format(n=blocks, m=blocks + 1)
    log = [
        [round(at - 600 + 2 * i, 3), LOG_LINE.format(pid=pid, port=rng.randrange(30000, 60000))]
        for i in range(299)
    ] + [[round(at - 1, 3), f"(EngineCore pid={pid}) ERROR [core.py:1110] {kind}"]]
    samples = [
        {"t": round(at - 600 + 5 * i, 3), "metrics": {m: rng.random() * 100 for m in METRICS},
         "gpu": [{"index": 0, "memory_used_mib": 130_000 + i, "memory_total_mib": 143_771,
                  "utilization_percent": 97}]}
        for i in range(120)
    ]  # fmt: skip
    container_log = "\n".join(line for _, line in log[-60:])
    collectors = [
        {"name": "CHECKLIST", "ok": True, "output": "- [x] done item\n" * 120},
        {"name": "git log", "ok": True, "output": "abc1234 commit message\n" * 5},
        {"name": "container log (last lines)", "ok": True, "output": container_log},
        {"name": "GPU memory (NVML)", "ok": True, "output": "GPU 0: H200, 130000 MiB used\n"},
        {"name": "vLLM metrics", "ok": True, "output": "vllm:kv_cache_usage_perc 0.99\n" * 6},
    ]
    for collector in collectors:
        collector.update(exit_code=0, timed_out=False, truncated=False, seconds=0.1)
    record = {
        "event": "death", "death": death, "time": _iso(at), "host": "gpu-a",
        "runbook": "runbooks/vllm.yaml", "service": "vLLM", "iteration": iteration,
        "item": {"text": f"item {iteration}", "line": 1, "index": 0, "attempts": 0},
        "prompt_size": chars, "prompt_bytes": chars, "phase": "during-step",
        "probes": [{"name": "can generate", "kind": "completion", "ok": False,
                    "reason": "refused", "detail": "connection refused", "seconds": 0.01}],
        "collectors": collectors,
        "signature": signatures.mask(kind),  # as ralph-run stores it in each record now
        "signature_from": {"source": "recorder log", "line": kind},
        "recorder": {"window": 600, "from": at - 600, "to": at, "period": 5,
                     "metrics_url": "http://127.0.0.1:8000/metrics", "metrics": METRICS,
                     "missing": [], "log_source": "follow: docker logs -f vllm",
                     "since_recovery": None, "samples": samples, "log": log,
                     "log_lines_cut": 0, "notes": [], "skipped_lines": 0},
    }  # fmt: skip
    recovery = {"event": "recovery", "death": death, "time": _iso(at + 60), "attempts": 1,
                "recovered": True, "seconds": rng.uniform(40, 120), "reason": None}  # fmt: skip
    return [record, recovery]


def _ralph_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "ralph_runner", *args]


def _cpu_timed(argv: list[str], bench, what: str, walls: list[float]) -> float:
    """CPU seconds (user + system) of one run: what its wall time is on an idle machine (it is
    one single-threaded process reading files already in the page cache), and a measure that a
    loaded machine does not inflate. The wall time goes to `walls`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = run_timed(argv, cwd=bench.scratch, env=bench_env(bench.scratch), limit=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    walls.append(require(done, what).seconds)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _walls(walls: list[float]) -> str:
    return f"wall times on this machine: {', '.join(f'{w:.2f}' for w in walls)} s"


def deaths_scale(bench) -> list[Row]:
    workdir = night(bench.fresh("night"))
    size = (workdir / "logs" / "vllm-deaths.jsonl").stat().st_size / 2**20
    row = Row(f"`ralph-run deaths`: {ITERATIONS:,} iterations, {DEATHS} deaths (CPU)", [])
    walls: list[float] = []
    for _ in range(DEATHS_REPS):
        row.ours.append(_cpu_timed(_ralph_run("deaths", str(workdir)), bench, "deaths", walls))
    row.target = "< 1 s"
    row.met = row.median("ours") < 1.0
    row.notes.append(
        f"CPU time of the process (Python start-up included; {_walls(walls)}) over the workdir: "
        f"{size:.0f} MiB of death records (each with a 10-minute recorder window: 120 samples "
        f"of 6 metrics, 300 log lines) and the iteration history, made up by bench/deathdata.py."
    )
    return [row]


def report_scale(bench) -> list[Row]:
    workdir = night(bench.fresh("night"))
    out = bench.scratch / "report.html"
    row = Row(f"`ralph-run report`: {ITERATIONS:,} iterations, {DEATHS} deaths (CPU)", [])
    argv = _ralph_run("report", str(workdir), "-o", str(out))
    walls: list[float] = []
    for _ in range(REPORT_REPS):
        row.ours.append(_cpu_timed(argv, bench, "report", walls))
    row.target = "< 5 s"
    row.met = row.median("ours") < 5.0
    size = Row(f"`ralph-run report`: size of the page ({ITERATIONS:,} iterations, {DEATHS} deaths)",
               [out.stat().st_size / 2**20], unit="MiB")  # fmt: skip
    size.target = "< 5 MB (4.77 MiB)"
    size.met = out.stat().st_size < 5_000_000
    row.notes.append(
        f"same night as the deaths row; CPU time of the process, Bokeh's import included "
        f"({_walls(walls)})."
    )
    return [row, size]


RECORDER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from ralph_runner.process.connection import Local
    from ralph_runner.deaths.recorder import Recorder, Settings
    url, log, ring, period, *metrics = sys.argv[1:]
    settings = Settings(url=url, metrics=metrics, period=float(period), gpu=True,
                        follow=f"tail -F -n 0 {log}", file=None, window=600, max_lines=2000,
                        max_bytes=16 * 1024 * 1024, connection=Local())
    Recorder(settings, Path(ring)).start()
    print("started", flush=True)
    time.sleep(3600)
    """
)


def recorder_cost(bench) -> list[Row]:
    """The recorder alone in a process (as in a run: a sampler thread, a follower thread and its
    `tail -F`), against the stand-in while an agent-like client sends it a request a second."""
    server = bench.server
    log = server.state_dir / "server.log"
    argv = [sys.executable, "-c", RECORDER, f"{server.root_url}/metrics", str(log),
            str(bench.fresh("ring")), str(RECORDER_PERIOD), *METRICS]  # fmt: skip
    child = subprocess.Popen(argv, env=bench_env(bench.scratch), stdout=subprocess.PIPE,
                             text=True, start_new_session=True)  # fmt: skip
    stop = threading.Event()
    traffic = threading.Thread(target=_requests, args=(server.url, stop), daemon=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "started\n"
        traffic.start()
        process = psutil.Process(child.pid)
        stop.wait(RECORDER_WARMUP)
        cpu0, rss0 = _cpu(process), process.memory_info().rss
        started = time.monotonic()
        stop.wait(RECORDER_SECONDS)
        cpu = _cpu(process) - cpu0
        elapsed = time.monotonic() - started
        rss = process.memory_info().rss
        segments = len(list(bench.scratch.glob("ring-*/segment-*.jsonl")))
    finally:
        stop.set()
        kill_session(child.pid)
        child.wait(10)
    share = cpu / elapsed
    case = f"recorder: CPU per minute, {RECORDER_PERIOD:g} s period, 6 metrics, log followed"
    row = Row(case, [cpu * 60 / elapsed])
    row.target = "< 0.6 s per minute (1% of one core)"
    row.met = share < 0.01
    row.notes.append(
        f"{cpu:.2f} s of CPU (user + system, the recorder's process and its `tail -F` child) over "
        f"{elapsed:.0f} s = {share:.2%} of one core, after {RECORDER_WARMUP:g} s of warm-up; the "
        "stand-in got one chat request a second meanwhile (one log line each); "
        f"the ring: {segments} segment(s)."
    )
    memory = Row("recorder: RSS of its process after a minute", [rss / 2**20], unit="MiB")
    memory.target = "bounded: the ring lives on disk (≤ max_mb); in memory a partial line and "
    memory.target += "the follow command's last 1 KiB"
    memory.met = rss - rss0 < 2 * 2**20
    memory.notes.append(
        f"RSS {rss0 / 2**20:.1f} MiB after the warm-up, {rss / 2**20:.1f} MiB a minute later "
        "(Python, httpx, ralph_runner's modules: the recorder keeps no history in memory)."
    )
    return [row, memory]


def _cpu(process: psutil.Process) -> float:
    total = sum(process.cpu_times()[:2])
    for child in process.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return total


def _requests(url: str, stop: threading.Event) -> None:
    """One chat request a second, at most as long as the bench runs (bounded by `stop`)."""
    body = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(timeout=5) as client:
        while not stop.wait(1.0):
            try:
                client.post(f"{url}/chat/completions", json=body)
            except httpx.HTTPError:
                continue
