"""The flight recorder: bounded on disk, kill -9 proof, a follow command restarted with backoff,
a missing metric reported once, and the minutes before a death in its record."""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from support.e2e import Scenario
from support.gpu import nvml_works
from support.standin import StandIn, python_env, wait_for

from ralph_runner.deaths.recorder import Recorder, Ring, Settings, parse_metrics
from ralph_runner.durable import jsonl
from ralph_runner.process.connection import Local

pytestmark = pytest.mark.timeout(90)
MIB = 1024 * 1024


def settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "url": None,
        "metrics": [],
        "period": 5.0,
        "gpu": False,
        "follow": None,
        "file": None,
        "window": 600.0,
        "max_lines": 2000,
        "max_bytes": 16 * MIB,
        "connection": Local(),
    }
    return Settings(**{**base, **overrides})


class Events:
    """What the recorder emits (warnings), collected like the loop's Output would show them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, message: str) -> None:
        with self.lock:
            self.seen.append(("warning", {"message": message}))

    def messages(self) -> list[str]:
        with self.lock:
            return [f.get("message", "") for _, f in self.seen]


@contextlib.contextmanager
def recording(directory: Path, **overrides: Any) -> Iterator[tuple[Recorder, Events]]:
    events = Events()
    recorder = Recorder(settings(**overrides), directory, events)
    recorder.start()
    try:
        yield recorder, events
    finally:
        recorder.stop()


def entries(directory: Path) -> tuple[list[dict[str, Any]], jsonl.Skipped]:
    skipped = jsonl.Skipped()
    found = []
    for path in sorted(directory.glob("segment-*.jsonl")):
        found += [entry for _, entry in jsonl.read(path, skipped)]
    return found, skipped


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*") if path.is_file())


def test_parse_metrics_takes_the_wanted_series_only() -> None:
    page = textwrap.dedent(
        """\
        # HELP vllm:num_requests_running Requests in model execution batches.
        # TYPE vllm:num_requests_running gauge
        vllm:num_requests_running{engine="0",model_name="m"} 3.0
        vllm:num_requests_running{engine="1",model_name="m"} 5.0
        vllm:num_requests_running{engine=2} 9.0
        vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
        vllm:prompt_tokens_total{engine="1",model_name="m"} 20.0
        vllm:prompt_tokens_created{engine="0"} 1.7e9
        vllm:kv_cache_usage_perc{engine="0",model_name="a {b} c"} 0.25 1700000000
        vllm:weird NaN
        process_cpu_seconds_total 12.5
        """
    )
    wanted = {
        "vllm:num_requests_running",
        "vllm:prompt_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:weird",
        "vllm:num_preemptions_total",
    }
    assert parse_metrics(page, wanted) == {
        "vllm:num_requests_running": 5.0,  # a gauge: the largest series (a malformed one left out)
        "vllm:prompt_tokens_total": 120.0,  # a counter: the sum
        "vllm:kv_cache_usage_perc": 0.25,
    }


def test_the_ring_never_grows_past_its_bound(tmp_path: Path) -> None:
    """Filled with 8x its bound of log lines: never more than the bound on disk, the newest
    entries kept, the oldest gone; a second ring on the same directory continues it."""
    bound = MIB // 2
    ring = Ring(tmp_path, bound)
    line = "x" * 200
    written = 0
    for batch in range(2000):
        ring.append([{"t": float(batch), "log": f"{batch} {n} {line}"} for n in range(10)])
        written += 10 * 230
        assert disk_bytes(tmp_path) <= bound
        assert len(ring.files()) <= 8
    ring.close()
    assert written > 8 * bound
    found, skipped = entries(tmp_path)
    assert skipped.total == 0
    assert found[-1]["log"].startswith("1999 9 ")
    assert found[0]["t"] > 1000  # the first half is long gone
    times = [e["t"] for e in found]
    assert times == sorted(times)
    again = Ring(tmp_path, bound)
    again.append([{"t": 5000.0, "log": "after a restart"}])
    again.close()
    assert entries(tmp_path)[0][-1]["log"] == "after a restart"
    smaller = Ring(tmp_path, bound // 4)  # the bound lowered in the runbook: enforced at start
    smaller.close()
    assert disk_bytes(tmp_path) <= bound // 4


KILLED_RECORDER = """
import sys, time
from pathlib import Path
from ralph_runner.process.connection import Local
from ralph_runner.deaths.recorder import Recorder, Settings
follow = "i=0; while [ $i -lt 300000 ]; do echo log line $i of a chatty server; i=$((i+1)); done"
settings = Settings(url=None, metrics=[], period=5, gpu=False, follow=follow, file=None,
                    window=600, max_lines=2000, max_bytes=4 * 1024 * 1024, connection=Local())
