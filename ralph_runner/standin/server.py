"""A stand-in for vLLM's OpenAI-compatible server that can die, hang or turn 503 on cue.

ralph-run exists because vLLM's engine dies mid-run (and its API server then exits 0). The demo
and the tests need a server that fails the same ways, on demand, and whose log reads like vLLM's,
so that the diagnostics captured at the moment of death look like the real thing.

Faults are set at any time, without restarting, through `POST /admin/fail` or the control file
`STATE_DIR/control.json` (read, applied and removed on every request and every stats tick).
Both take the same keys (see `FAULTS`); `/admin/fail` also takes `{"mode": KEY, "value": V}`.
A fault lasts until the process ends (or it is set to false); a restarted server starts healthy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

VERSION = "0.10.1.1"
CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
KV_CACHE_TOKENS = 32768
DEFAULT_DEATH_BLOCKS = 25  # the seed's death: num_required_blocks 25 < len(req_blocks) 26
REPLY = "OK"

FAULTS = {
    "die": "die now (on the next request or stats tick when set by the control file)",
    "die_at_request": "die on the N-th API request from now (admin requests do not count)",
    "die_on_prompt_chars": "a completion whose prompt has more than N characters kills the server",
    "hang": "accept connections but never answer an API request, /health included",
    "dead_503": "the engine is dead: every API route answers 503, the process stays up",
    "slow_once": "the next API request answers after this many seconds, then back to normal",
}


class VllmLog:
    """Writes lines shaped like vLLM's, flushed one by one, so a `tail` at death shows the end."""

    def __init__(self, path: Path, pid: int) -> None:
        self.pid = pid
        self._file = path.open("a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def record(self, level: str, where: str, message: str, process: str = "APIServer") -> None:
        """A vLLM logger line: `(APIServer pid=N) INFO 05-04 01:46:37 [file.py:123] message`."""
        stamp = datetime.now().strftime("%m-%d %H:%M:%S")
        self._write(f"({process} pid={self.pid}) {level} {stamp} [{where}] {message}")

    def uvicorn(self, message: str) -> None:
        """A uvicorn line, as vLLM's API server prints them: `(APIServer pid=N) INFO:     msg`."""
        self._write(f"(APIServer pid={self.pid}) INFO:     {message}")

    def _write(self, line: str) -> None:
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def startup(self, model: str, port: int) -> None:
        self.record("INFO", "api_server.py:1805", f"vLLM API server version {VERSION} (stand-in)")
        self.record(
            "INFO", "utils.py:326", f"non-default args: {{'model': '{model}', 'port': {port}}}"
        )
        self.record(
            "INFO",
            "core.py:74",
            f"Initializing a V1 LLM engine (v{VERSION}) with config: model='{model}'",
            process="EngineCore",
        )
        self.record(
            "INFO",
            "kv_cache_utils.py:849",
            f"GPU KV cache size: {KV_CACHE_TOKENS:,} tokens",
            "EngineCore",
        )
        self.record(
            "INFO", "api_server.py:1847", f"Starting vLLM API server 0 on http://127.0.0.1:{port}"
        )
        self.uvicorn(f"Started server process [{self.pid}]")
        self.uvicorn("Waiting for application startup.")
        self.uvicorn("Application startup complete.")

    def engine_death(self, blocks: int) -> None:
        """The lines vLLM printed when its KV-cache manager hit the off-by-one of the seed story."""
        for line in (
            "EngineCore encountered a fatal error.",
            "Traceback (most recent call last):",
            '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_manager.py", '
            "line 301, in allocate_slots",
            f"AssertionError: num_required_blocks {blocks} < len(req_blocks) {blocks + 1}",
        ):
            self.record("ERROR", "core.py:1110", line, process="EngineCore")
        self.record("ERROR", "async_llm.py:707", "AsyncLLM output_handler failed.")
        self.record(
            "ERROR",
            "async_llm.py:707",
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
            "See stack trace (above) for the root cause.",
        )

    def shutdown(self) -> None:
        self.uvicorn("Shutting down")
        self.uvicorn("Waiting for application shutdown.")
        self.uvicorn("Application shutdown complete.")
        self.uvicorn(f"Finished server process [{self.pid}]")


@dataclass
class Faults:
    """What is currently wrong with the server; changed only under the server's lock."""

    die_now: bool = False
    die_countdown: int = 0  # 0 = off
    die_on_prompt_chars: int = 0  # 0 = off
    hang: bool = False
    dead: bool = False
    slow_once: float = 0.0


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
    converters = {"die_at_request": int, "die_on_prompt_chars": int, "slow_once": float}
    try:
        return {key: converters.get(key, bool)(value) for key, value in settings.items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"bad fault value: {error}") from None


def tokens_of(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN)


def text_of(content: Any) -> str:
    """The text of an OpenAI message content: a string or a list of `{"type": "text"}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_chars_of(path: str, request: Any) -> int | None:
    """Prompt size of a completion request (sum of message contents); None for other routes."""
    if not isinstance(request, dict):
        return None
    if path == "/v1/chat/completions":
        messages = request.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(len(text_of(m.get("content"))) for m in messages if isinstance(m, dict))
    if path == "/v1/completions":
        prompt = request.get("prompt", "")
        return len(prompt) if isinstance(prompt, str) else len(text_of(prompt))
    return None


ROUTES = {  # path -> (method, Handler method)
    "/health": ("GET", "health"),
    "/v1/models": ("GET", "models"),
    "/metrics": ("GET", "metrics"),
    "/v1/chat/completions": ("POST", "completion"),
    "/v1/completions": ("POST", "completion"),
}
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class StandInServer(ThreadingHTTPServer):
    """The HTTP server plus the engine's state: faults, gauges, log and state files."""

    daemon_threads = True  # hung requests must never keep the process alive

    def __init__(self, port: int, state_dir: Path, model: str, log: VllmLog) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.port = self.server_address[1]
        self.state_dir = state_dir
        self.model = model
        self.log = log
        self.lock = threading.Lock()
        self.faults = Faults()
        self.running = 0
        self.last_prompt_tokens = 0
        self.prompt_tokens_since_tick = 0
        self.generation_tokens_since_tick = 0
        self.released = threading.Event()  # set at shutdown; hung requests wait for it
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
            f.hang = faults.get("hang", f.hang)
            f.slow_once = faults.get("slow_once", f.slow_once)
            engine_dies = faults.get("dead_503", False) and not f.dead
            f.dead = faults.get("dead_503", f.dead)
        if engine_dies:
            self.log.engine_death(self.death_blocks())

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

    def death_due(self, prompt_chars: int | None) -> str | None:
        """Counts this API request against the faults; the reason to die now, or None."""
        with self.lock:
            f = self.faults
            if f.die_now:
                return "die"
            if f.die_countdown:
                f.die_countdown -= 1
                if not f.die_countdown:
                    return "die_at_request"
            limit = f.die_on_prompt_chars
            if limit and prompt_chars is not None and prompt_chars > limit:
                self.last_prompt_tokens = tokens_of(prompt_chars)
                return f"die_on_prompt_chars ({prompt_chars} > {limit})"
        return None

    def take_slow_once(self) -> float:
        with self.lock:
            delay, self.faults.slow_once = self.faults.slow_once, 0.0
        return delay

    def death_blocks(self) -> int:
        tokens = self.last_prompt_tokens
        return math.ceil(tokens / BLOCK_TOKENS) if tokens else DEFAULT_DEATH_BLOCKS

    def die(self, reason: str) -> NoReturn:
        """Dies like vLLM does when its engine dies: error lines, shutdown lines, exit code 0."""
        self._dying.acquire()  # a second death waits here until the process is gone
        self.log.engine_death(self.death_blocks())
        self.log.shutdown()
        self.finish(code=0, reason=f"engine dead: {reason}")
        os._exit(0)

    def finish(self, code: int, reason: str) -> None:
        """Leaves the exit marker tests and demos read, and removes the pid file."""
        marker = {"pid": self.log.pid, "code": code, "reason": reason, "time": time.time()}
        write_json(self.state_dir / "exit.json", marker)
        (self.state_dir / "server.pid").unlink(missing_ok=True)

    # gauges

    def record_completion(self, prompt_chars: int) -> None:
        with self.lock:
            self.last_prompt_tokens = tokens_of(prompt_chars)
            self.prompt_tokens_since_tick += self.last_prompt_tokens
            self.generation_tokens_since_tick += 1

    def kv_cache_usage(self) -> float:
        return min(1.0, self.last_prompt_tokens / KV_CACHE_TOKENS)

    def metrics(self) -> str:
        """Prometheus text with the gauges an operator (or a `gpu` probe) looks at."""
        labels = f'{{engine="0",model_name="{self.model}"}}'
        usage = self.kv_cache_usage()
        gauges = [
            ("vllm:num_requests_running", "Requests in model execution batches.", self.running),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", 0),
            ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent.", usage),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", usage),
        ]
        lines = []
        for name, help_text, value in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            lines.append(f"{name}{labels} {float(value)}")
        return "\n".join(lines) + "\n"

    def tick(self, seconds: float) -> None:
        """One periodic stats line, like vLLM's `loggers.py`, and a look at the control file."""
        self.poll_control_file()
        with self.lock:
            prompt, self.prompt_tokens_since_tick = self.prompt_tokens_since_tick, 0
            generation, self.generation_tokens_since_tick = self.generation_tokens_since_tick, 0
            running = self.running
        self.log.record(
            "INFO",
            "loggers.py:123",
            f"Engine 000: Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generation / seconds:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: 0 reqs, "
            f"GPU KV cache usage: {self.kv_cache_usage() * 100:.1f}%, Prefix cache hit rate: 0.0%",
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
        self.prompt_chars = prompt_chars_of(self.route, self.request_json)
        death = srv.death_due(self.prompt_chars)
        if death:
            self.send_error_json(
                HTTPStatus.INTERNAL_SERVER_ERROR, ENGINE_DEAD, "InternalServerError"
            )
            srv.die(death)
        if srv.faults.hang:
            srv.released.wait()
            self.close_connection = True
            return
        is_completion = self.prompt_chars is not None
        with srv.lock:
            srv.running += is_completion
        try:
            delay = srv.take_slow_once()
            if delay:
                time.sleep(delay)
            if srv.faults.dead:
                self.send_error_json(HTTPStatus.SERVICE_UNAVAILABLE, ENGINE_DEAD, "EngineDeadError")
            else:
                self.dispatch()
        finally:
            with srv.lock:
                srv.running -= is_completion

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

    def completion(self) -> None:
        srv, request, prompt_chars = self.server, self.request_json, self.prompt_chars
        if not isinstance(request, dict) or prompt_chars is None:
            self.send_error_json(
                HTTPStatus.BAD_REQUEST, "body is not a JSON object", "BadRequestError"
            )
            return
        model = request.get("model") or srv.model
        if model != srv.model:
            message = f"The model `{model}` does not exist."
            self.send_error_json(HTTPStatus.NOT_FOUND, message, "NotFoundError")
            return
        srv.record_completion(prompt_chars)
        max_tokens = request.get("max_tokens")
        finish = "length" if isinstance(max_tokens, int) and max_tokens <= 1 else "stop"
        prompt_tokens = tokens_of(prompt_chars)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
        }
        if self.route == "/v1/chat/completions":
            kind, prefix = "chat.completion", "chatcmpl"
            message = {"role": "assistant", "content": REPLY}
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            kind, prefix = "text_completion", "cmpl"
            choice = {"index": 0, "text": REPLY, "finish_reason": finish, "logprobs": None}
        reply = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
        self.send_json(HTTPStatus.OK, reply)

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
        error = {"message": message, "type": kind, "param": None, "code": status.value}
        self.send_json(status, {"error": error})

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


def write_json(path: Path, payload: Any) -> None:
    """Writes atomically, so a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(payload) + "\n", encoding="utf-8")
    partial.replace(path)


def serve(port: int, state_dir: Path, model: str, log_path: Path, stats_interval: float) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    (state_dir / "exit.json").unlink(missing_ok=True)
    log = VllmLog(log_path, os.getpid())
    try:
        server = StandInServer(port, state_dir, model, log)
    except OSError as error:
        log.record(
            "ERROR", "api_server.py:1830", f"[Errno {error.errno}] {error.strerror}: port {port}"
        )
        write_json(state_dir / "exit.json", {"pid": log.pid, "code": 1, "reason": str(error)})
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    (state_dir / "server.pid").write_text(f"{log.pid}\n", encoding="utf-8")
    log.startup(model, server.port)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    while not stop.wait(stats_interval):
        server.tick(stats_interval)
    log.shutdown()
    server.released.set()
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
    args = parser.parse_args(argv)
    log_path = args.log or args.state_dir / "server.log"
    return serve(args.port, args.state_dir, args.model, log_path, args.stats_interval)


if __name__ == "__main__":
    raise SystemExit(main())
