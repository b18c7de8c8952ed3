"""A stand-in for vLLM's OpenAI-compatible server that fails the ways vLLM fails, on cue.

ralph-run exists because vLLM's engine dies mid-run (and its API server then exits 0) or hangs
(and its API server keeps answering). The demo and the tests need a server that fails the same
ways, on demand, whose wire formats real agents read (SSE streams, tool calls, the Responses
API), and whose log and /metrics read like vLLM's (0.32, measured: issue 9's table).

The engine (engine.py) generates tokens at `--tokens-per-second` per sequence, runs at most
`--max-num-seqs` sequences (the others wait), and publishes its statistics at each step.

FAULTS (set at any time, without restarting, through `POST /admin/fail` or the control file
`STATE_DIR/control.json`, read, applied and removed on every request and every stats tick;
both take `{KEY: VALUE, ...}`, `/admin/fail` also `{"mode": KEY, "value": V}`; a fault lasts
until the process ends or it is set to false; a restarted server starts healthy):

key (value)            imitates (vLLM 0.32)     what the stand-in does
---------------------- ------------------------ ----------------------------------------------------
engine_death           kill -9 of               logs MPClient `engine core exited unexpectedly`,
                       VLLM::EngineCore         `AsyncLLM output_handler failed`, EngineDeadError;
                                                generation (in flight too) answers 500 `{"error":
                                                {"message": "EngineCore encountered an issue. See
                                                stack trace (above) for the root cause.", ...}}`; a
                                                chat/completions stream in flight gets that error as
                                                a data frame, then `data: [DONE]`; a responses
                                                stream is cut (no last chunk); /health, /v1/models
                                                and /metrics answer 200 for --shutdown-delay (0.3
                                                s), then `Shutting down`, exit 0
die_on_prompt_chars N  the seed's KV-cache      a generation whose prompt has more than N
                       AssertionError           characters: AssertionError lines, then as
                                                engine_death
engine_hang            SIGSTOP of               /health, /v1/models, /metrics 200; gauges keep their
                       VLLM::EngineCore (vLLM   last values, counters freeze; generation blocks for
                       #39863)                  ever, streams in flight just stop (connection open);
                                                nothing logged
worker_timeout [S]     SIGSTOP of VLLM::Worker  as engine_hang; after S s (true: --execute-model-
                                                timeout, 300) `TimeoutError: RPC call to
                                                execute_model timed out.`, then as engine_death
resume                 SIGCONT                  the hang ends: what waited goes on at once
busy N                 load, not a fault        every generation makes at least N tokens (as a
                                                request's `ignore_eos` or `min_tokens`): with --max-
                                                num-seqs and --tokens-per-second, a full batch, a
                                                waiting line, counters moving
tokens_per_second R    a slower or faster       R tokens/s per sequence from now
                       engine
prefill_tokens_per_    a long prompt read in    prompts are prefilled at R tokens/s from now (false:
second R               chunks                   at once): the KV-cache gauge grows each step, no
                                                token counter moves until the prompt is read
prefill_chunk N        vLLM's chunked prefill   with prefill_tokens_per_second: a step reads N
                       (--max-num-batched-      prompt tokens and lasts N / R s; its gauges and
                       tokens)                  counters are published when it ends (a long first
                                                step looks idle), as vLLM's
sleep                  POST /sleep (sleep mode) vllm:engine_sleep_state 1, generation waits (as
                                                engine_hang) until `sleep: false`
die                    (the stand-in's first    the request answers 500, exit 0 at once
                       death)
die_at_request N       (as die)                 on the N-th API request from now (admin requests do
                                                not count)
hang                   a wedged API server      every endpoint, /health too, never answers (until
                                                resume)
dead_503               a dead engine behind an  every API route answers 503, the process stays up
                       API server that stays up
slow_once S            one slow answer          the next API request answers after S s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from ralph_runner.standin import scripted
from ralph_runner.standin.engine import (
    BLOCK_TOKENS,
    KV_CACHE_TOKENS,
    Engine,
    EngineDead,
    Sequence,
    Stats,
    plan_of,
    tokens_of,
)
from ralph_runner.standin.vllm_log import ENGINE_DEAD, VllmLog
from ralph_runner.standin.wire import FORMATS, Format, Responses, error_body

DEFAULT_DEATH_BLOCKS = 25  # the seed's death: num_required_blocks 25 < len(req_blocks) 26
DEFAULT_TOKENS_PER_SECOND = 1000.0
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default
DEFAULT_EXECUTE_MODEL_TIMEOUT = 300.0  # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
DEFAULT_SHUTDOWN_DELAY = 0.3  # measured: /health answers ~0.3 s after EngineCore was killed
COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions; chat has none

FAULTS: dict[str, tuple[type, str]] = {  # key -> (value type, one line; the table above says more)
    "engine_death": (bool, "EngineCore dies: 500s, /health 200 for a moment, exit 0"),
    "die_on_prompt_chars": (int, "a generation with a prompt over N characters kills the engine"),
    "engine_hang": (bool, "EngineCore stops: health/models/metrics 200, generation blocks"),
    "worker_timeout": (float, "a hang that kills the engine after S s (true: the option)"),
    "resume": (bool, "the hang ends: what waited goes on"),
    "busy": (int, "every generation makes at least N tokens"),
    "tokens_per_second": (float, "the engine's speed from now, per sequence"),
    "prefill_tokens_per_second": (float, "prompts are read in chunks at R tokens/s"),
    "prefill_chunk": (int, "a step reads N prompt tokens, N / R s long, published at its end"),
    "sleep": (bool, "the engine sleeps (sleep mode): engine_sleep_state 1, nothing served"),
    "die": (bool, "die at once: the request answers 500, the process exits 0"),
    "die_at_request": (int, "as die, on the N-th API request from now"),
    "hang": (bool, "accept connections but never answer an API request, /health included"),
    "dead_503": (bool, "the engine is dead: every API route answers 503, the process stays up"),
    "slow_once": (float, "the next API request answers after this many seconds"),
}


def parse_faults(settings: Any) -> dict[str, Any]:
    """Checks and converts a fault dict; raises ValueError naming what is wrong."""
    if not isinstance(settings, dict):
        raise ValueError("expected a JSON object")
    if "mode" in settings:
        settings = {settings["mode"]: settings.get("value", True)}
    unknown = sorted(set(settings) - set(FAULTS))
    if unknown:
        raise ValueError(
            f"unknown fault {', '.join(map(str, unknown))}; known: {', '.join(FAULTS)}"
        )
    try:
        return {key: convert(key, value) for key, value in settings.items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"bad fault value: {error}") from None


def convert(key: str, value: Any) -> Any:
    kind = FAULTS[key][0]
    if kind is bool or isinstance(value, bool):  # worker_timeout: true -> the option's seconds
        return bool(value)
    return kind(value)


def text_of(content: Any) -> str:
    """The text of an OpenAI content: a string or a list of parts with `text` (or `output`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            text_of(p.get("text", p.get("output", ""))) for p in content if isinstance(p, dict)
        )
    return ""


