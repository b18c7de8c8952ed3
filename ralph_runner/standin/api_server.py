"""vLLM's API server as the stand-in keeps it: the faults applied, the engine, its deaths as
vLLM's (the log lines, the exit), the stats log line, the state files tests and demos read."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NoReturn, NotRequired, TypedDict

from ralph_runner.standin.batching import DEFAULT_CURVE, BatchCurve, parse_curve
from ralph_runner.standin.engine import BLOCK_TOKENS, Engine, Stats, tokens_of
from ralph_runner.standin.faults import Faults, FaultSettings, parse_faults
from ralph_runner.standin.rot import Rot, RotSettings, oom_kill
from ralph_runner.standin.vllm_log import ENGINE_DEAD, VllmLog

DEFAULT_DEATH_BLOCKS = 25  # the seed's death: num_required_blocks 25 < len(req_blocks) 26
DEFAULT_TOKENS_PER_SECOND = 1000.0
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default
DEFAULT_EXECUTE_MODEL_TIMEOUT = 300.0  # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
DEFAULT_SHUTDOWN_DELAY = 0.3  # measured: /health answers ~0.3 s after EngineCore was killed


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
    batch_curve: BatchCurve | None = None  # a GPU's step time by batch (batching.py)
    faults: FaultSettings | None = None  # set at every start (`--faults`): a server born broken
    rot: RotSettings = field(default_factory=RotSettings)  # how it degrades (rot.py)


class StandInServer(ThreadingHTTPServer):
    """The HTTP server plus the API server's state: faults, engine, log and state files.
    `handler` answers its requests (handler.Handler)."""

    daemon_threads = True  # hung requests must never keep the process alive
    # uvicorn's (vLLM's) listen backlog: socketserver's 5 reset a burst of 16 connections at once
    request_queue_size = 2048

    def __init__(
        self, options: Options, log: VllmLog, handler: type[BaseHTTPRequestHandler]
    ) -> None:
        super().__init__(("127.0.0.1", options.port), handler)
        self.port = self.server_address[1]
        self.options = options
        self.state_dir = options.state_dir
        self.model = options.model
        self.log = log
        self.lock = threading.Lock()
        self.faults = Faults()
        self.engine = Engine(options.tokens_per_second, options.max_num_seqs)
        self.engine.batch_curve = options.batch_curve
        self.rot = Rot(options.rot, options.tokens_per_second)
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
        if options.faults:
            self.apply(options.faults)

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        """One log line, not a traceback, for a client that went away mid-answer."""
        host, port = client_address[:2]
        self.log.record("WARNING", "standin.py:1", f"{host}:{port}: {sys.exception()!r}")

    # faults

    def apply(self, faults: FaultSettings) -> None:
        with self.lock:
            f = self.faults
            f.die_now = faults.get("die", f.die_now)
            f.die_countdown = faults.get("die_at_request", f.die_countdown)
            f.die_on_prompt_chars = faults.get("die_on_prompt_chars", f.die_on_prompt_chars)
            f.generations_to_death = faults.get("die_at_generation", f.generations_to_death)
            f.slow_once = faults.get("slow_once", f.slow_once)
            if "rate_limit" in faults:
                f.rate_limited_until = time.monotonic() + (faults["rate_limit"] or 0.0)
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
            self.rot.base = faults["tokens_per_second"]  # decode_halflife halves it from now
            self.engine.set_rate(faults["tokens_per_second"])
        if "batch_curve" in faults:
            curve = faults["batch_curve"]  # true: the shipped curve; false: off
            curve = DEFAULT_CURVE if curve is True else curve
            self.engine.batch_curve = parse_curve(curve) if curve else None
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
        """die_on_prompt_chars: this prompt is the one the KV-cache manager cannot place;
        die_at_generation: this generation is the one that kills the engine, whatever its
        prompt."""
        with self.lock:
            f = self.faults
            counted = f.generations_to_death > 0
            if counted:
                f.generations_to_death -= 1
            due = counted and f.generations_to_death == 0
        if due:
            self.kill_engine("die_at_generation", self.log.engine_core_exited)
            return True
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

    def rate_limited(self) -> float:
        """Seconds the `rate_limit` fault has left (0: none)."""
        with self.lock:
            return max(0.0, self.faults.rate_limited_until - time.monotonic())

    def take_slow_once(self) -> float:
        with self.lock:
            delay, self.faults.slow_once = self.faults.slow_once, 0.0
        return delay

    def rotted(self) -> None:
        """One generation's share of the rot (rot.py): its leak, its preemptions, and the
        OOM killer once resident memory passes the limit."""
        self.rot.leak()
        if self.options.rot.preemptions_per_request:
            self.engine.preempt(self.options.rot.preemptions_per_request)
        self.check_memory()

    def check_memory(self) -> None:
        mib = self.rot.over_limit()
        if mib is not None:
            limit = self.options.rot.memory_limit_mb
            message = f"Out of memory: killed process {self.log.pid} ({mib} MiB > {limit:g})"
            self.log.record("ERROR", "oom", message)
            oom_kill()

    def age_decode(self) -> None:
        """decode_halflife: the engine's speed for the server's age."""
        rate = self.rot.decode_rate()
        if rate is not None:
            self.engine.set_rate(rate)

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
        marker = ExitMarker(pid=self.log.pid, code=code, reason=reason, time=time.time())
        write_exit_marker(self.state_dir, marker)
        (self.state_dir / "server.pid").unlink(missing_ok=True)

    def release(self) -> None:
        """At shutdown: requests held by `hang` end (their connections close unanswered)."""
        with self.released:
            self.closing = True
            self.released.notify_all()

    def tick(self, seconds: float) -> None:
        """A look at the control file and, like vLLM's `loggers.py`, a stats line unless the
        engine was idle for two ticks (vLLM logs those at debug level: a hung engine goes
        quiet)."""
        self.poll_control_file()
        self.age_decode()
        self.check_memory()
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


class ExitMarker(TypedDict):
    """STATE_DIR/exit.json: how the last server of that directory ended."""

    pid: int
    code: int  # its exit code
    reason: str
    time: NotRequired[float]  # when (not when it could not start)


def write_exit_marker(state_dir: Path, marker: ExitMarker) -> None:
    """Writes exit.json atomically, so a reader never sees half a file."""
    path = state_dir / "exit.json"
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(marker) + "\n", encoding="utf-8")
    partial.replace(path)
