"""Issue 28, the seed's GPU scheduler declared, on real loops: the runbook's `setup:` acquires
the GPU before the first start, its `teardown:` releases it exactly once at every end (and a
kill -9 is reported by the next run), a death with the lock still held is mended (released,
re-acquired, started) with no strike, and a restart waits for the GPU, not for the clock.

The scheduler is tests/support/gpu_sched_standin.py (a lock per job with its memory, refusal
while the others hold too much), a real process called through a `gpu-sched` script as the seed's
is; its calls.log says who asked what, when, and in which order."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import RalphRun, Scenario, make_workspace
from support.gpu import nvml_works
from support.standin import START_SCRIPT, python_env, wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = ROOT / "tests" / "support" / "gpu_sched_standin.py"
BROKEN_ACTION = ROOT / "tests" / "data" / "plugins" / "broken_action.py"
RALPH = [sys.executable, "-m", "ralph_runner"]
JOB, GB = "vllm-chat", 88  # the seed's: 88 of the GPU's 96 GB
START_MARK = 'echo "$(date +%s.%N) start the server -> 0" >> {{ sched_dir }}/calls.log'

MEND_EVERY = 0.5  # s between the recovery's asks for the GPU
SLACK = 0.4  # s an ask or a step may come late on a loaded two-core machine

# The shape of the shipped runbooks' example (runbooks/vllm.yaml), with the stand-ins' names.
ACQUIRE = "{{ gpu_sched }} acquire {{ gpu_job }} {{ gpu_gb }}"
SETUP = [{"name": "acquire the GPU", "wait": {"command": ACQUIRE, "every": 0.2, "max": 10}}]
TEARDOWN = [
    {"name": "release the GPU", "shell": "{{ gpu_sched }} release {{ gpu_job }}", "timeout": 10}
]
MEND = [
    {
        "name": "ask the scheduler",
        "shell": "{{ gpu_sched }} status",
        "register": "sched",
        "ignore_errors": True,
    },
    {
        "name": "release the dead server's lock",
        "shell": "{{ gpu_sched }} release {{ gpu_job }}",
        "when": "death.phase != 'start' and sched.rc == 0 and gpu_job in sched.stdout",
    },
    {"name": "wait for the GPU", "wait": {"command": ACQUIRE, "every": MEND_EVERY, "max": 4}},
]


class Scheduler:
    """The stand-in scheduler of one test: its `gpu-sched` script and what it was asked."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "sched"
        self.dir.mkdir()
        self.script = root / "gpu-sched"
        self.script.write_text(
            f'#!/bin/sh\nGPU_SCHED_DIR={self.dir} exec {sys.executable} {SCHEDULER} "$@"\n'
        )
        self.script.chmod(0o755)

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.script), *args], capture_output=True, text=True)

    def calls(self) -> list[tuple[float, str, int]]:
        """(epoch, what was asked, exit code) of every call, the server's starts included."""
        path = self.dir / "calls.log"
        found = []
        for line in path.read_text().splitlines() if path.exists() else []:
            when, rest = line.split(" ", 1)
            asked, code = rest.rsplit(" -> ", 1)
            found.append((float(when), asked, int(code)))
        return found

    def asked(self) -> list[str]:
        return [f"{asked} -> {code}" for _, asked, code in self.calls()]

    def holders(self) -> dict[str, float]:
        return json.loads((self.dir / "locks.json").read_text())


def lifecycle(
    scenario: Scenario,
    items: list[str],
    *,
    mend: bool = True,
    recovery: list[dict[str, Any]] | None = None,
    **settings: Any,
) -> Scheduler:
    """The e2e scenario with the scheduler's lifecycle: setup, teardown, recovery's mend."""
    scenario.prepare(items, **settings)
    sched = Scheduler(scenario.root)
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    book["vars"].update(gpu_sched=str(sched.script), gpu_job=JOB, gpu_gb=GB)
    book["vars"]["sched_dir"] = str(sched.dir)
    start = book["recovery"]["steps"]
    mark = {"name": "mark the start", "shell": START_MARK}
    book["recovery"]["steps"] = recovery or [*(MEND if mend else []), mark, *start]
    book["setup"], book["teardown"] = SETUP, TEARDOWN
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    return sched