def prompt_chars_of(route: str, request: dict[str, Any]) -> int:
    """Prompt size of a generation request: the characters of what the model reads."""
    if route == "/v1/chat/completions":
        messages = request.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(len(text_of(m.get("content"))) for m in messages if isinstance(m, dict))
    if route == "/v1/completions":
        return len(text_of(request.get("prompt", "")))
    items = request.get("input", "")
    if isinstance(items, list):  # responses: messages, function calls and their outputs
        parts = [i.get("content", i.get("output", i.get("arguments", ""))) for i in items]
        items = [{"text": text_of(p)} for p in parts if isinstance(p, str | list)]
    return len(text_of(request.get("instructions") or "")) + len(text_of(items))


def max_tokens_of(route: str, request: dict[str, Any], prompt_tokens: int) -> int:
    keys = {
        "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
        "/v1/completions": ("max_tokens",),
        "/v1/responses": ("max_output_tokens",),
    }[route]
    for key in keys:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if route == "/v1/completions":
        return COMPLETIONS_MAX_TOKENS
    return max(1, KV_CACHE_TOKENS - prompt_tokens)


def min_tokens_of(request: dict[str, Any], max_tokens: int) -> int:
    """vLLM's sampling extras: `ignore_eos` generates max_tokens, `min_tokens` at least that."""
    if request.get("ignore_eos") is True:
        return max_tokens
    value = request.get("min_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
METRICS: list[tuple[str, str, str, Callable[[Stats], list[tuple[dict[str, str], float]]]]] = [
    # name (a counter's exposed name gets _total), type, vLLM's help text, its samples' labels
    (
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        lambda s: [({}, s.running)],
    ),
    (
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        lambda s: [({}, s.waiting)],
    ),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        lambda s: [({}, s.kv_cache_usage)],
    ),
    (
        "vllm:num_preemptions",
        "counter",
        "Cumulative number of preemption from the engine.",
        lambda s: [({}, s.preemptions)],
    ),
    (
        "vllm:prompt_tokens",
        "counter",
        "Number of prefill tokens processed.",
        lambda s: [({}, s.prompt_tokens)],
    ),
    (
        "vllm:generation_tokens",
        "counter",
        "Number of generation tokens processed.",
        lambda s: [({}, s.generation_tokens)],
    ),
    (
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        lambda s: [({"finished_reason": r}, s.finished[r]) for r in FINISH_REASONS],
    ),
]

