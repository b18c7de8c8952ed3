"""The cases. Each runs its peers several times, alternating their order, and returns rows.

Peers: `ours` (ralph-run, in-process where the issue says so, else as users run it), `seed`
(bench/seed/ralph-loop.sh, the bash the project replaces) and `ansible` (ansible-playbook).
A peer that ends in an unexpected way stops the bench: a broken baseline measures nothing.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from bench.stand import (
    AGENTS,
    ANSIBLE,
    ROOT,
    RUNBOOKS,
    SEED_LOOP,
    SEED_START,
    START_SERVER,
    STUBS,
    HealthyAgain,
    Server,
    bench_env,
    events,
    first,
    leftovers,
    marks,
    ralph_run,
    require,
    run_timed,
    runbook_vars,
    ticked,
    workspace,
)
from bench.table import Row
from ralph_runner.liveness import diagnostics, health
from ralph_runner.probes import http
from ralph_runner.process import connection
from ralph_runner.runbook import plan, tasks

ANSIBLE_PLAYBOOK = str(Path(sys.executable).parent / "ansible-playbook")
LOCAL = {"ansible_connection": "local"}


@dataclass
class Bench:
    """What the cases share: a scratch directory and the healthy stand-in server."""

    scratch: Path
    server: Server
    _made: dict[str, int] = field(default_factory=dict)

    def fresh(self, name: str) -> Path:
        """A new, not yet existing path under the scratch directory."""
        self._made[name] = self._made.get(name, 0) + 1
        return self.scratch / f"{name}-{self._made[name]}"

    def state(self, name: str) -> Path:
        path = self.fresh(name)
        path.mkdir()
        return path

    def seed_env(self, state: Path, server: Server | None = None, **extra: object) -> dict:
        """The seed loop's environment: the seed's variables pointed at the stand-in."""
        server = server or self.server
        seed_vars = {
            "VLLM_BASE_URL": server.url,
            "GPU_SCHED": STUBS / "gpu-sched",
            "START_VLLM": START_SERVER,
            "PORT": server.port,
            "STATE_DIR": server.state_dir,
            "AGENT": AGENTS / "instant.sh",
        }
        return bench_env(state, **{**seed_vars, **extra})


def alternate(reps: int, peers: dict[str, Callable[[int], None]]) -> None:
    """Run each peer once per rep, rotating who goes first, so drift hits everyone alike."""
    names = list(peers)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            peers[name](rep)


# -- healthy path -----------------------------------------------------------------------------

HEALTHY_REPS = 5
OURS_ROUNDS = 100  # Health.check calls per rep
SEED_CALLS = 30  # ensure_vllm_alive calls per rep


def healthy_round(bench: Bench) -> list[Row]:
    """One ensure_alive round on a healthy server: the cost every iteration pays twice."""
    url = f"{bench.server.url}/models"
    spec = health.ProbeSpec("models endpoint", "http", http.Params(url=url), timeout=3.0)
    checker = health.Health([spec], connection=connection.for_host(LOCAL))
    row = Row("healthy-path round: one ensure_alive on a healthy server", [])
    seed_script = (
        f"source {SEED_LOOP}; for ((i = 0; i < {SEED_CALLS}; i++)); do a=$EPOCHREALTIME; "
        'ensure_vllm_alive 1 item ""; s=$?; b=$EPOCHREALTIME; echo "$s $a $b"; done'
    )
    env = bench.seed_env(bench.scratch)
    playbook = [
        ANSIBLE_PLAYBOOK,
        "-i",
        "localhost,",
        "-c",
        "local",
        "-e",
        f"base_url={bench.server.url}",
    ]
    playbook += ["-e", f"ansible_python_interpreter={sys.executable}", str(ANSIBLE / "health.yml")]

    def ours(rep: int) -> None:
        for _ in range(OURS_ROUNDS):
            started = time.perf_counter()
            alive, _ = checker.check()
            row.ours.append(time.perf_counter() - started)
            if not alive:
                raise RuntimeError("ralph-run's health check failed on a healthy server")

    def seed(rep: int) -> None:
        done = require(
            run_timed(["bash", "-c", seed_script], cwd=bench.scratch, env=env, limit=60), "seed"
        )
        for line in done.stdout.splitlines():
            status, before, after = line.split()
            if status != "0":
                raise RuntimeError(f"ensure_vllm_alive returned {status} on a healthy server")
            row.seed.append(float(after) - float(before))

    def ansible(rep: int) -> None:
        done = run_timed(playbook, cwd=bench.scratch, env=env, limit=120)
        row.ansible.append(require(done, "ansible-playbook health.yml").seconds)

    with checker:
        for _ in range(10):  # a running loop's client is connected already
            checker.check()
        require(run_timed(playbook, cwd=bench.scratch, env=env, limit=120), "ansible warm-up")
        alternate(HEALTHY_REPS, {"ours": ours, "seed": seed, "ansible": ansible})
    ours_ms, seed_ms = row.median("ours"), row.median("seed")
    row.target, row.met = "≥ 10x cheaper than the seed", ours_ms * 10 <= seed_ms
    row.notes.append(
        "ralph-run: `Health.check()` in-process, one http probe on a kept-alive client; seed: "
        "`ensure_vllm_alive` (one `curl --max-time 3`) timed inside bash; Ansible: one "
        "`ansible-playbook` run of a `uri` task with retries/until, start-up included (what a "
        "loop calling it pays each time)."
    )
    return [row]


# -- loop overhead ------------------------------------------------------------------------------

LOOP_ITEMS = 50
LOOP_REPS = 3


def loop_overhead(bench: Bench) -> list[Row]:
    """A 50-item loop with an agent that takes no time: what is left is the loop itself."""
    row = Row(f"loop, {LOOP_ITEMS} items, instant agent: wall time per iteration", [])
    steady: list[float] = []
    agent: list[float] = []
    swapped: list[float] = []  # ralph-run with vfork spawns (bench/vfork.py)
    agent_loop = f'for i in $(seq {LOOP_ITEMS}); do {AGENTS / "instant.sh"} "the prompt"; done'

    def ours(rep: int) -> None:
        work = workspace(bench.fresh("loop-ours"), LOOP_ITEMS)
        argv = ralph_run("loop.yaml", "-e", runbook_vars(bench.server))
        done = require(
            run_timed(argv, cwd=work, env=bench_env(bench.scratch), limit=300), "ralph-run"
        )
        _all_ticked(work, LOOP_ITEMS, "ralph-run")
        row.ours.append(done.seconds / LOOP_ITEMS)
        found = events(done.stdout)
        steady.append(
            (first(found, "summary")["time"] - first(found, "iteration")["time"]) / LOOP_ITEMS
        )

    def seed(rep: int) -> None:
        work = workspace(bench.fresh("loop-seed"), LOOP_ITEMS)
        env = bench.seed_env(bench.scratch)
        done = require(run_timed(["bash", str(SEED_LOOP)], cwd=work, env=env, limit=300), "seed")
        _all_ticked(work, LOOP_ITEMS, "the seed loop")
        row.seed.append(done.seconds / LOOP_ITEMS)

    def vfork(rep: int) -> None:
        work = workspace(bench.fresh("loop-vfork"), LOOP_ITEMS)
        argv = [sys.executable, str(ROOT / "bench" / "vfork.py"), *ralph_run("loop.yaml")[3:]]
        argv += ["-e", runbook_vars(bench.server)]
        done = require(run_timed(argv, cwd=work, env=bench_env(bench.scratch), limit=300), "vfork")
        _all_ticked(work, LOOP_ITEMS, "ralph-run (vfork)")
        swapped.append(done.seconds / LOOP_ITEMS)

    def agent_alone(rep: int) -> None:
        work = workspace(bench.fresh("loop-agent"), LOOP_ITEMS)
        env = bench_env(bench.scratch)
        done = require(run_timed(["bash", "-c", agent_loop], cwd=work, env=env, limit=120), "agent")
        agent.append(done.seconds / LOOP_ITEMS)

    alternate(LOOP_REPS, {"ours": ours, "seed": seed, "vfork": vfork, "agent": agent_alone})
    alone = statistics.median(agent)
    row.target, row.met = "no worse than the seed", row.median("ours") <= row.median("seed")
    row.notes.append(
        f"same agent in both (bench/agents/instant.sh: sed + git commit), {_ms(alone)} per item "
        f"alone; loop overhead = per-iteration - agent: ralph-run "
        f"{_ms(row.median('ours') - alone)}, seed {_ms(row.median('seed') - alone)}. "
        "ralph-run's figure includes its start-up "
        f"(Python, runbook load); from its first iteration to its summary: "
        f"{_ms(statistics.median(steady))} per iteration. What sh costs: the same ralph-run "
        f"with its process start swapped for subprocess.Popen (vfork; bench/vfork.py, a "
        f"measurement only) takes {_ms(statistics.median(swapped))} per iteration: sh forks "
        "the interpreter for each of the iteration's 3 commands (agent, the prompt's git log, "
        "verify's git status), and no option of sh 2.x avoids the fork (`python -m "
        "bench.profile`)."
    )
    return [row]


# -- detection ----------------------------------------------------------------------------------

DETECT_REPS = 2


def detection(bench: Bench) -> list[Row]:
    """The server hangs 1 s into the agent step (agent timeout 30 s): how long until a death?"""
    config = yaml.safe_load((RUNBOOKS / "detect.yaml").read_text())
    checks, probe = config["health"], config["health"]["probes"][0]
    failures, agent_timeout = checks["failures_before_dead"], config["loop"]["steps"][1]["timeout"]
    bound = checks["watch"] + failures * probe["timeout"] + (failures - 1) * checks["interval"]
    bound_with_grace = bound + failures * health.GRACE
    row = Row(f"detection: server hangs 1 s into a step with a {agent_timeout} s timeout", [])
    agent = str(AGENTS / "hang_once.sh")

    def ours(rep: int) -> None:
        state, work = bench.state("detect-ours"), workspace(bench.fresh("detect-ours-work"), 1)
        env = bench_env(state, BENCH_ROOT_URL=bench.server.root_url)
        argv = ralph_run("detect.yaml", "-e", runbook_vars(bench.server, agent=agent))
        done = require(run_timed(argv, cwd=work, env=env, limit=120), "ralph-run")
        death = first(events(done.stdout), "death")
        if death["phase"] != "during-step":
            raise RuntimeError(
                f"ralph-run saw the death in phase {death['phase']}, not during-step"
            )
        row.ours.append(death["time"] - _hang_at(state))
        bench.server.start()  # healthy for the next run, whoever recovered it

    def seed(rep: int) -> None:
        state, work = bench.state("detect-seed"), workspace(bench.fresh("detect-seed-work"), 1)
        env = bench.seed_env(
            state,
            AGENT=agent,
            AGENT_TIMEOUT=agent_timeout,
            BENCH_MARKS=state / "marks",
            BENCH_ROOT_URL=bench.server.root_url,
        )
        require(run_timed(["bash", str(SEED_LOOP)], cwd=work, env=env, limit=180), "seed")
        row.seed.append(marks(state / "marks")["death-seen"] - _hang_at(state))
        bench.server.start()

    alternate(DETECT_REPS, {"ours": ours, "seed": seed})
    row.target = (
        f"≤ watch + {failures} x probe timeout + interval = {bound:g} s "
        f"(+ {health.GRACE:g} s grace per round), not the agent timeout"
    )
    row.met = max(row.ours) <= bound_with_grace
    row.notes.append(
        f"ralph-run (bench/runbooks/detect.yaml): watch {checks['watch']:g} s, probe timeout "
        f"{probe['timeout']:g} s, {failures} failed rounds {checks['interval']:g} s apart; "
        "time from the hang to its `death` event (the agent's tree is killed then). Seed: to "
        f"the failed `curl --max-time 3` after `timeout {agent_timeout}` ended the agent. "
        "Worst ralph-run run: " + _s(max(row.ours)) + "."
    )
    return [row]


def _hang_at(state: Path) -> float:
    return float((state / "hang-at").read_text())


# -- diagnostics --------------------------------------------------------------------------------

DIAG_CAP = 10.0  # seconds the seed's block may run before the bench kills it
DIAG_HANG_REPS = 2
DIAG_REPS = 5


def diagnostics_wall(bench: Bench) -> list[Row]:
    """The seed's nine facts at the moment of death: with one collector hung, and with none."""
    work = workspace(bench.fresh("diag-work"), 30, done=12)
    state = bench.state("diag-state")
    env = bench_env(state)
    with _environ(env), contextlib.chdir(work):
        (selected,) = plan.build(RUNBOOKS / "loop.yaml", None, None, [runbook_vars(bench.server)])
    specs = selected.runbook.collectors
    timeout = selected.model.diagnostics.timeout
    where = tasks.TaskGroup(selected, timeout=timeout, cwd=selected.workdir)
    log = work / "logs" / "vllm-deaths.log"
    log.parent.mkdir()
    block = f"source {SEED_LOOP}; capture_diagnostics 7 'item 13' 1234 >> {log}"
    hang_flag = state / "nvidia-smi.hang"

    def measure(row: Row, hang: bool) -> dict[str, Callable[[int], None]]:
        def ours(rep: int) -> None:
            hang_flag.touch() if hang else hang_flag.unlink(missing_ok=True)
            with _environ(env):
                started = time.perf_counter()
                entries = diagnostics.collect(specs, where, dict(selected.variables))
                row.ours.append(time.perf_counter() - started)
            hung = [e["name"] for e in entries if e["timed_out"]]
            failed = [e["name"] for e in entries if not e["ok"]]
            if (
                len(entries) != len(specs)
                or failed != hung
                or hung != (["nvidia-smi"] if hang else [])
            ):
                raise RuntimeError(
                    f"unexpected collector results: timed out {hung}, failed {failed}"
                )

        def seed(rep: int) -> None:
            hang_flag.touch() if hang else hang_flag.unlink(missing_ok=True)
            done = run_timed(["bash", "-c", block], cwd=work, env=env, limit=DIAG_CAP)
            row.seed.append(require(done, "the seed's block", None if hang else 0).seconds)

        return {"ours": ours, "seed": seed}

    hung = Row(f"diagnostics: {len(specs)} collectors, one hangs", [], seed_floor=True)
    alternate(DIAG_HANG_REPS, measure(hung, hang=True))
    hung.target = f"≤ the hung collector's timeout ({timeout:g} s) + 0.5 s"
    hung.met = max(hung.ours) <= timeout + 0.5
    hung.notes.append(
        f"nvidia-smi never answers (bench/stubs/nvidia-smi). ralph-run: "
        f"`diagnostics.collect` in-process, all at once, each under `diagnostics.timeout: "
        f"{timeout:g}`; the hung one is killed and recorded as timed out. Seed: its block as "
        f"written (sequential, no timeout) hangs for good; the bench kills it after {DIAG_CAP:g} s."
    )
    calm = Row(f"diagnostics: {len(specs)} collectors, none hangs", [])
    alternate(DIAG_REPS, measure(calm, hang=False))
    calm.notes.append(
        "all nine stubs answer at once, so this is the cost of starting the commands: "
        "ralph-run spawns each through `sh` on its own thread, the seed forks from bash."
    )
    hang_flag.unlink(missing_ok=True)
    if stray := leftovers():
        hung.notes.append(f"LEFT RUNNING after the case: {stray}")
    return [hung, calm]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """In-process cases see the peers' environment (stub tools on PATH)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# -- back to work after a recovery ---------------------------------------------------------------

BOOT_DELAYS = (1.3, 2.2, 3.1)  # the server's cold start in each rep, the same for both peers


def resume(bench: Bench) -> list[Row]:
    """Dead at the start; `compose up -d` brings it back after a cold start: healthy -> resumed."""
    server = Server(bench.fresh("resume-server"))
    row = Row("recovery: server healthy again -> loop resumed", [])
    compose_up = str(STUBS / "compose-up")

    def run(peer: str, rep: int) -> None:
        server.kill()
        state, work = (
            bench.state(f"resume-{peer}"),
            workspace(bench.fresh(f"resume-{peer}-work"), 1),
        )
        env = bench.seed_env(
            state,
            server,
            BOOT_DELAY=BOOT_DELAYS[rep],
            COMPOSE_UP=compose_up,
            HEALTH_URL=f"{server.root_url}/health",
            BENCH_MARKS=state / "marks",
        )
        if peer == "ours":
            argv = ralph_run("resume.yaml", "-e", runbook_vars(server, compose_up=compose_up))
        else:
            argv = ["bash", str(SEED_LOOP)]
            env["START_VLLM"] = str(SEED_START)
        with HealthyAgain(server) as healthy:
            done = require(run_timed(argv, cwd=work, env=env, limit=120), peer)
        if healthy.at is None:
            raise RuntimeError(f"{peer}: the server never came back")
        if peer == "ours":
            resumed = first(events(done.stdout), "step", step="run the agent")["time"]
        else:
            resumed = marks(state / "marks")["agent-start"]
        getattr(row, peer).append(resumed - healthy.at)

    try:
        alternate(
            len(BOOT_DELAYS),
            {"ours": lambda rep: run("ours", rep), "seed": lambda rep: run("seed", rep)},
        )
    finally:
        server.kill()
    row.notes.append(
        f"cold starts of {', '.join(f'{d:g}' for d in BOOT_DELAYS)} s. ralph-run "
        "(bench/runbooks/resume.yaml): recovery step `compose up -d` (returns at once), then "
        "`healthy_within` polls the probes every 0.5 s. Seed: its start_vllm.sh polls "
        "`curl -sf` every 4 s (bench/seed/start_vllm.sh). A runbook whose step is a start "
        "script that polls by itself resumes when that script returns, as the seed does."
    )
    return [row]


# -- --check ------------------------------------------------------------------------------------

CHECK_REPS = 5


def check(bench: Bench) -> list[Row]:
    """Validate without running: ralph-run --check vs ansible-playbook --syntax-check."""
    row = Row("`ralph-run runbooks/vllm.yaml --check` vs `ansible-playbook --syntax-check`", [])
    env = bench_env(bench.scratch)
    ours_argv = [
        sys.executable,
        "-m",
        "ralph_runner",
        str(ROOT / "runbooks" / "vllm.yaml"),
        "--check",
    ]
    playbook = [
        ANSIBLE_PLAYBOOK,
        "--syntax-check",
        "-i",
        "localhost,",
        str(ANSIBLE / "ralph-loop.yml"),
    ]

    # --check refuses a workdir the run would refuse (no checklist, no git repository for
    # verify): it runs where a loop would, in a workspace
    work = workspace(bench.fresh("check"), 1)

    def ours(rep: int) -> None:
        row.ours.append(
            require(run_timed(ours_argv, cwd=work, env=env, limit=60), "--check").seconds
        )

    def ansible(rep: int) -> None:
        done = run_timed(playbook, cwd=bench.scratch, env=env, limit=60)
        row.ansible.append(require(done, "--syntax-check").seconds)

    alternate(CHECK_REPS, {"ours": ours, "ansible": ansible})
    row.notes.append(
        "wall time of the process. ralph-run validates the schema and renders every task, probe "
        "and collector; --syntax-check parses bench/ansible/ralph-loop.yml (the same loop as a "
        "playbook) and renders nothing."
    )
    return [row]


# -- memory -------------------------------------------------------------------------------------

RSS_ITEMS = 1000
RSS_EVERY = 0.2  # seconds between samples
RSS_FLAT = 2.0  # MiB: more growth than this after iteration 100 is not flat


def rss(bench: Bench) -> list[Row]:
    """Sample ralph-run's RSS over a 1,000-iteration run: it must stay flat."""
    work = workspace(bench.fresh("rss-work"), RSS_ITEMS)
    argv = ralph_run("loop.yaml", "-e", runbook_vars(bench.server))
    started = time.perf_counter()
    child = subprocess.Popen(
        argv,
        cwd=work,
        env=bench_env(bench.scratch),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    iteration = [0]

    def follow() -> None:
        for line in child.stdout:
            if '"event": "iteration"' in line:
                iteration[0] += 1

    reader = threading.Thread(target=follow, name="rss-events", daemon=True)
    reader.start()
    process = psutil.Process(child.pid)
    samples: list[tuple[int, float]] = []
    try:
        while child.poll() is None:
            with contextlib.suppress(psutil.Error):
                samples.append((iteration[0], process.memory_info().rss / 2**20))
            time.sleep(RSS_EVERY)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, 9)
    reader.join()
    seconds = time.perf_counter() - started
    if child.returncode != 0 or ticked(work) != RSS_ITEMS:
        raise RuntimeError(f"ralph-run ended with {child.returncode}, {ticked(work)} items done")

    def at(n: int) -> float:
        return next((mib for it, mib in samples if it >= n), samples[-1][1])

    peak, end = max(mib for _, mib in samples), samples[-1][1]
    row = Row(f"memory: RSS over a {RSS_ITEMS:,}-iteration run (peak)", [peak], unit="MiB")
    row.target = f"flat: peak ≤ RSS at iteration 100 + {RSS_FLAT:g} MiB"
    row.met = peak <= at(100) + RSS_FLAT
    row.notes.append(
        f"RSS at iteration 1: {at(1):.1f} MiB, 100: {at(100):.1f}, 500: {at(500):.1f}, "
        f"900: {at(900):.1f}, end: {end:.1f}, peak: {peak:.1f} "
        f"({len(samples)} samples, every {RSS_EVERY:g} s, "
        f"{seconds:.0f} s run, same runbook and agent as the loop row)."
    )
    return [row]


# -- helpers ------------------------------------------------------------------------------------


def _all_ticked(work: Path, items: int, who: str) -> None:
    if ticked(work) != items:
        raise RuntimeError(f"{who} ticked {ticked(work)} of {items} items")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s"