Recorder(settings, Path(sys.argv[1])).start()
print("started", flush=True)
time.sleep(600)
"""


def test_kill_9_mid_write_loses_nothing_written_and_the_ring_reads_back(tmp_path: Path) -> None:
    ring_dir = tmp_path / "recorder"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_RECORDER, str(ring_dir)],
        env=python_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "started\n"
        wait_for(lambda: disk_bytes(ring_dir) > 256 * 1024, 30, "the ring to fill")
        tree = psutil.Process(child.pid).children(recursive=True)
        child.send_signal(signal.SIGKILL)  # while the follow command floods it
        child.wait(10)
    finally:
        for process in psutil.Process(child.pid).children() if child.poll() is None else tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    found, skipped = entries(ring_dir)
    assert skipped.torn <= 1  # at most the entry being written when the kill came
    numbers = [int(e["log"].split()[2]) for e in found if "log" in e]
    assert len(numbers) > 1000
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # no gap, no repeat
    ring = Ring(ring_dir, 4 * MIB)  # the next run appends after whatever the kill left
    ring.append([{"t": time.time(), "log": "next run"}])
    ring.close()
    after, skipped_after = entries(ring_dir)
    assert after[-1]["log"] == "next run" and skipped_after.torn == skipped.torn


def test_a_follow_command_that_exits_is_restarted_with_backoff(tmp_path: Path) -> None:
    started = time.monotonic()

    def three_exits() -> list[str] | None:
        ended = notes(tmp_path, "log follow command ended")
        return ended if len(ended) >= 3 else None

    with recording(tmp_path, follow="echo follow started; exit 3"):
        ended = wait_for(three_exits, 30, "three exits of the follow command")
        starts = [e["t"] for e in entries(tmp_path)[0] if e.get("log") == "follow started"]
    assert 3 <= len(starts) <= 4, starts
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[0] >= 0.9 and gaps[1] >= 1.9, gaps  # 1 s, then 2 s, then 4 s: no tight loop
    assert time.monotonic() - started >= 3.0
    assert "(exit 3)" in ended[0] and "again in 1 s" in ended[0] and "again in 2 s" in ended[1]


def notes(directory: Path, containing: str) -> list[str]:
    return [e["note"] for e in entries(directory)[0] if containing in e.get("note", "")]


def test_a_metric_the_server_does_not_expose_is_reported_once(tmp_path: Path) -> None:
    with StandIn(tmp_path / "vllm") as server:
        server.start(HEALTH_TIMEOUT="1")
        wanted = ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:no_such_thing"]
        url = f"{server.root_url}/metrics"
        with recording(tmp_path / "ring", url=url, metrics=wanted, period=0.1, gpu=True) as (
            recorder,
            events,
        ):
            wait_for(
                lambda: len([e for e in entries(tmp_path / "ring")[0] if "sample" in e]) >= 8,
                30,
                "eight samples",
            )
            tokens, why = recorder.prompt_tokens()
    samples = [e["sample"] for e in entries(tmp_path / "ring")[0] if "sample" in e]
    assert all(set(s["metrics"]) == set(wanted[:2]) for s in samples)
    missing = [m for m in events.messages() if "vllm:no_such_thing" in m]
    assert missing == [f"recorder: the server at {url} exposes no vllm:no_such_thing: not sampled"]
    assert len(notes(tmp_path / "ring", "vllm:no_such_thing")) == 1
    assert tokens is None and why == "vllm:prompt_tokens_total is not among recorder.metrics"
    if nvml_works():  # a GPU host: each sample has each GPU's memory
        assert all(s["gpu"] and s["gpu"][0]["memory_total_mib"] > 0 for s in samples)
    else:  # none here: said once, never an exception
        assert not any("gpu" in s for s in samples)
        assert len(notes(tmp_path / "ring", "GPU memory not sampled: no NVIDIA driver")) == 1


def test_the_window_holds_the_last_minutes_only(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("before the recorder started\n")
    with recording(tmp_path / "ring", file=log, window=600, max_lines=3) as (recorder, _):
        ring = recorder.ring
        ring.append([{"t": time.time() - 700, "log": "eleven minutes ago"}])
        with log.open("a") as out:
            out.write("one\ntwo\nthree\nfour\n")
        wait_for(lambda: "four" in [line for _, line in recorder.window()["log"]], 10, "four")
        recorder.mark_recovery(1)
        window = recorder.window()
    assert [line for _, line in window["log"]] == ["two", "three", "four"]
    assert window["log_lines_cut"] == 1  # "one": max_lines keeps the last ones
    assert window["since_recovery"] is not None and window["log_source"] == f"file: {log}"


def test_a_death_record_holds_the_recorder_window_and_its_signature(tmp_path: Path) -> None:
    """End to end: the loop on the stand-in, the recorder following its log file; the KV-cache
    assertion kills the server; its record has the samples and lines of the minutes before."""
    scenario = Scenario(tmp_path)
    try:
        scenario.prepare(["first item", "second item", "third item"], agent_sleep="0.3")
        book = yaml.safe_load(scenario.runbook_path.read_text())
        book["recorder"] = {
            "url": "{{ base_url | regex_replace('/v1$', '') }}/metrics",
            "metrics": ["vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:nope"],
            "period": 0.2,
            "file": "{{ standin_dir }}/server.log",
        }
        scenario.runbook_path.write_text(yaml.safe_dump(book))
        run = scenario.start()
        run.wait_agent(2)
        scenario.standin.trigger(die_on_prompt_chars=10)
        assert run.wait() == 0, run.stderr
        (death,) = scenario.records("death")
        workspace = scenario.workspace
    finally:
        scenario.close()
    section = death["recorder"]
    assert len(section["samples"]) >= 3
    assert any("vllm:kv_cache_usage_perc" in s.get("metrics", {}) for s in section["samples"])
    assert section["missing"] == ["vllm:nope"]
    lines = [line for _, line in section["log"]]
    assert any("AssertionError: num_required_blocks" in line for line in lines)
    assert death["signature"] == "AssertionError: num_required_blocks <num> < len(req_blocks) <num>"
    assert death["signature_from"]["source"] == "recorder log"
    json.dumps(death)  # plain JSON, NaN-free
    history = [e for _, e in jsonl.read(workspace / ".ralph" / "iterations.jsonl", jsonl.Skipped())]
    done = [e for e in history if e["outcome"] == "done"]
    assert done, history
    assert any(e["prompt_tokens"] for e in done), done  # the counter's change, read at each end
    # a figure (0 when the server had not published the counter's change yet), or why not
    assert all((e["prompt_tokens"] is not None) != bool(e["tokens_note"]) for e in history)
    (died,) = [e for e in history if e["outcome"] == "death"]
    assert died["prompt_tokens"] is None and "restarted" in died["tokens_note"]


def test_a_bad_recorder_block_is_named_at_its_line(tmp_path: Path) -> None:
    book = tmp_path / "book.yaml"
    book.write_text(
        "loop:\n  steps: []\nrecorder:\n  follow: docker logs -f x\n  file: x.log\n  perod: 3\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(book), "--check"],
        capture_output=True, text=True, env=python_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"{book}:6:3: recorder.perod: unknown key 'perod'; did you mean 'period'?" in done.stderr
    book.write_text("loop:\n  steps: []\nrecorder:\n  follow: a\n  file: b\n")
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(book), "--check"],
        capture_output=True, text=True, env=python_env(), timeout=60,
    )  # fmt: skip
    assert (
        f"{book}:3:1: recorder: a recorder follows one log: give `follow` or `file`" in done.stderr
    )
    assert "Traceback" not in done.stderr