METRICS += [  # the rest of vLLM 0.32's engine series (issue 19's list), at their values here
    (
        "vllm:engine_sleep_state",
        "gauge",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        lambda s: [
            ({"sleep_state": "awake"}, 0.0 if s.sleeping else 1.0),
            ({"sleep_state": "weights_offloaded"}, 1.0 if s.sleeping else 0.0),
            ({"sleep_state": "discard_all"}, 0.0),
        ],
    ),
    (
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of requests waiting, by the reason they wait.",
        lambda s: [({"reason": "capacity"}, s.waiting), ({"reason": "deferred"}, 0.0)],
    ),
    (
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        lambda s: [({}, s.prefix_queries)],
    ),
    (
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        lambda s: [({}, 0.0)],
    ),
    (
        "vllm:admission_rejections",
        "counter",
        "Requests rejected at admission.",
        lambda s: [({}, 0.0)],
    ),
    (
        "vllm:estimated_flops_per_gpu",
        "counter",
        "Estimated floating point operations per GPU (0 on CPU).",
        lambda s: [({}, 0.0)],
    ),
]
HISTOGRAMS: list[tuple[str, str, Callable[[Stats], tuple[float, float]]]] = [
    # name, help, (count, sum): exposed with a +Inf bucket only, enough for rate() and probes
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     lambda s: (s.steps, s.step_tokens)),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
     lambda s: (sum(s.finished.values()), s.prompt_tokens)),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     lambda s: (sum(s.finished.values()), 0.0)),
]  # fmt: skip


ROUTES = {  # path -> (method, Handler method)
    "/health": ("GET", "health"),
    "/v1/models": ("GET", "models"),
    "/metrics": ("GET", "metrics"),
    "/v1/chat/completions": ("POST", "generation"),
    "/v1/completions": ("POST", "generation"),
    "/v1/responses": ("POST", "generation"),
}


@dataclass
class Faults:
    """The API server's own faults (the engine's are in the engine); changed under a lock."""

    die_now: bool = False
    die_countdown: int = 0  # 0 = off
    die_on_prompt_chars: int = 0  # 0 = off
    hang: bool = False
    dead: bool = False
    slow_once: float = 0.0
    busy: int = 0


@dataclass
class Options:
    port: int
    state_dir: Path
    model: str
    log: Path
    stats_interval: float = 1.0
    tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    execute_model_timeout: float = DEFAULT_EXECUTE_MODEL_TIMEOUT
    shutdown_delay: float = DEFAULT_SHUTDOWN_DELAY
    script: Path | None = None


