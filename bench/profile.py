"""`python -m bench.profile`: where ralph-run's time goes in the two rows that are about cost.

1. The healthy-path round, taken apart: the HTTP request alone, the probe without its thread,
   a round, a check, and the seed's curl.
2. Spawning one command: ralph-run's execute.run (through `sh`) against subprocess and bash.
3. The 50-item loop under cProfile: ralph-run's and sh's functions by cumulative time, per
   iteration (cProfile sees the main thread only; waits on other threads show as lock waits).
"""

from __future__ import annotations

import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import sh

from bench.cases import LOCAL, LOOP_ITEMS
from bench.stand import (
    RUNBOOKS,
    SEED_LOOP,
    Server,
    bench_env,
    require,
    run_timed,
    runbook_vars,
    workspace,
)
from ralph_runner.liveness import health
from ralph_runner.probes import ProbeContext, http, run_probe
from ralph_runner.process import connection, execute

SHOWN = 30  # functions listed from the loop's profile
SYSCALLS = {f"<built-in method posix.{name}>" for name in ("fork", "fsync", "read", "replace")}


def main() -> int:
    scratch = Path(tempfile.mkdtemp(prefix="ralph-bench-profile-"))
    server = Server(scratch / "server")
    try:
        server.start()
        healthy_parts(server, scratch)
        spawn_costs()
        loop_profile(server, scratch)
    finally:
        server.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def timed(label: str, call: Callable[[], object], runs: int = 300) -> None:
    for _ in range(10):
        call()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    print(f"  {label:58} {statistics.median(samples) * 1000:7.3f} ms")


def healthy_parts(server: Server, scratch: Path) -> None:
    print("healthy-path round, median per call:")
    url = f"{server.url}/models"
    spec = health.ProbeSpec("models endpoint", "http", http.Params(url=url), timeout=3.0)
    with health.Health([spec], connection=connection.for_host(LOCAL)) as checker:
        client = httpx.Client()
        timed("httpx.Client.get on a kept-alive connection", lambda: client.get(url))
        context = ProbeContext(checker.client, checker.connection, spec.timeout)
        timed(
            "run_probe() inline (no thread)",
            lambda: run_probe(spec.name, "http", spec.params, context),
        )
        timed("Health.round() (a thread per probe + Future)", checker.round)
        timed("Health.check()", checker.check)
        client.close()
    script = (
        f"source {SEED_LOOP}; a=$EPOCHREALTIME; for i in $(seq 100); do "
        'ensure_vllm_alive 1 item ""; done; b=$EPOCHREALTIME; echo "$a $b"'
    )
    env = bench_env(scratch, VLLM_BASE_URL=server.url)
    before, after = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    print(
        f"  {'seed: ensure_vllm_alive (curl --max-time 3), mean of 100':58} "
        f"{(float(after) - float(before)) * 10:7.3f} ms"
    )


def spawn_costs() -> None:
    """sh under every option that could matter, against the standard library's vfork and
    posix_spawn, in this process (which has ralph-run's modules loaded, as a loop has)."""
    print("\nstarting one command (`true`), median per call:")
    timed(
        "ralph_runner.execute.run(['true'])  (sh, own session)", lambda: execute.run(["true"]), 100
    )
    true = sh.Command("true")
    for label, options in SH_OPTIONS.items():
        timed(
            f"sh: true(_tty_out=False, {label})",
            lambda o=options: true(_tty_out=False, _return_cmd=True, **o).wait(),
            100,
        )  # type: ignore[misc]
    timed("os.fork() + os._exit(0) in the child: the fork alone", _fork_alone, 100)
    timed(
        "os.posix_spawn('/bin/true')", lambda: os.waitpid(os.posix_spawn(TRUE, [TRUE], {}), 0), 100
    )
    timed(
        "subprocess.run(['true'], start_new_session=True)",
        lambda: subprocess.run(["true"], start_new_session=True, stdout=subprocess.PIPE),
        100,
    )
    out = subprocess.run(
        [
            "bash",
            "-c",
            "a=$EPOCHREALTIME; for i in $(seq 200); do /bin/true; done; echo $a $EPOCHREALTIME",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    mean = (float(out[1]) - float(out[0])) * 5
    print(f"  {'bash: /bin/true in a loop, mean of 200':58} {mean:7.3f} ms")


SH_OPTIONS: dict[str, dict[str, object]] = {
    "nothing else": {},
    "_new_session=True": {"_new_session": True},
    "_close_fds=False": {"_close_fds": False},
    "_no_out, _no_err": {"_no_out": True, "_no_err": True},
    "_out=/dev/null": {"_out": os.devnull, "_err": os.devnull},
    "_bg=True, then .wait()": {"_bg": True},
}
TRUE = "/bin/true"


def _fork_alone() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def loop_profile(server: Server, scratch: Path) -> None:
    work = workspace(scratch / "loop", LOOP_ITEMS)
    output = scratch / "loop.prof"
    argv = [sys.executable, "-m", "cProfile", "-o", str(output), "-m", "ralph_runner"]
    argv += [str(RUNBOOKS / "loop.yaml"), "--json", "-e", runbook_vars(server)]
    done = require(run_timed(argv, cwd=work, env=bench_env(scratch), limit=300), "ralph-run")
    print(
        f"\n{LOOP_ITEMS}-item loop under cProfile ({done.seconds:.1f} s wall): cumulative time per "
        "iteration, ralph-run's and sh's functions"
    )
    stats = pstats.Stats(str(output)).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, calls, _, cumulative, _) in stats.items():
        if "ralph_runner" in file or "/sh/" in file or name in SYSCALLS:
            where = file.split("site-packages/")[-1].split("/work/main/")[-1]
            rows.append((cumulative, calls, f"{where}:{line}({name})"))
    print(f"  {'ms/iter':>8} {'calls/iter':>10}  function")
    for cumulative, calls, where in sorted(rows, reverse=True)[:SHOWN]:
        print(f"  {cumulative * 1000 / LOOP_ITEMS:8.2f} {calls / LOOP_ITEMS:10.1f}  {where}")


if __name__ == "__main__":
    raise SystemExit(main())