def test_setup_acquires_before_the_first_start_and_teardown_releases_at_the_end(
    scenario: Scenario,
) -> None:
    sched = lifecycle(scenario, ["one", "two"])
    scenario.standin.stop()  # nothing listens: the first check starts it (a start, no death)
    run = scenario.start()

    assert run.wait() == 0, run.stderr
    assert sched.asked() == [
        f"acquire {JOB} {GB} -> 0",  # setup, before anything starts
        "status -> 0",  # the recovery steps, as a start: no release (death.phase is 'start')
        f"acquire {JOB} {GB} -> 0",  # what this job holds already: granted again
        "start the server -> 0",
        f"release {JOB} -> 0",  # teardown
    ]
    assert run.of("start") and not run.of("death")
    assert [(e["block"], e["step"]) for e in run.of("block-step")] == [
        ("setup", "acquire the GPU"),
        ("teardown", "release the GPU"),
    ]
    assert [e["ok"] for e in run.of("block-steps")] == [True, True]
    assert sched.holders() == {}
    assert not (scenario.workspace / ".ralph" / "held").exists()
    status = json.loads((scenario.workspace / ".ralph" / "status.json").read_text())
    assert status["lifecycle"] == {
        "setup": "done",
        "teardown": "done",
        "error": None,
        "held": False,
        "left_by_last_run": None,
    }


LIMIT = {"regex": "LIMIT REACHED", "reset": "none", "source": "test"}


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        ("finished", 0),
        ("max_iterations", 5),
        ("gave up", 4),
        ("agent broken", 6),
        ("limited", 7),
        ("SIGTERM", 143),
        ("SIGINT", 130),
        ("runbook error", 2),
        ("crash", 70),
        ("workers 2", 0),
    ],
)
def test_teardown_runs_exactly_once_whatever_the_end(
    scenario: Scenario, end: str, expected: int
) -> None:
    settings: dict[str, Any] = {}
    if end == "max_iterations":
        settings["max_iterations"] = 1
    if end in ("SIGTERM", "SIGINT"):
        settings["agent_sleep"] = "30"
    cannot_start = [{"name": "cannot start", "shell": "exit 1"}]
    sched = lifecycle(
        scenario,
        ["one", "two", "three"],
        recovery=cannot_start if end == "gave up" else None,
        attempts=1,
        **settings,
    )
    if end in ("agent broken", "limited"):  # an agent that fails at once, the same way
        book = yaml.safe_load(scenario.runbook_path.read_text())
        said = "Error: Model not found: vllm/qwen3" if end == "agent broken" else "LIMIT REACHED"
        book["loop"]["steps"][1]["shell"] = f"echo '{said}'; exit 1"
        book["checklist"]["strikes"] = 1
        book["limits"] = {"max_wait": 1, "patterns": [LIMIT]}
        scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    if end in ("runbook error", "crash", "workers 2"):
        book = yaml.safe_load(scenario.runbook_path.read_text())
        if end == "runbook error":  # a template that fails only when the step renders it
            book["loop"]["steps"][1]["shell"] = "echo {{ 1 // (iteration - iteration) }}"
        elif end == "crash":  # a bug in ralph-run: an action whose code raises (test_crash.py)
            book["loop"]["steps"][1] = {"name": "explode", "boom": "now"}
        else:
            book["loop"]["workers"] = 2
        scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    if end == "gave up":
        scenario.standin.stop()
    if end == "crash":  # the run through a ralph-run that has the broken action
        command = [sys.executable, str(BROKEN_ACTION), str(scenario.runbook_path), "--json"]
        run = RalphRun([*command, "-e", json.dumps(scenario.facts)], scenario.workspace)
        scenario.runs.append(run)
    else:
        run = scenario.start()
    if end in ("SIGTERM", "SIGINT"):
        run.wait_agent(1)
        run.send(getattr(signal, end))

    assert run.wait() == expected, (run.events, run.stderr)
    asked = sched.asked()
    assert asked.count(f"release {JOB} -> 0") == 1, asked
    assert asked[0] == f"acquire {JOB} {GB} -> 0" and asked[-1] == f"release {JOB} -> 0", asked
    assert [e["block"] for e in run.of("block-steps")] == ["setup", "teardown"]
    assert sched.holders() == {}
    assert not (scenario.workspace / ".ralph" / "held").exists()