class StandInServer(ThreadingHTTPServer):
    """The HTTP server plus the API server's state: faults, engine, log and state files."""

    daemon_threads = True  # hung requests must never keep the process alive

    def __init__(self, options: Options, log: VllmLog) -> None:
        super().__init__(("127.0.0.1", options.port), Handler)
        self.port = self.server_address[1]
        self.options = options
        self.state_dir = options.state_dir
        self.model = options.model
        self.log = log
        self.lock = threading.Lock()
        self.faults = Faults()
        self.engine = Engine(options.tokens_per_second, options.max_num_seqs)
        self.last_prompt_tokens = 0
        self.released = threading.Condition()  # hung requests wait here (`hang`)
        self.closing = False
        self.engine_dead = False
        self._logged_stats = Stats()
        self._last_throughputs = (0.0, 0.0)
        self.started = time.time()
        self._worker_timer: threading.Timer | None = None
        self._dying = threading.Lock()
        self._control_lock = threading.Lock()

    def handle_error(self, request: Any, client_address: tuple[str, int]) -> None:
        """One log line, not a traceback, for a client that went away mid-answer."""
        host, port = client_address[:2]
        self.log.record("WARNING", "standin.py:1", f"{host}:{port}: {sys.exception()!r}")

    # faults

    def apply(self, faults: dict[str, Any]) -> None:
        with self.lock:
            f = self.faults
            f.die_now = faults.get("die", f.die_now)
            f.die_countdown = faults.get("die_at_request", f.die_countdown)
            f.die_on_prompt_chars = faults.get("die_on_prompt_chars", f.die_on_prompt_chars)
            f.slow_once = faults.get("slow_once", f.slow_once)
            f.busy = faults.get("busy", f.busy)
            legacy_dies = faults.get("dead_503", False) and not f.dead
            f.dead = faults.get("dead_503", f.dead)
        if "hang" in faults:
            with self.released:
                self.faults.hang = faults["hang"]
                self.released.notify_all()
        if legacy_dies:
            self.log.legacy_death(self.death_blocks())
        if "tokens_per_second" in faults:
            self.engine.set_rate(faults["tokens_per_second"])
        if "prefill_tokens_per_second" in faults:
            self.engine.prefill_rate = faults["prefill_tokens_per_second"] or None
        if "prefill_chunk" in faults:
            self.engine.prefill_chunk = faults["prefill_chunk"] or None
        if "sleep" in faults:
            self.engine.sleep(faults["sleep"])
        if faults.get("engine_hang") or faults.get("worker_timeout") is not None:
            self.hang_engine(faults.get("worker_timeout"))
        ended = faults.get("engine_hang") is False or faults.get("worker_timeout") is False
        if faults.get("resume") or ended:
            self.resume()
        if faults.get("engine_death"):
            self.kill_engine("engine_death", self.log.engine_core_exited)

    def hang_engine(self, worker_timeout: float | bool | None) -> None:
        """EngineCore (or a Worker: then EngineCore gives up after the RPC timeout) stops."""
        if worker_timeout is False:
            return
        self.engine.hang()
        if worker_timeout is None:
            return
        seconds = self.options.execute_model_timeout if worker_timeout is True else worker_timeout
        self._cancel_worker_timer()
        self._worker_timer = threading.Timer(seconds, self.worker_timed_out)
        self._worker_timer.daemon = True
        self._worker_timer.start()

    def _cancel_worker_timer(self) -> None:
        if self._worker_timer is not None:
            self._worker_timer.cancel()
            self._worker_timer = None

    def worker_timed_out(self) -> None:
        self.kill_engine(
            "worker_timeout", self.log.execute_model_timeout, self.log.engine_core_exited
        )

    def resume(self) -> None:
        self._cancel_worker_timer()
        with self.released:
            self.faults.hang = False
            self.released.notify_all()
        self.engine.resume()

    def poll_control_file(self) -> None:
        """Applies and removes STATE_DIR/control.json, once, even with requests racing for it."""
        path = self.state_dir / "control.json"
        with self._control_lock:
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                return
            if not text.strip():
                return  # a shell's `>` has created it but not written it yet
            path.unlink(missing_ok=True)
        try:
            self.apply(parse_faults(json.loads(text)))
        except ValueError as error:  # JSONDecodeError is one
            self.log.record("WARNING", "standin.py:1", f"ignored {path.name}: {error}")

    def death_due(self) -> str | None:
        """Counts this API request against the legacy faults; the reason to die now, or None."""
        with self.lock:
            f = self.faults
            if f.die_now:
                return "die"
            if f.die_countdown:
                f.die_countdown -= 1
                if not f.die_countdown:
                    return "die_at_request"
        return None

    def prompt_kills(self, prompt_chars: int) -> bool:
        """die_on_prompt_chars: this prompt is the one the KV-cache manager cannot place."""
        limit = self.faults.die_on_prompt_chars
        if not limit or prompt_chars <= limit:
            return False
        self.last_prompt_tokens = tokens_of(prompt_chars)
        blocks = self.death_blocks()
        self.kill_engine(
            f"die_on_prompt_chars ({prompt_chars} > {limit})",
            lambda: self.log.kv_cache_assertion(blocks),
            self.log.engine_core_exited,
        )
        return True

    def take_slow_once(self) -> float:
        with self.lock:
            delay, self.faults.slow_once = self.faults.slow_once, 0.0
        return delay

    def death_blocks(self) -> int:
        tokens = self.last_prompt_tokens
        return math.ceil(tokens / BLOCK_TOKENS) if tokens else DEFAULT_DEATH_BLOCKS

    def kill_engine(self, reason: str, *log_lines: Callable[[], None]) -> None:
        """The engine dies as vLLM's does: its lines logged, every generation (in flight too)
        failed with EngineDeadError, then after `--shutdown-delay` the API server shuts down
        and the process exits 0."""
        with self.lock:
            if self.engine_dead:
                return
            self.engine_dead = True
        self._cancel_worker_timer()
        for write in log_lines:
            write()
        self.engine.die(ENGINE_DEAD)
        timer = threading.Timer(self.options.shutdown_delay, self.die_quietly, args=(reason,))
        timer.daemon = True
        timer.start()

    def die_quietly(self, reason: str) -> NoReturn:
        """The API server's end after its engine died: uvicorn's shutdown lines, exit 0."""
        self._dying.acquire()
        self.log.shutdown()
        self.finish(code=0, reason=f"engine dead: {reason}")
        os._exit(0)

    def die(self, reason: str) -> NoReturn:
        """The legacy death: error lines, shutdown lines, exit code 0, all at once."""
        self._dying.acquire()  # a second death waits here until the process is gone
        self.log.legacy_death(self.death_blocks())
        self.log.shutdown()
        self.finish(code=0, reason=f"engine dead: {reason}")
        os._exit(0)

    def finish(self, code: int, reason: str) -> None:
        """Leaves the exit marker tests and demos read, and removes the pid file."""
        marker = {"pid": self.log.pid, "code": code, "reason": reason, "time": time.time()}
        write_json(self.state_dir / "exit.json", marker)
        (self.state_dir / "server.pid").unlink(missing_ok=True)

    def release(self) -> None:
        """At shutdown: requests held by `hang` end (their connections close unanswered)."""
        with self.released:
            self.closing = True
            self.released.notify_all()

    # statistics

    def metrics(self) -> str:
        """Prometheus text as vLLM 0.32's /metrics (prometheus_client's exposition) of the
        engine's last published statistics: a hung engine shows its last gauges and frozen
        counters. A counter's creation times follow it as a gauge family of their own."""
        stats = self.engine.stats
        lines: list[str] = []
        for name, kind, help_text, value_of in METRICS:
            samples = [(self.labels(extra), value) for extra, value in value_of(stats)]
            exposed = f"{name}_total" if kind == "counter" else name
            lines += [f"# HELP {exposed} {help_text}", f"# TYPE {exposed} {kind}"]
            lines += [f"{exposed}{{{labels}}} {float(value)}" for labels, value in samples]
            if kind == "counter":
                created = f"{name}_created"
                lines += [f"# HELP {created} {help_text}", f"# TYPE {created} gauge"]
                started = go_float(self.started)
                lines += [f"{created}{{{labels}}} {started}" for labels, _ in samples]
        labels = self.labels({})
        for name, help_text, count_sum in HISTOGRAMS:
            count, total = count_sum(stats)
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            lines += [f'{name}_bucket{{le="+Inf",{labels}}} {float(count)}']
            lines += [f"{name}_count{{{labels}}} {float(count)}", f"{name}_sum{{{labels}}} {total}"]
        lines += [
            "# HELP process_start_time_seconds Start time of the process since unix epoch.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.started:.2f}",
        ]
        return "\n".join(lines) + "\n"

    def labels(self, extra: dict[str, str]) -> str:
        """A sample's labels, sorted by name as vLLM's multiprocess exposition writes them."""
        labels = {"engine": "0", "model_name": self.model, **extra}
        return ",".join(f'{key}="{labels[key]}"' for key in sorted(labels))

    def tick(self, seconds: float) -> None:
        """A look at the control file and, like vLLM's `loggers.py`, a stats line unless the
        engine was idle for two ticks (vLLM logs those at debug level: a hung engine goes
        quiet)."""
        self.poll_control_file()
        stats, last = self.engine.stats, self._logged_stats
        self._logged_stats = stats
        prompt = (stats.prompt_tokens - last.prompt_tokens) / seconds
        generation = (stats.generation_tokens - last.generation_tokens) / seconds
        throughputs = (prompt, generation, *self._last_throughputs)
        self._last_throughputs = (prompt, generation)
        if any(throughputs):
            self.log.record(
                "INFO",
                "loggers.py:326",
                f"Engine 000: Avg prompt throughput: {prompt:.1f} tokens/s, "
                f"Avg generation throughput: {generation:.1f} tokens/s, "
                f"Running: {stats.running} reqs, Waiting: {stats.waiting} reqs, "
                f"GPU KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
                "Prefix cache hit rate: 0.0%",
            )
        if self.faults.die_now:
            self.die("die")


