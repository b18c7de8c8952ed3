"""Run the vLLM stand-in for a test: start it on a free port, break it, and leave nothing behind.

Usage in a test module (a fixture cannot be shared by import without tripping ruff's F811):

    @pytest.fixture
    def server(tmp_path):
        with StandIn(tmp_path / "vllm") as standin:
            standin.start()
            yield standin
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from signal import SIGKILL, SIGTERM
from types import TracebackType
from typing import Any, TypeVar

import httpx
import psutil
import pytest
from httpx_sse import ServerSentEvent, connect_sse
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
START_SCRIPT = ROOT / "ralph_runner" / "standin" / "start_server.sh"
MODEL = "stand-in"
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Polls until `condition()` is truthy and returns its value; fails the test at the deadline.
    Every 20 ms at first, then less often, to once every 0.1 s: a scan of every process costs
    ~11 ms of CPU here, so a long wait polled every 20 ms took over half a core from the
    processes under test."""
    deadline = time.monotonic() + timeout
    pause = 0.02
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 1.25, 0.1)
    return value


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a stand-in process: this interpreter, this checkout on the path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path, **extra}


def ralph(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`ralph-run ARGS` (a command beside a running loop: pause, resume, status), from this
    checkout."""
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", *args],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class StandIn:
    """One stand-in server's port and state directory, whichever process currently serves them."""

    def __init__(self, state_dir: Path, port: int | None = None, model: str = MODEL) -> None:
        self.state_dir = state_dir
        self.port = port or free_port()
        self.model = model
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root_url}/v1"  # the OpenAI base URL, as a runbook's base_url
        self.log_path = state_dir / "server.log"
        state_dir.mkdir(parents=True, exist_ok=True)

    # starting

    @property
    def start_command(self) -> list[str]:
        return [str(START_SCRIPT), str(self.port), str(self.state_dir)]

    def run_start_script(self, **env: str) -> subprocess.CompletedProcess[str]:
        """Runs start_server.sh (env: START_TIMEOUT, HEALTH_TIMEOUT, ...), whatever its outcome."""
        return subprocess.run(
            self.start_command,
            env=python_env(MODEL=self.model, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def start(self, **env: str) -> subprocess.CompletedProcess[str]:
        result = self.run_start_script(**env)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    def spawn(self, *extra_args: str) -> subprocess.Popen[bytes]:
        """Starts the server as a child (to see its exit code) and waits until it answers."""
        command = [sys.executable, "-m", "ralph_runner.standin.server", "--port", str(self.port)]
        command += ["--state-dir", str(self.state_dir), "--model", self.model, *extra_args]
        child = subprocess.Popen(command, env=python_env(), start_new_session=True)
        wait_for(lambda: self.healthy() or child.poll() is not None, what="the server to answer")
        return child

    # looking

    @property
    def pid(self) -> int | None:
        try:
            return int((self.state_dir / "server.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def starts(self) -> int:
        path = self.state_dir / "starts"
        return int(path.read_text()) if path.exists() else 0

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8") if self.log_path.exists() else ""

    def exit_marker(self) -> dict[str, Any] | None:
        path = self.state_dir / "exit.json"
        return json.loads(path.read_text()) if path.exists() else None

    def get(self, path: str, timeout: float = 3.0) -> httpx.Response:
        return httpx.get(self.root_url + path, timeout=timeout)

    def chat(self, prompt: str, timeout: float = 3.0) -> httpx.Response:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}]}
        return httpx.post(f"{self.url}/chat/completions", json=body, timeout=timeout)

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            return self.get("/health", timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def processes(self) -> list[psutil.Process]:
        """Every live stand-in server process serving this state directory."""
        found = []
        for process in psutil.process_iter(["cmdline", "status"]):
            cmdline = process.info["cmdline"] or []
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if "ralph_runner.standin.server" in cmdline and str(self.state_dir) in cmdline:
                found.append(process)
        return found

    # breaking

    def trigger(self, **faults: Any) -> None:
        """Writes control.json atomically: e.g. trigger(die=True), trigger(slow_once=0.5)."""
        partial = self.state_dir / ".control.json.partial"
        partial.write_text(json.dumps(faults))
        partial.replace(self.state_dir / "control.json")

    def admin(self, mode: str, value: Any = True) -> httpx.Response:
        body = {"mode": mode, "value": value}
        return httpx.post(f"{self.root_url}/admin/fail", json=body, timeout=3.0)

    def engine_admin(self, mode: str) -> Callable[[], None]:
        return lambda: self.admin(mode).raise_for_status()

    def target(
        self, child: subprocess.Popen[bytes] | None = None, long_tokens: int = 300
    ) -> Target:
        """This stand-in as a Target for the shared checks, broken through its admin endpoint;
        its exit code is the child's (spawn) or else the exit marker's."""

        def exit_code(timeout: float) -> int | None:
            if child is None:
                with contextlib.suppress(AssertionError):
                    return wait_for(self.exit_marker, timeout, "the exit marker")["code"]
                return None
            try:
                return child.wait(timeout)
            except subprocess.TimeoutExpired:
                return None

        return Target(
            root_url=self.root_url,
            model=self.model,
            hang=self.engine_admin("engine_hang"),
            resume=self.engine_admin("resume"),
            kill=self.engine_admin("engine_death"),
            exit_code=exit_code,
            log=self.log,
            long_tokens=long_tokens,
        )

    def wait_dead(self, pid: int, timeout: float = 10.0) -> dict[str, Any]:
        """Waits until `pid` is gone; its exit marker."""
        wait_for(lambda: process_gone(pid), timeout, f"pid {pid} to end")
        return wait_for(self.exit_marker, timeout, "the exit marker")

    # stopping

    def stop(self) -> None:
        """TERM, then KILL, every server of this state directory; waits until they are gone."""
        processes = self.processes()
        for signal in (SIGTERM, SIGKILL):
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal)
            deadline = time.monotonic() + 5
            while not all(process_gone(process.pid) for process in processes):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            else:
                return

    def __enter__(self) -> StandIn:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def process_gone(pid: int) -> bool:
    """True once `pid` has ended; a zombie (not yet reaped by init) counts as ended."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# Reading another process races its end: between two reads it may exit, turn zombie (psutil
# then raises ZombieProcess from cmdline()) or be reaped (NoSuchProcess). A test that scans
# processes reads each through these, never through a bare psutil call.


def cmdline_of(process: psutil.Process) -> list[str]:
    """`process`'s command line; [] once it has ended, turned zombie or cannot be read."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def alive(process: psutil.Process) -> bool:
    """True while `process` runs; False once it has ended, been reaped or is a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def live_children(of: psutil.Process | None = None) -> list[psutil.Process]:
    """The live (not zombie) descendants of `of` (this process by default); [] once it ended."""
    try:
        children = (of or psutil.Process()).children(recursive=True)
    except psutil.Error:
        return []
    return [child for child in children if alive(child)]


def unique_token() -> str:
    """Twelve digits no other test's process has in its command line (pytest-xdist runs three
    tests at a time: a test that matched any `sleep 300` found another test's agent). Digits, so
    that it also makes a duration of its own: `sleep 300.{token}`."""
    return f"{uuid.uuid4().int % 10**12:012d}"


# Behavioural checks that hold for the stand-in and for a real vLLM alike. Each takes a `Target`:
# where the server is and how to break it (the stand-in: its admin endpoint; a real vLLM: signals
# to its VLLM::EngineCore), so one parametrised test can run them against both.


@dataclass
class Target:
    """A vLLM-compatible server under test and the ways to break it."""

    root_url: str  # http://127.0.0.1:PORT, no /v1
    model: str
    hang: Callable[[], None]  # the engine stops (vLLM: SIGSTOP of EngineCore)
    resume: Callable[[], None]  # ... and goes on (SIGCONT)
    kill: Callable[[], None]  # the engine dies (vLLM: kill -9 of EngineCore)
    exit_code: Callable[[float], int | None]  # waits up to N s for the API server's exit code
    log: Callable[[], str]  # the server's log so far
    long_tokens: int = 400  # a generation that lasts a few seconds at the server's speed

    @property
    def url(self) -> str:
        return f"{self.root_url}/v1"

    def get(self, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(self.root_url + path, timeout=timeout)

    def generate(self, timeout: float = 5.0, **extra: Any) -> httpx.Response:
        """A non-streamed chat completion."""
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], **extra}
        return httpx.post(f"{self.url}/chat/completions", json=body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Each sample of /metrics parsed by prometheus_client, summed over label sets."""
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def tokens(self) -> float:
        found = self.metrics()
        return found["vllm:generation_tokens_total"] + found["vllm:prompt_tokens_total"]


def long_request(target: Target, route: str = "/chat/completions", **extra: Any) -> dict[str, Any]:
    """A generation that runs `long_tokens` tokens (ignore_eos), streamed with usage."""
    body: dict[str, Any] = {"model": target.model, "stream": True, "ignore_eos": True}
    if route == "/responses":
        body |= {"input": "tell me a story", "max_output_tokens": target.long_tokens}
    elif route == "/completions":
        body |= {"prompt": "tell me a story", "max_tokens": target.long_tokens}
    else:
        body |= {"messages": [{"role": "user", "content": "tell me a story"}]}
        body |= {"max_tokens": target.long_tokens}
    if route != "/responses":
        body["stream_options"] = {"include_usage": True}
    return body | extra


class Stream(threading.Thread):
    """Reads one SSE stream in the background with httpx-sse (a parser of the standard):
    its events as they come, how it ended (`done`, or `error`: the exception)."""

    def __init__(self, url: str, body: dict[str, Any], read_timeout: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.timeout = httpx.Timeout(10.0, read=read_timeout)
        self.events: list[ServerSentEvent] = []
        self.status: int | None = None
        self.content_type = ""
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._leaving = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with (
                httpx.Client(timeout=self.timeout) as client,
                connect_sse(client, "POST", self.url, json=self.body) as source,
            ):
                self.status = source.response.status_code
                self.content_type = source.response.headers.get("content-type", "")
                for event in source.iter_sse():
                    if self._leaving.is_set():
                        return  # the connection closes: the server aborts the generation
                    self.events.append(event)
        except BaseException as error:  # reported to the test, whatever it is
            self.error = error
        finally:
            self.done.set()

    def data(self) -> list[Any]:
        """Each event's data, JSON-decoded ("[DONE]" stays a string)."""
        return [e.data if e.data == "[DONE]" else json.loads(e.data) for e in self.events]

    def wait(self, timeout: float = 60.0) -> Stream:
        assert self.done.wait(timeout), f"the stream did not end within {timeout} s"
        return self

    def leave(self) -> Stream:
        """Hang up at the next event, as a client that gives up would."""
        self._leaving.set()
        return self.wait()


# How long the busy and fault checks wait for a real server that streams a long generation on
# a loaded 2-core machine (check_busy says what was measured); only a failing check waits it out.
BUSY_WAIT = 120.0


def wait_streaming(stream: Stream, count: int = 3, timeout: float = 30.0) -> None:
    """Until the stream has `count` events (its generation is running)."""
    wait_for(lambda: len(stream.events) >= count or stream.done.is_set(), timeout, "events")
    assert not stream.done.is_set(), f"the stream ended early: {stream.error!r}"


def wait_frozen(target: Target, timeout: float = 30.0) -> float:
    """Until two scrapes of the token counters 0.3 s apart agree; the frozen total."""
    last = target.tokens()

    def frozen() -> bool:
        nonlocal last
        time.sleep(0.3)  # the window in which a live engine would have made tokens
        now = target.tokens()
        same, last = now == last, now
        return same

    wait_for(frozen, timeout, "the token counters to stop")
    return last


def check_metrics_exposition(target: Target) -> None:
    """/metrics parses as Prometheus text with vLLM's names, types and labels."""
    families = {f.name: f for f in text_string_to_metric_families(target.get("/metrics").text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
    }
    for name, kind in expected.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, (name, families[name].type)
        (sample, *_) = families[name].samples
        assert sample.labels["model_name"] == target.model and sample.labels["engine"] == "0"
    counter = [s.name for s in families["vllm:generation_tokens"].samples]
    assert "vllm:generation_tokens_total" in counter


def check_chat_stream(target: Target) -> Stream:
    """SSE of chat.completion.chunk: role first, content deltas, a finish_reason, a usage
    chunk with no choices, then [DONE]; every frame `data: ...` and nothing after [DONE]."""
    body = long_request(target, max_tokens=5)
    stream = Stream(f"{target.url}/chat/completions", body).wait()
    assert stream.error is None, repr(stream.error)
    assert (stream.status, stream.content_type.split(";")[0]) == (200, "text/event-stream")
    data = stream.data()
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    chunks, usage = data[:-2], data[-2]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in data[:-1]}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert all(not e.event or e.event == "message" for e in stream.events)
    return stream


def check_completions_stream(target: Target) -> None:
    stream = Stream(f"{target.url}/completions", long_request(target, "/completions", max_tokens=4))
    data = stream.wait().data()
    assert stream.error is None and data[-1] == "[DONE]"
    assert {d["object"] for d in data[:-1]} == {"text_completion"}
    assert data[-2]["choices"] == [] and data[-2]["usage"]["completion_tokens"] == 4
    assert data[-3]["choices"][0]["finish_reason"] == "length"


def check_responses_stream(target: Target) -> None:
    """The Responses API stream as codex reads it: created, in_progress, the message item
    added, its text deltas, done events, and response.completed with usage; each event's
    `event:` names its data's type and sequence numbers count up from 0."""
    body = long_request(target, "/responses", max_output_tokens=6)
    stream = Stream(f"{target.url}/responses", body).wait()
    assert stream.error is None, repr(stream.error)
    data = stream.data()
    kinds = [d["type"] for d in data]
    assert [e.event for e in stream.events] == kinds
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[:3] == head and kinds[3] == "response.content_part.added"
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds[-4:] == tail
    deltas = [d["delta"] for d in data if d["type"] == "response.output_text.delta"]
    assert deltas and set(kinds[4:-4]) == {"response.output_text.delta"}
    final = data[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "".join(deltas)
    assert final["usage"]["output_tokens"] == 6
    assert data[0]["response"]["id"] == final["id"]


def check_engine_hang(target: Target) -> None:
    """The engine stops during a streamed generation: /health, /v1/models and /metrics keep
    answering 200, the token counters freeze while num_requests_running stays above 0, the
    stream just stops (no byte, no end, connection open) and a new generation gets no answer;
    after resume the stream goes on and, once its client leaves, a new generation completes
    (waiting out the rest of the long one took 115 s of the real engine here)."""
    stream = Stream(f"{target.url}/chat/completions", long_request(target))
    try:
        wait_streaming(stream, timeout=BUSY_WAIT)
        target.hang()
        try:
            frozen = wait_frozen(target)
            seen = len(stream.events)
            for path in ("/health", "/v1/models", "/metrics"):
                assert target.get(path).status_code == 200, path
            assert target.metrics()["vllm:num_requests_running"] >= 1
            with pytest.raises(httpx.ReadTimeout):
                target.generate(timeout=1.0, max_tokens=1)
            assert target.tokens() == frozen
            assert len(stream.events) == seen and not stream.done.is_set()
        finally:
            target.resume()  # a failed check leaves no frozen engine to the next one
        wait_for(lambda: len(stream.events) > seen, BUSY_WAIT, "the stream to go on")
        assert not stream.done.is_set(), f"the stream ended at resume: {stream.error!r}"
    finally:
        stream.leave()  # no generation left running for the next check to wait behind
    assert stream.error is None, repr(stream.error)
    assert target.generate(timeout=BUSY_WAIT, max_tokens=1).status_code == 200


def check_engine_death(target: Target) -> None:
    """The engine dies during a streamed generation: the stream gets vLLM's error frame then
    [DONE] (status 200 was sent already), a new generation answers 500 with EngineDeadError's
    message, the API server exits 0 and its log holds vLLM's death lines."""
    stream = Stream(f"{target.url}/chat/completions", long_request(target))
    wait_streaming(stream, timeout=BUSY_WAIT)
    target.kill()
    stream.wait()
    assert stream.error is None, repr(stream.error)
    *_, error, done = stream.data()
    assert done == "[DONE]"
    assert error["error"]["message"].startswith("EngineCore encountered an issue.")
    assert error["error"]["code"] == 500
    with contextlib.suppress(httpx.TransportError):  # or already gone: refused
        answer = target.generate()
        assert answer.status_code == 500
        assert "EngineCore encountered an issue" in answer.json()["error"]["message"]
    assert target.exit_code(30.0) == 0
    log = target.log()
    for line in (
        "MPClient: engine core exited unexpectedly",
        "AsyncLLM output_handler failed",
        "vllm.v1.engine.exceptions.EngineDeadError",
        "Shutting down",
    ):
        assert line in log, line


def check_busy(target: Target) -> None:
    """With max-num-seqs 1 and a long generation running, a second request waits: it shows in
    num_requests_waiting while the token counters keep moving. When the first one's client
    leaves, the generation is aborted and the second completes.

    The first asks for more tokens than the checks take to watch, however fast the engine (the
    real one did 2,000 tokens in 2 s on a quiet machine), and is ended by its client, also when
    the check fails (a generation left running made the next checks wait behind it, in CI).
    The waits are long: on a loaded 2-core machine the real API server, which streams the first
    generation, took 6-13 s to queue the second and up to 10 s per /metrics scrape (measured
    with two CPU hogs), and a failed check in CI had allowed 30 s."""
    busy = long_request(target, max_tokens=5 * target.long_tokens)
    first = Stream(f"{target.url}/chat/completions", busy)
    second: Stream | None = None
    try:
        wait_streaming(first, timeout=BUSY_WAIT)
        # The second hears nothing until the first is gone, and the checks below may take their
        # three waits in all on a slow machine (CI's took 295 s once; at a 120 s read timeout the
        # queued request gave up before the first was left).
        second = Stream(
            f"{target.url}/chat/completions",
            long_request(target, max_tokens=2),
            read_timeout=4 * BUSY_WAIT,
        )
        seen: dict[str, float] = {}

        def waiting() -> bool:
            seen.update(target.metrics())
            assert not first.done.is_set(), f"the long generation ended first: {first.error!r}"
            return seen["vllm:num_requests_waiting"] >= 1

        try:
            wait_for(waiting, BUSY_WAIT, "a waiting request")
        except AssertionError as error:
            running = seen.get("vllm:num_requests_running")
            raise AssertionError(
                f"{error}; last scrape: running {running}, waiting"
                f" {seen.get('vllm:num_requests_waiting')}; the first generation's events:"
                f" {len(first.events)}; the second's: {len(second.events)}, {second.error!r}"
            ) from None
        before = target.tokens()
        wait_for(lambda: target.tokens() > before, BUSY_WAIT, "the counters to move")
        assert not first.done.is_set(), (
            f"the long generation ended before the checks: {first.error}"
        )
        assert not second.done.is_set(), f"the queued request ended: {second.error!r}"
        assert first.leave().error is None
        assert second.wait(BUSY_WAIT).error is None and second.data()[-1] == "[DONE]"
    finally:
        for stream in (first, second):
            if stream is not None and not stream.done.is_set():
                stream.leave()