def test_a_kill_9_is_reported_by_the_next_run_before_it_acquires_again(
    scenario: Scenario,
) -> None:
    sched = lifecycle(scenario, ["one", "two"], agent_sleep="30")
    first = scenario.start()
    first.wait_agent(1)
    assert (scenario.workspace / ".ralph" / "held").exists()
    first.process.kill()  # no teardown: the lock stays with the dead run
    first.wait()
    assert sched.holders() == {JOB: GB}

    book = yaml.safe_load(scenario.runbook_path.read_text())
    book["loop"]["max_iterations"] = 1
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    second = scenario.start()
    warning = second.wait_event("warning")
    assert "ended without its teardown" in warning["message"], warning
    assert f"pid {first.process.pid}" in warning["message"]
    setup = second.wait_event("block-step", block="setup")
    assert second.events.index(warning) < second.events.index(setup)  # said before it acquires
    second.wait_event("block-steps", block="setup")
    status = second.wait_status(lambda s: "lifecycle" in s, "the lifecycle in status")
    assert status["lifecycle"]["left_by_last_run"]["pid"] == first.process.pid
    second.send(signal.SIGTERM)
    assert second.wait() == 143
    assert sched.asked().count(f"acquire {JOB} {GB} -> 0") == 2
    assert sched.asked().count(f"release {JOB} -> 0") == 1
    assert not (scenario.workspace / ".ralph" / "held").exists()
    shown = scenario.command("status", str(scenario.workspace))  # the operator's view
    assert f"the last run (pid {first.process.pid}, setup at " in shown, shown
    assert "lifecycle:  setup done" in shown, shown


def test_a_death_with_the_lock_still_held_is_mended_with_no_strike(scenario: Scenario) -> None:
    sched = lifecycle(scenario, ["one", "two"], agent_sleep="1.5 if iteration == 1 else 0.1")
    run = scenario.start()
    run.wait_agent(1)
    scenario.standin.stop()  # the container died; the scheduler still counts its 88 GB

    assert run.wait() == 0, (run.events, run.stderr)
    assert len(run.of("death")) == 1 and not run.of("strike")
    after = sched.asked()[1:]  # the setup's acquire first
    assert after[:5] == [
        "status -> 0",
        f"release {JOB} -> 0",  # the desync, mended
        f"acquire {JOB} {GB} -> 0",
        "start the server -> 0",
        f"release {JOB} -> 0",  # the teardown
    ], after
    assert [e["step"] for e in run.of("recovery-step") if not e.get("skipped")] == [
        "ask the scheduler",
        "release the dead server's lock",
        "wait for the GPU",
        "mark the start",
        "start the stand-in",
    ]
    assert scenario.checklist().count("- [x]") == 2


def test_the_restart_starts_within_a_second_of_the_other_job_releasing_the_gpu(
    scenario: Scenario,
) -> None:
    sched = lifecycle(scenario, ["one", "two"], agent_sleep="1.5 if iteration == 1 else 0.1")
    run = scenario.start()
    run.wait_agent(1)
    # During the death, a background job takes 80 GB (the seed's 30 s delay was for this):
    # the scheduler reaped the dead server's lock, the job got the memory, then the server died.
    assert sched("release", JOB).returncode == 0
    assert sched("acquire", "vlm-batch", "80").returncode == 0
    scenario.standin.stop()
    wait_for(lambda: sched.asked().count(f"acquire {JOB} {GB} -> 1") >= 2, 20, "refused acquires")
    assert sched("release", "vlm-batch").returncode == 0

    assert run.wait() == 0, (run.events, run.stderr)
    calls = sched.calls()
    freed = next(t for t, asked, _ in calls if asked == "release vlm-batch")
    granted = next(t for t, asked, code in calls if t > freed and asked.startswith("acquire "))
    started = next(t for t, asked, _ in calls if t > freed and asked == "start the server")
    # the recovery's wait asks every MEND_EVERY s (measured between its refused asks), the
    # ask after the release is granted within one look, and the start follows at once
    refused = [t for t, asked, code in calls if asked == f"acquire {JOB} {GB}" and code == 1]
    gaps = [b - a for a, b in itertools.pairwise(refused)]
    assert gaps and all(gap < MEND_EVERY + SLACK for gap in gaps), gaps
    assert granted - freed < MEND_EVERY + SLACK and started - granted < SLACK, (
        freed,
        granted,
        started,
    )
    print(f"freed -> start of the restart: {started - freed:.3f} s (every {MEND_EVERY} s)")
    (recovery,) = run.of("recovery")
    assert recovery["recovered"] is True