class Handler(BaseHTTPRequestHandler):
    """Routes vLLM's API and the admin endpoint, applying the faults to every API request."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn: probes reuse one connection
    disable_nagle_algorithm = True  # TCP_NODELAY, as uvicorn: no 40 ms delayed-ACK stall
    server: StandInServer

    def version_string(self) -> str:
        return "uvicorn"

    def do_GET(self) -> None:
        self.answer()

    def do_POST(self) -> None:
        self.answer()

    def answer(self) -> None:
        srv = self.server
        self.route = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        try:
            self.request_json = json.loads(self.rfile.read(length)) if length else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.request_json = None
        if self.route == "/admin/fail":
            self.admin()
            return
        srv.poll_control_file()
        death = srv.death_due()
        if death:
            self.send_error_json(
                HTTPStatus.INTERNAL_SERVER_ERROR, ENGINE_DEAD, "InternalServerError"
            )
            srv.die(death)
        if not self.wait_unless_hung():
            self.close_connection = True
            return
        delay = srv.take_slow_once()
        if delay:
            time.sleep(delay)
        if srv.faults.dead:
            self.send_error_json(HTTPStatus.SERVICE_UNAVAILABLE, ENGINE_DEAD, "EngineDeadError")
        else:
            self.dispatch()

    def wait_unless_hung(self) -> bool:
        """`hang`: holds the request until resumed (True) or the server shuts down (False)."""
        srv = self.server
        with srv.released:
            while srv.faults.hang and not srv.closing:
                srv.released.wait()
            return not srv.closing

    def dispatch(self) -> None:
        if self.route not in ROUTES:
            self.send_json(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
            return
        method, handler = ROUTES[self.route]
        if method != self.command:
            self.send_json(HTTPStatus.METHOD_NOT_ALLOWED, {"detail": "Method Not Allowed"})
            return
        getattr(self, handler)()

    def health(self) -> None:
        self.send_body(HTTPStatus.OK, b"", "text/plain")

    def metrics(self) -> None:
        text = self.server.metrics().encode()
        self.send_body(HTTPStatus.OK, text, "text/plain; version=0.0.4; charset=utf-8")

    def models(self) -> None:
        model = self.server.model
        card = {
            "id": model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": KV_CACHE_TOKENS,
        }
        self.send_json(HTTPStatus.OK, {"object": "list", "data": [card]})

    # generation

    def generation(self) -> None:
        srv, request = self.server, self.request_json
        if not isinstance(request, dict):
            self.send_error_json(
                HTTPStatus.BAD_REQUEST, "body is not a JSON object", "BadRequestError"
            )
            return
        model = request.get("model") or srv.model
        if model != srv.model:
            message = f"The model `{model}` does not exist."
            self.send_error_json(HTTPStatus.NOT_FOUND, message, "NotFoundError")
            return
        prompt_chars = prompt_chars_of(self.route, request)
        if srv.prompt_kills(prompt_chars) or srv.engine_dead:
            self.send_error_json(
                HTTPStatus.INTERNAL_SERVER_ERROR, ENGINE_DEAD, "InternalServerError"
            )
            return
        answer = FORMATS[self.route](model, request, tokens_of(prompt_chars))
        reply = scripted.reply_for(answer.api, request, srv.options.script)
        max_tokens = max_tokens_of(self.route, request, answer.prompt_tokens)
        at_least = max(min_tokens_of(request, max_tokens), srv.faults.busy)
        plan, finish_reason = plan_of(reply, max_tokens, at_least)
        sequence = Sequence(answer.prompt_tokens, plan, finish_reason)
        srv.last_prompt_tokens = answer.prompt_tokens
        try:
            srv.engine.submit(sequence)
        except EngineDead:
            self.send_error_json(
                HTTPStatus.INTERNAL_SERVER_ERROR, ENGINE_DEAD, "InternalServerError"
            )
            return
        if request.get("stream") is True:
            self.stream(answer, sequence)
        else:
            self.whole(answer, sequence)

    def whole(self, answer: Format, sequence: Sequence) -> None:
        """Waits for the whole generation (for ever if the engine hangs), then one body."""
        try:
            pieces = self.server.engine.collect(sequence)
        except EngineDead:
            self.send_error_json(
                HTTPStatus.INTERNAL_SERVER_ERROR, ENGINE_DEAD, "InternalServerError"
            )
            return
        self.send_json(HTTPStatus.OK, answer.body(pieces, sequence.finish_reason))

    def stream(self, answer: Format, sequence: Sequence) -> None:
        """Server-sent events, chunked as uvicorn sends a StreamingResponse: each batch of
        new tokens is written (and flushed) as soon as the engine has made it."""
        engine = self.server.engine
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        seen = 0
        try:
            self.send_frames(answer.stream_open())
            while True:
                try:
                    pieces, done = engine.progress(sequence, seen)
                except EngineDead:
                    break
                seen += len(pieces)
                self.send_frames(answer.stream_pieces(pieces))
                if done:
                    self.send_frames(answer.stream_close(sequence.finish_reason))
                    self.end_chunks()
                    return
            if isinstance(answer, Responses):  # vLLM: the exception escapes the stream
                self.drop_connection()
                return
            self.server.log.stream_failed(answer.api)
            self.send_frames(answer.stream_error(ENGINE_DEAD))
            self.end_chunks()
        except OSError:  # the client went away: vLLM aborts the request
            engine.abort(sequence)
            self.close_connection = True

    def send_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame))
        self.wfile.flush()

    def end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def drop_connection(self) -> None:
        """The stream ends without its last chunk, as uvicorn leaves a failed StreamingResponse."""
        self.close_connection = True
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)

    def admin(self) -> None:
        try:
            faults = parse_faults(self.request_json)
        except ValueError as error:
            self.send_json(HTTPStatus.BAD_REQUEST, {"error": str(error)})
            return
        self.server.apply(faults)
        self.send_json(HTTPStatus.OK, {"applied": faults})
        if self.server.faults.die_now:
            self.server.die("die")

    def send_error_json(self, status: HTTPStatus, message: str, kind: str) -> None:
        """vLLM's error body: `{"error": {"message", "type", "param", "code"}}`."""
        self.send_json(status, error_body(message, kind, status.value))

    def send_json(self, status: HTTPStatus, payload: Any) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json")

    def send_body(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """uvicorn's access line: `127.0.0.1:PORT - "GET /v1/models HTTP/1.1" 200 OK`."""
        status = HTTPStatus(int(code))
        host, port = self.client_address[:2]
        self.server.log.uvicorn(
            f'{host}:{port} - "{self.requestline}" {status.value} {status.phrase}'
        )

    def log_message(self, format: str, *args: Any) -> None:
        self.server.log.record("WARNING", "http.py:1", format % args)


def go_float(value: float) -> str:
    """A float as prometheus_client writes a large one: `1.7961118358359013e+09`."""
    text = repr(value)
    dot = text.find(".")
    if dot <= 6:
        return text
    return f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0") + f"e+0{dot - 1}"


def write_json(path: Path, payload: Any) -> None:
    """Writes atomically, so a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(payload) + "\n", encoding="utf-8")
    partial.replace(path)


def serve(options: Options) -> int:
    state_dir = options.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    options.log.parent.mkdir(parents=True, exist_ok=True)
    (state_dir / "exit.json").unlink(missing_ok=True)
    log = VllmLog(options.log, os.getpid())
    try:
        server = StandInServer(options, log)
    except OSError as error:
        log.record(
            "ERROR",
            "api_server.py:1830",
            f"[Errno {error.errno}] {error.strerror}: port {options.port}",
        )
        write_json(state_dir / "exit.json", {"pid": log.pid, "code": 1, "reason": str(error)})
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    (state_dir / "server.pid").write_text(f"{log.pid}\n", encoding="utf-8")
    log.startup(options.model, server.port, KV_CACHE_TOKENS, options.max_num_seqs)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    while not stop.wait(options.stats_interval):
        server.tick(options.stats_interval)
    log.shutdown()
    server.release()
    server.shutdown()
    server.server_close()
    server.finish(code=0, reason="SIGTERM")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--model", default="stand-in")
    parser.add_argument("--log", type=Path, help="default: STATE_DIR/server.log")
    parser.add_argument(
        "--stats-interval", type=float, default=1.0, help="seconds between stats lines"
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=DEFAULT_TOKENS_PER_SECOND,
        help=f"generation speed per sequence (default {DEFAULT_TOKENS_PER_SECOND:g})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"sequences generated at once; the others wait (default {DEFAULT_MAX_NUM_SEQS})",
    )
    parser.add_argument(
        "--execute-model-timeout",
        type=float,
        default=DEFAULT_EXECUTE_MODEL_TIMEOUT,
        help="seconds before worker_timeout kills the engine (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)",
    )
    parser.add_argument(
        "--shutdown-delay",
        type=float,
        default=DEFAULT_SHUTDOWN_DELAY,
        help="seconds the API server answers after its engine died, before it exits 0",
    )
    parser.add_argument(
        "--script", type=Path, help="what the scripted model answers (see scripted.py)"
    )
    args = parser.parse_args(argv)
    options = Options(
        port=args.port,
        state_dir=args.state_dir,
        model=args.model,
        log=args.log or args.state_dir / "server.log",
        stats_interval=args.stats_interval,
        tokens_per_second=args.tokens_per_second,
        max_num_seqs=args.max_num_seqs,
        execute_model_timeout=args.execute_model_timeout,
        shutdown_delay=args.shutdown_delay,
        script=args.script,
    )
    return serve(options)


if __name__ == "__main__":
    raise SystemExit(main())
