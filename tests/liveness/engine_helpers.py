"""A real HTTP server on 127.0.0.1 that answers like vLLM's API server, its engine scripted by
the test: what /metrics says (vLLM's metric names, histograms and all) and what a chat
completion gets (an answer, an error status, or no answer at all: a hung engine).

    with Engine() as engine:
        engine.running = 1          # a request active...
        engine.hang()               # ...and no token: counters frozen, generation blocked
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

DEAD_ENGINE = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "code": 500,
    }
}


class Engine:
    """vLLM as the probes see it; every field is the test's to set, at any time."""

    def __init__(self) -> None:
        self.generation_tokens = 0.0
        self.prompt_tokens = 0.0
        self.running = 0
        self.waiting = 0
        self.completion_status = 200  # 500: a dead engine
        self.metrics_status = 200
        self.metrics_delay = 0.0  # seconds before /metrics answers (a CPU-starved server)
        self.models_delay = 0.0  # seconds before /v1/models answers (the same, its API server)
        self.omit: set[str] = set()  # metric names left out of /metrics
        self.padding = 0  # histogram bucket lines added to /metrics (a big body)
        self.completions = 0  # chat completions received
        self.metrics_scrapes = 0
        self.on_completion = lambda: None  # called as a completion arrives
        self.admin_calls: list[str] = []
        self._unblocked = threading.Event()  # cleared: generation hangs
        self._unblocked.set()
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._ticking = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root_url}/v1"
        self.metrics_url = f"{self.root_url}/metrics"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    # what the test scripts

    def hang(self) -> None:
        """The engine stops: counters frozen, a completion waits forever (until `resume`)."""
        self._ticking.clear()
        self._unblocked.clear()

    def resume(self) -> None:
        self._unblocked.set()

    def busy(self, tokens_per_second: float = 50.0, running: int = 1, waiting: int = 3) -> None:
        """Long generations: tokens counted as they come, a queue behind them that a new
        request (the canary) would wait in."""
        self.running, self.waiting = running, waiting
        self._unblocked.clear()  # a new request queues behind the running ones
        self._ticking.set()
        if self._ticker is None:
            self._ticker = threading.Thread(
                target=self._tick, args=(1.0 / tokens_per_second,), daemon=True
            )
            self._ticker.start()

    def metrics_text(self) -> str:
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(self.running)}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {float(self.waiting)}',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {self.generation_tokens}',
            f'vllm:generation_tokens_created{{engine="0",model_name="m"}} {time.time():.3f}',
            "# TYPE vllm:prompt_tokens_total counter",
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {self.prompt_tokens}',
            f'vllm:prompt_tokens_created{{engine="0",model_name="m"}} {time.time():.3f}',
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        lines += [
            f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{i / 1000}"}} {i}'
            for i in range(self.padding)
        ]
        kept = [line for line in lines if not any(line.startswith(name) for name in self.omit)]
        return "\n".join(kept) + "\n"

    def admin(self, command: str) -> None:
        """`POST /admin/hang`: hung with the caller's request active; `/admin/resume`: a
        healthy idle engine again (what a restart gives)."""
        self.admin_calls.append(command)
        if command == "hang":
            self.running, self.waiting = 1, 0
            self.hang()
        elif command == "resume":
            self.running = self.waiting = 0
            self.resume()

    # the server

    def _tick(self, every: float) -> None:
        while self._ticking.wait():
            with self._lock:
                self.generation_tokens += 1
            time.sleep(every)

    def _complete(self) -> tuple[int, dict]:
        self.completions += 1
        self.on_completion()
        while not self._unblocked.wait(0.05):
            if self._closing:
                return 503, {"error": "shutting down"}
        if self.completion_status != 200:
            return self.completion_status, DEAD_ENGINE
        with self._lock:
            self.prompt_tokens += 3
            self.generation_tokens += 1
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"}}]}

    _closing = False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    engine.metrics_scrapes += 1
                    time.sleep(engine.metrics_delay)  # the server's own slowness, as scripted
                    self.send(engine.metrics_status, engine.metrics_text(), "text/plain")
                elif self.path == "/v1/models":
                    time.sleep(engine.models_delay)
                    self.send(200, json.dumps({"data": [{"id": "m"}]}))
                else:
                    self.send(200, "")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/admin/"):  # for a process of the test (an agent)
                    engine.admin(self.path.removeprefix("/admin/"))
                    self.send(200, "{}")
                    return
                status, body = engine._complete()
                self.send(status, json.dumps(body))

            def send(self, status: int, text: str, kind: str = "application/json") -> None:
                body = text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up waiting (a probe's timeout)
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def close(self) -> None:
        self._closing = True
        self._ticking.clear()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