def test_the_wait_gives_up_at_its_bound_with_exit_4(scenario: Scenario) -> None:
    sched = lifecycle(scenario, ["one", "two"], agent_sleep="1.5", attempts=1)
    run = scenario.start()
    run.wait_agent(1)
    assert sched("release", JOB).returncode == 0
    assert sched("acquire", "vlm-batch", "80").returncode == 0  # and never gives it back
    scenario.standin.stop()

    assert run.wait() == 4, (run.events, run.stderr)
    (recovery,) = run.of("recovery")
    assert recovery["recovered"] is False
    assert "wait for the GPU" in recovery["reason"] and "timed out" in recovery["reason"]
    assert "start the server -> 0" not in sched.asked()[1:]  # never started into the OOM
    assert sched.holders() == {"vlm-batch": 80}  # teardown released ours only


def test_check_shows_the_blocks(scenario: Scenario) -> None:
    lifecycle(scenario, ["one"])
    facts = json.dumps(scenario.facts)
    done = subprocess.run(
        [*RALPH, str(scenario.runbook_path), "--check", "--json", "-e", facts],
        capture_output=True,
        text=True,
        cwd=scenario.workspace,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (plan,) = json.loads(done.stdout)
    (setup,) = plan["setup"]
    assert setup["name"] == "acquire the GPU"
    assert (
        setup["wait"].startswith("wait until `")
        and "acquire vllm-chat 88` succeeds" in (setup["wait"])
    ), setup
    assert [step["name"] for step in plan["teardown"]] == ["release the GPU"]
    assert plan["teardown"][0]["shell"].endswith("gpu-sched release vllm-chat")


def uncommented_gpu_example(name: str) -> str:
    """A shipped runbook with its commented GPU scheduler example (every region between
    `# >>> GPU scheduler` and `# <<< GPU scheduler`) uncommented."""
    lines, inside = [], False
    for line in (ROOT / "runbooks" / name).read_text().splitlines():
        marker = line.strip()
        if marker.startswith(("# >>> GPU scheduler", "# <<< GPU scheduler")):
            inside = marker.startswith("# >>>")
            continue
        if inside:
            indent = line[: len(line) - len(line.lstrip())]
            line = indent + line.lstrip().removeprefix("#").removeprefix(" ")
        lines.append(line)
    assert not inside, f"{name}: a GPU scheduler region is not closed"
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", ["vllm.yaml", "vllm-local.yaml"])
def test_the_shipped_gpu_scheduler_examples_render(tmp_path: Path, name: str) -> None:
    (tmp_path / "runbooks").mkdir()
    runbook = tmp_path / "runbooks" / name
    runbook.write_text(uncommented_gpu_example(name))
    for beside in ("agents", "vllm-local"):  # what the runbooks name beside themselves
        (tmp_path / "runbooks" / beside).symlink_to(ROOT / "runbooks" / beside)
    workdir = make_workspace(tmp_path / "work", ["one"])
    done = subprocess.run(
        [*RALPH, str(runbook), "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=workdir,
    )
    assert done.returncode == 0, done.stderr
    (plan,) = json.loads(done.stdout)
    assert [step["name"] for step in plan["setup"]] == ["acquire the GPU"]
    assert [step["name"] for step in plan["teardown"]] == ["stop vLLM", "release the GPU"]
    names = [step["name"] for step in plan["recovery"]["steps"]]
    mend = ["ask the scheduler", "release the dead server's lock", "wait for the GPU"]
    assert names[names.index("ask the scheduler") : names.index("start vLLM")] == mend
    assert "acquire vllm-chat 88` succeeds" in plan["setup"][0]["wait"]


def test_the_shipped_vllm_local_example_runs_the_lifecycle(scenario: Scenario) -> None:
    """runbooks/vllm-local.yaml with its GPU scheduler example uncommented, on the stand-ins:
    setup acquires, the first check starts the server, a death with the lock held is mended,
    teardown releases once."""
    scenario.prepare(["one", "two"])
    standin = scenario.standin
    standin.stop()
    sched = Scheduler(scenario.root)
    start_vllm = scenario.root / "start_vllm.sh"  # start | stop | status, as vllm-local's own
    start_vllm.write_text(
        "#!/bin/bash\n"
        'case "$1" in\n'
        f'  start) echo "$(date +%s.%N) start the server -> 0" >> {sched.dir}/calls.log\n'
        f"    PYTHON={sys.executable} HEALTH_TIMEOUT=1"
        f" exec {START_SCRIPT} {standin.port} {standin.state_dir} ;;\n"
        f'  stop) pid="$(cat {standin.state_dir}/server.pid)"; kill -TERM -- "-$pid";'
        ' while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done ;;\n'
        '  *) echo "stand-in: $1" ;;\n'
        "esac\n"
    )
    start_vllm.chmod(0o755)
    runbook = scenario.root / "runbooks" / "vllm-local.yaml"
    runbook.parent.mkdir()
    runbook.write_text(uncommented_gpu_example("vllm-local.yaml"))
    agent = (
        f"{sys.executable} -m ralph_runner.standin.agent --url {standin.url}"
        f" --model {standin.model} --sleep 1 --"
    )
    facts = {
        "port": standin.port,
        "model": standin.model,
        "start_vllm": str(start_vllm),
        "vllm_dir": str(standin.state_dir),
        "gpu_sched": str(sched.script),
        "agent": agent,
    }
    command = [*RALPH, str(runbook), "--json", "-e", json.dumps(facts)]
    run = RalphRun(command, scenario.workspace)
    run.wait_agent(1)
    standin.stop()  # a death: the server gone, its lock held

    assert run.wait(120) == 0, (run.events, run.stderr)
    asked = sched.asked()
    assert asked[:3] == [f"acquire {JOB} {GB} -> 0", "status -> 0", f"acquire {JOB} {GB} -> 0"]
    assert asked[3] == "start the server -> 0"  # the first check: a start, after the acquire
    assert asked[4:8] == [
        "status -> 0",
        f"release {JOB} -> 0",  # the desync, mended
        f"acquire {JOB} {GB} -> 0",
        "start the server -> 0",
    ], asked
    assert asked[-1] == f"release {JOB} -> 0" and asked.count(f"release {JOB} -> 0") == 2
    assert len(run.of("death")) == 1 and not run.of("strike")
    assert sched.holders() == {}


# NVML where the driver's library is missing, as pynvml says it: planted on a machine that has a
# driver, so that the case runs on every machine (it used to skip on a GPU host)
NO_DRIVER_NVML = """
class NVMLError(Exception):
    pass

def nvmlInit():
    raise NVMLError("NVML Shared Library Not Found")
"""


def test_with_no_driver_the_wait_says_so_once_and_falls_back(
    scenario: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No NVML: the scheduler's answer alone counts, or with no command a fixed delay."""
    if nvml_works():
        fake = scenario.root / "no-driver"
        fake.mkdir()
        (fake / "pynvml.py").write_text(NO_DRIVER_NVML)
        monkeypatch.setenv("PYTHONPATH", str(fake))  # ralph-run's, before its site-packages
    sched = lifecycle(scenario, ["one"])
    said = scenario.root / "said"
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    book["setup"] = [
        {
            "name": "acquire the GPU",
            "wait": {"gpu_free_mib": 90112, "command": ACQUIRE, "every": 0.2, "max": 10},
            "register": "with_command",
        },
        {"name": "no command", "wait": {"gpu_free_mib": 1, "fallback": 0.3}, "register": "alone"},
        {
            "name": "say",
            "shell": "printf '%s\\n' {{ with_command.stdout }} {{ with_command.source }}"
            " {{ alone.source }} {{ alone.waited }} > {{ said }}",
        },
    ]
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    assert sched("acquire", "vlm-batch", "80").returncode == 0
    run = scenario.start(said=str(said))
    wait_for(lambda: f"acquire {JOB} {GB} -> 1" in sched.asked(), 20, "a refused acquire")
    assert sched("release", "vlm-batch").returncode == 0

    assert run.wait() == 0, (run.events, run.stderr)
    text = said.read_text()
    assert text.count("no NVIDIA driver") == 1, text
    assert "waiting on the command alone instead" in text
    *_, with_command, alone, waited = text.splitlines()
    assert (with_command, alone) == ("command", "delay")
    assert 0.3 <= float(waited) < 1.5


# An NVML with one GPU whose free memory (MiB) is read from the file $FAKE_NVML_FREE: the
# driver's library is the one part not in this machine, so it alone is replaced.
FAKE_NVML = """
import os
import time
from types import SimpleNamespace

class NVMLError(Exception):
    pass

def nvmlInit():
    pass

def nvmlShutdown():
    pass

def nvmlDeviceGetCount():
    return 1

def nvmlDeviceGetHandleByIndex(index):
    return index

def nvmlDeviceGetMemoryInfo(handle):
    with open(os.environ["FAKE_NVML_FREE"]) as file:
        free = int(file.read()) * 1024 * 1024
    with open(os.environ["FAKE_NVML_FREE"] + ".looks", "a") as looks:  # when it was read
        looks.write(f"{time.time()} {free // 1024 // 1024}\\n")
    return SimpleNamespace(free=free, used=0, total=free)
"""


EVERY = 0.5  # s between the wait's looks at NVML


def read_looks(path: Path) -> list[tuple[float, int]]:
    """The fake NVML's reads: (when, the free MiB it said)."""
    text = path.read_text() if path.exists() else ""
    return [(float(when), int(mib)) for when, mib in (line.split() for line in text.splitlines())]


def test_the_wait_starts_within_a_look_of_the_gpu_memory_freeing(scenario: Scenario) -> None:
    """`gpu_free_mib` through NVML: the step ends within `every` of the memory being free."""
    scenario.prepare(["one"])
    fake = scenario.root / "fake-nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_NVML)
    free = scenario.root / "free-mib"
    free.write_text("8000")  # another job holds the rest
    said = scenario.root / "said"
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    book["setup"] = [
        {
            "name": "wait for the GPU",
            "wait": {"gpu_free_mib": 90112, "every": EVERY, "max": 20},
            "register": "gpu",
        },
        {"name": "say", "shell": "printf '%s\\n' {{ gpu.stdout }} {{ gpu.source }} > {{ said }}"},
    ]
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    facts = json.dumps({**scenario.facts, "said": str(said)})
    command = [*RALPH, str(scenario.runbook_path), "--json", "-e", facts]
    env = python_env(FAKE_NVML_FREE=str(free))
    env["PYTHONPATH"] = os.pathsep.join([str(fake), env["PYTHONPATH"]])
    run = subprocess.Popen(
        command, cwd=scenario.workspace, env=env, stdout=subprocess.PIPE, text=True
    )
    assert run.stdout is not None
    looks = scenario.root / "free-mib.looks"
    lines = []
    for line in run.stdout:
        lines.append(json.loads(line))
        if lines[-1]["event"] == "block-step":
            wait_for(lambda: len(read_looks(looks)) >= 3, 20, "three looks at 8000 MiB")
            freed = time.time()
            free.write_text("95000")
            break
    events = [*lines, *(json.loads(line) for line in run.stdout)]
    assert run.wait(60) == 0, events
    setup = next(e for e in events if e["event"] == "block-steps")
    # the looks come `every` apart (measured, not assumed: a wait that looked less often
    # would fail here), and the step ends within one look (and a loaded machine's slack)
    seen = read_looks(looks)
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(seen)]
    assert all(gap < EVERY + SLACK for gap in gaps), gaps
    assert sorted(gaps)[len(gaps) // 2] < 1.5 * EVERY, gaps  # the median: `every`, not twice it
    first_free = next(when for when, mib in seen if mib == 95000)
    assert first_free - freed < EVERY + SLACK, (first_free, freed)
    assert setup["ok"] and setup["time"] - first_free < SLACK, (setup, first_free)
    text = said.read_text()
    assert "95000 MiB free (NVML), 90112 wanted" in text and text.splitlines()[-1] == "nvml"
