"""ensure_alive's capture and recovery on real processes: hung collectors, huge output, crash
loops, the vllm.yaml report on a machine with no docker and no GPU, `probe` and `diagnose`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
from support.standin import ROOT, START_SCRIPT, StandIn, unique_token, wait_for

from ralph_runner.liveness import diagnostics
from ralph_runner.runbook import plan

RALPH = [sys.executable, "-m", "ralph_runner"]


def ralph(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`ralph-run ARGS` as a user runs it."""
    return subprocess.run([*RALPH, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def workspace(tmp_path: Path, items: int = 3) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "PLAN.md").write_text("# plan\n")
    (work / "CHECKLIST.md").write_text("".join(f"- [ ] item {i}\n" for i in range(items)))
    for argv in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
    ):
        subprocess.run(argv, cwd=work, check=True)
    return work


def write_runbook(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "runbook.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_hung_collector_never_holds_the_others(tmp_path):
    work = workspace(tmp_path)
    never = f"echo never {unique_token()}"  # this test's own: no other test's shell matches it
    runbook = write_runbook(
        tmp_path,
        f"""\
        workdir: {work}
        diagnostics:
          timeout: 1
          collect:
            - name: hangs
              shell: sleep 1000; {never}
            - name: quick
              shell: echo quick
            - name: slowish
              shell: sleep 0.3; echo slowish
        loop:
          steps: [{{ shell: "true" }}]
        """,
    )
    (p,) = plan.build(runbook)
    group = diagnostics.group_for(p)
    started = time.monotonic()
    entries = diagnostics.collect(p.runbook.collectors, group, dict(p.variables))
    seconds = time.monotonic() - started
    by_name = {e["name"]: e for e in entries}
    assert by_name["hangs"]["timed_out"] and not by_name["hangs"]["ok"]
    assert by_name["quick"]["ok"] and by_name["quick"]["output"] == "quick\n"
    assert by_name["slowish"]["ok"] and by_name["slowish"]["seconds"] < 1.0
    assert seconds < 1.0 + diagnostics.GRACE  # bounded by the slowest collector's timeout
    assert not [
        q
        for q in psutil.process_iter(["cmdline"])
        if q.info["cmdline"] and never in " ".join(q.info["cmdline"])
    ]


def test_huge_collector_output_is_capped_without_memory_growing(tmp_path):
    work = workspace(tmp_path)
    runbook = write_runbook(
        tmp_path,
        f"""\
        workdir: {work}
        diagnostics:
          max_output: 4096
          collect:
            - name: flood
              shell: head -c 100000000 /dev/zero | tr '\\0' x; echo THE-END
              timeout: 60
        loop:
          steps: [{{ shell: "true" }}]
        """,
    )
    (p,) = plan.build(runbook)
    me = psutil.Process()
    before = me.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak.append(me.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    (entry,) = diagnostics.collect(
        p.runbook.collectors, diagnostics.group_for(p), dict(p.variables)
    )
    done.set()
    sampler.join()
    assert entry["ok"] and entry["truncated"]
    assert entry["output"].endswith("THE-END\n") and len(entry["output"]) <= 4096
    assert entry["cut_bytes"] == 100_000_008 - len(entry["output"])
    assert max(peak) - before < 50 * 1024 * 1024


def test_crash_loop_gives_up_instead_of_flapping(tmp_path):
    work = workspace(tmp_path, items=6)
    with StandIn(tmp_path / "vllm") as server:
        server.start()
        killer = tmp_path / "kill_server.py"
        killer.write_text(
            f"import httpx\nhttpx.post({server.root_url + '/admin/fail'!r}, "
            "json={'mode': 'die'})\n"
        )
        runbook = write_runbook(
            tmp_path,
            f"""\
            workdir: {work}
            vars: {{ base_url: "{server.url}" }}
            health:
              probes: [{{ name: models, http: {{ url: "{{{{ base_url }}}}/models" }}, timeout: 1 }}]
              failures_before_dead: 1
              interval: 0.1
            diagnostics: {{ log: logs/deaths.log, collect: [] }}
            recovery:
              steps: [{{ name: start, shell: "{START_SCRIPT} {server.port} {server.state_dir}" }}]
              healthy_within: 10
              crash_loop: {{ deaths: 1, within: 600 }}
            loop:
              steps:
                - ensure_alive: {{ phase: start }}
                - name: agent kills the server
                  shell: {sys.executable} {killer}
                - ensure_alive: {{ phase: post-step }}
            """,
        )
        done = subprocess.run(
            [*RALPH, str(runbook), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHON": sys.executable},
        )
        assert done.returncode == 4, done.stderr
        records = [json.loads(x) for x in (work / "logs/deaths.jsonl").read_text().splitlines()]
        deaths = [r for r in records if r["event"] == "death"]
        recoveries = [r for r in records if r["event"] == "recovery"]
        assert len(deaths) == 2
        assert recoveries[0]["recovered"] is True
        assert recoveries[1]["recovered"] is False and "crash loop" in recoveries[1]["reason"]
        assert "crash loop" in done.stderr
        assert "- [!]" not in (work / "CHECKLIST.md").read_text()


def test_vllm_runbook_report_on_a_machine_without_docker_or_gpu(tmp_path):
    """The real runbook, its server killed under the agent: its report has the seed's sections.
    (A server down at the run's first check is a start, not a death: it is seen up first.)

    The agent and the start script sleep for durations of this test's own: they are found by
    their command lines, and a plain `sleep 300` matched another test's agent (test_hang.py's)
    under pytest-xdist: the server was then killed before this run's agent had started, the
    run saw it down at its first check (a start, not a death), and no death record came."""
    work = workspace(tmp_path)
    token = unique_token()
    agent, recovery = ["sleep", f"300.{token}"], ["sleep", f"301.{token}"]
    start = tmp_path / "start_vllm.sh"  # a start that never finishes: we stop the run there
    start.write_text(f"#!/bin/sh\nexec {' '.join(recovery)}\n")
    start.chmod(0o755)
    bin_dir = tmp_path / "bin"  # an agent that works until the server's death kills it
    bin_dir.mkdir()
    (bin_dir / "opencode").write_text(f"#!/bin/sh\nexec {' '.join(agent)}\n")
    (bin_dir / "opencode").chmod(0o755)
    server = StandIn(tmp_path / "vllm")
    child = server.spawn()
    proc = subprocess.Popen(
        [
            *RALPH,
            str(ROOT / "runbooks/vllm.yaml"),
            "--json",
            "-e",
            json.dumps(
                {
                    "base_url": server.url,
                    "model": server.model,
                    "start_vllm": str(start),
                    "gpu_sched": "gpu-sched-missing",
                }
            ),
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    try:
        # Bounds for three tests at a time on two busy cores: the agent starts after the
        # run's start check; the death needs two failed rounds of the 3 s watch, then the
        # collectors (15 s each at most, all at once) before the record is written.
        wait_for(lambda: running(agent) or proc.poll() is not None, 60, "the agent")
        assert proc.poll() is None, "ralph-run ended before its agent ran"
        child.kill()
        child.wait(10)
        records = work / "logs/vllm-deaths.jsonl"
        wait_for(lambda: records.is_file() and records.read_text().strip(), 60, "a death record")
        wait_for(lambda: running(recovery), 30, "the recovery step")
    finally:
        child.kill()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    log = (work / "logs/vllm-deaths.log").read_text()
    for section in (
        "===== vLLM down detected at",
        "context: iter=1",
        "last prompt size:",
        "--- CHECKLIST ---",
        "--- PLAN.md ---",
        "--- last 5 commits ---",
        "--- docker container status ---",
        "--- container log (last lines) ---",
        "--- GPU memory (NVML) ---",
        "--- GPU scheduler status ---",
        "--- vLLM metrics ---",
        "--- processes ---",
        "===== END =====",
    ):
        assert section in log, section
    assert "no NVIDIA driver" in log
    death = json.loads(records.read_text().splitlines()[0])
    assert death["phase"] == "during-step" and death["fault"] == "server gone"
    assert any(p["reason"] == "refused" for p in death["probes"])
    (docker,) = [c for c in death["collectors"] if c["name"] == "docker container status"]
    assert not docker["ok"] or not docker["output"].strip()  # no docker, or no such container
    assert not running(agent)
    assert json.loads((work / ".ralph/state.json").read_text())["status"] == "interrupted"


def test_probe_command_exit_codes(tmp_path):
    work = workspace(tmp_path)
    with StandIn(tmp_path / "vllm") as server:
        server.start()
        runbook = write_runbook(
            tmp_path,
            f"""\
            workdir: {work}
            vars: {{ port: {server.port} }}
            health:
              probes:
                - {{ name: models, http: {{ url: "{server.url}/models" }}, timeout: 1 }}
                - {{ name: port, tcp: {{ port: "{{{{ port }}}}" }}, timeout: 1 }}
            loop:
              steps: [{{ shell: "true" }}]
            """,
        )
        healthy = ralph("probe", str(runbook))
        assert healthy.returncode == 0, healthy.stderr
        assert "models" in healthy.stdout and "port" in healthy.stdout
        server.trigger(dead_503=True)
        sick = ralph("probe", str(runbook), "--json")
        assert sick.returncode == 1
        results = {r["name"]: r for r in map(json.loads, sick.stdout.splitlines())}
        assert results["models"]["reason"] == "status" and results["port"]["ok"]


def test_diagnose_captures_now_without_recovery(tmp_path):
    work = workspace(tmp_path)
    marker = tmp_path / "recovered"
    runbook = write_runbook(
        tmp_path,
        f"""\
        workdir: {work}
        diagnostics:
          collect:
            - use: git
            - name: greeting
              shell: echo hello from {{{{ inventory_hostname }}}}
        recovery:
          steps: [{{ shell: "touch {marker}" }}]
        loop:
          steps: [{{ shell: "true" }}]
        """,
    )
    done = ralph("diagnose", str(runbook))
    assert done.returncode == 0, done.stderr
    assert "--- last 5 commits ---" in done.stdout and " init" in done.stdout
    assert "hello from localhost" in done.stdout
    assert "diagnostics taken at" in done.stdout and "down detected" not in done.stdout
    assert not marker.exists()
    assert not (work / "logs").exists()


def test_vllm_collector_keeps_only_the_gauges_of_metrics(tmp_path):
    work = workspace(tmp_path)
    with StandIn(tmp_path / "vllm") as server:
        server.start()
        runbook = write_runbook(
            tmp_path,
            f"""\
            workdir: {work}
            vars: {{ base_url: "{server.url}" }}
            diagnostics: {{ collect: [{{ use: vllm }}] }}
            loop: {{ steps: [{{ shell: "true" }}] }}
            """,
        )
        done = ralph("diagnose", str(runbook), "--json")
    assert done.returncode == 0, done.stderr
    (metrics,) = json.loads(done.stdout)["collectors"]
    names = [line.split("{")[0] for line in metrics["output"].splitlines()]
    assert metrics["ok"] and "vllm:kv_cache_usage_perc" in names
    assert all(name.startswith("vllm:") for name in names) and "# HELP" not in metrics["output"]


def test_command_probe_quotes_its_values_like_a_shell_task(tmp_path):
    work = workspace(tmp_path)
    odd = work / "a b; touch PWNED"
    odd.touch()
    runbook = write_runbook(
        tmp_path,
        f"""\
        workdir: {work}
        vars: {{ path: "{odd}" }}
        health:
          probes: [{{ name: file, command: "test -e {{{{ path }}}}" }}]
        loop: {{ steps: [{{ shell: "true" }}] }}
        """,
    )
    done = ralph("probe", str(runbook), cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (work / "PWNED").exists()
    odd.unlink()
    gone = ralph("probe", str(runbook), cwd=work)
    assert gone.returncode == 1 and "exit 1" in gone.stdout


def test_a_runbooks_own_report_template_is_used(tmp_path):
    work = workspace(tmp_path)
    (tmp_path / "short.j2").write_text(
        "{{ service }} {{ phase }}:{% for c in collectors %} {{ c.name }}={{ c.output | trim }}"
        "{% endfor %}\n"
    )
    runbook = write_runbook(
        tmp_path,
        f"""\
        workdir: {work}
        vars: {{ service_name: vLLM, token: s3cr3t-value }}
        secrets: [token]
        diagnostics:
          template: short.j2
          collect: [{{ name: hello, shell: "echo hi {{{{ token }}}}" }}]
        loop: {{ steps: [{{ shell: "true" }}] }}
        """,
    )
    done = ralph("diagnose", str(runbook))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "vLLM diagnose: hello=hi ****"


def running(cmdline: list[str]) -> bool:
    """A live process runs exactly `cmdline` (zombies have ended)."""
    return any(
        q.info["cmdline"] == cmdline and q.info["status"] != psutil.STATUS_ZOMBIE
        for q in psutil.process_iter(["cmdline", "status"])
    )
