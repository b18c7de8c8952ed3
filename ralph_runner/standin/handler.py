"""The stand-in's HTTP handler: vLLM's routes and the admin endpoint, the faults applied to
every API request, generations whole or streamed as uvicorn sends them."""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from ralph_runner.standin import scripted
from ralph_runner.standin.api_server import StandInServer
from ralph_runner.standin.engine import KV_CACHE_TOKENS, EngineDead, Sequence, plan_of, tokens_of
from ralph_runner.standin.faults import parse_faults
from ralph_runner.standin.generation import max_tokens_of, min_tokens_of, prompt_chars_of
from ralph_runner.standin.messages import Messages, messages_error
from ralph_runner.standin.metrics import CONTENT_TYPE, exposition
from ralph_runner.standin.rot import resident_bytes
from ralph_runner.standin.vllm_log import ENGINE_DEAD
from ralph_runner.standin.wire import FORMATS, Format, Responses, error_body

ROUTES = {  # path -> (method, Handler method)
    "/health": ("GET", "health"),
    "/v1/models": ("GET", "models"),
    "/metrics": ("GET", "metrics"),
    "/v1/chat/completions": ("POST", "generation"),
    "/v1/completions": ("POST", "generation"),
    "/v1/responses": ("POST", "generation"),
    "/v1/messages": ("POST", "generation"),  # Anthropic's Messages API (Claude Code)
}
API_FORMATS: dict[str, type[Format]] = {**FORMATS, "/v1/messages": Messages}


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
            self.request_json: object = json.loads(self.rfile.read(length)) if length else None
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
        srv = self.server
        text = exposition(srv.engine.stats, srv.model, srv.started, resident_bytes())
        self.send_body(HTTPStatus.OK, text.encode(), CONTENT_TYPE)

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
        limited = srv.rate_limited()
        if limited:
            self.send_rate_limited(limited)
            return
        prompt_chars = prompt_chars_of(self.route, request)
        if srv.prompt_kills(prompt_chars) or srv.engine_dead:
            self.send_error_json(
                HTTPStatus.INTERNAL_SERVER_ERROR, ENGINE_DEAD, "InternalServerError"
            )
            return
        answer = API_FORMATS[self.route](model, request, tokens_of(prompt_chars))
        reply = scripted.reply_for(answer.api, request, srv.options.script)
        max_tokens = max_tokens_of(self.route, request, answer.prompt_tokens)
        at_least = max(min_tokens_of(request, max_tokens), srv.faults.busy)
        plan, finish_reason = plan_of(reply, max_tokens, at_least)
        sequence = Sequence(answer.prompt_tokens, plan, finish_reason)
        srv.last_prompt_tokens = answer.prompt_tokens
        srv.age_decode()
        srv.rotted()
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
        """vLLM's error body: `{"error": {"message", "type", "param", "code"}}`; on the
        Messages API Anthropic's `{"type": "error", "error": {"type", "message"}}`."""
        if self.route == "/v1/messages":
            self.send_json(status, messages_error(message, kind))
        else:
            self.send_json(status, error_body(message, kind, status.value))

    def send_rate_limited(self, seconds: float) -> None:
        """The `rate_limit` fault: 429 with `retry-after` (whole seconds, as Anthropic's API
        and most proxies send it), the error in the route's own shape."""
        retry_after = max(1, math.ceil(seconds))
        message = f"Rate limited by the stand-in: retry after {retry_after} s."
        if self.route == "/v1/messages":
            body = json.dumps(messages_error(message, "rate_limit_error")).encode()
        else:
            body = json.dumps(error_body(message, "rate_limit_error", 429)).encode()
        self.send_response(HTTPStatus.TOO_MANY_REQUESTS)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("retry-after", str(retry_after))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def send_json(self, status: HTTPStatus, payload: Mapping[str, object]) -> None:
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

    def log_message(self, format: str, *args: object) -> None:
        self.server.log.record("WARNING", "http.py:1", format % args)
