"""A loopback proxy per loop, between the agent and the LLM server: the loop's own receipts.

The server's counters (`vllm:prompt_tokens_total`) count every client's tokens: with several
loops on one server they cannot say which loop spent what. So, when the runbook says
`loop: { proxy: true }`, the runner starts this proxy on 127.0.0.1 (an ephemeral port) and
`{{ agent_base_url }}` points the agent at it. It forwards every request unchanged (method,
path, query, headers but the hop-by-hop ones, body) to the real base URL and passes each
response back as it comes, chunk by chunk (a server-sent event stream is flushed chunk by chunk,
its bytes untouched), and counts from what went through:

- `usage` of a JSON body (chat/completions: `prompt_tokens`/`completion_tokens`, responses and
  Anthropic's Messages API: `input_tokens`/`output_tokens`, the Messages API's cache reads and
  writes counted as prompt tokens, as the engine counts them); in a stream the last `usage`
  seen (the final chunk of `stream_options.include_usage`, a responses stream's
  `response.completed`, a Messages stream's `message_delta`, whose input tokens, when it leaves
  them out as Anthropic's API does, are `message_start`'s);
- a stream with no `usage`: its content pieces (`choices[].delta.content`, `choices[].text`,
  `response.output_text.delta`, a Messages `content_block_delta`) as a lower bound of the
  generated tokens, and `estimated`;
- time to the first byte of the body and to the first token (a stream's first content piece),
  and the time from the first token to the end (generation).

The counters only grow (`totals()`); the iteration history takes their difference across an
iteration. `in_flight()` says how many requests are being served now (a stall rule's "is the
agent waiting on the server?"), and `awaiting()` which of them still wait for their first token,
and how long the largest should take at the pace the earlier ones showed: the progress probe's
hang bound covers a long prompt's first engine step with it (docs: hangs). A proxy that cannot
start leaves the agent on the direct URL (`running` warns): receipts are no reason to stop a loop.

It listens on 127.0.0.1, where every local user can connect: its URL's path starts with a
secret of the run's (`/<token>/v1`), and a request without it is refused (403). It forwards to
its upstream only (the request line's path, never an absolute form or userinfo), takes bodies
up to MAX_REQUEST with a valid Content-Length, gives a client CLIENT_SILENCE s to send, and an
upstream UPSTREAM_SILENCE s between bytes.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from ralph_runner.probes import Awaiting

if TYPE_CHECKING:
    from ralph_runner.deaths.history import ProxyReceipt
    from ralph_runner.runbook.plan import Plan

# Headers of one hop (RFC 9110 7.6.1), not forwarded; Host is the upstream's, set by httpx;
# Content-Length is set again for the body as sent.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
CONNECT_TIMEOUT = 10.0  # s to connect upstream
# s the upstream may send nothing (a long prefill sends no byte until its first token): past
# it the request is cut, so a server that stops sending never holds a request (and the
# in-flight count) for good. Ten minutes: above any one prefill the hang bound would allow.
UPSTREAM_SILENCE = 600.0
CLIENT_SILENCE = 60.0  # s a client may take to send its request, or stall reading our answer
MAX_REQUEST = 64 * 1024 * 1024  # bytes of a request body (a prompt, images included)
TOO_LARGE = f"a request body over {MAX_REQUEST // 2**20} MiB"
SETTLE = 0.5  # s an iteration's receipt waits for a request still being counted
PACES = 16  # the latest streamed requests whose time to first token per byte is remembered
MAX_EVENT = 1024 * 1024  # bytes of one SSE event kept for counting; a longer one is not parsed


@dataclass
class Totals:
    """What went through the proxy since it started; differences of two give an iteration."""

    requests: int = 0
    errors: int = 0  # requests the upstream did not answer (refused, cut) or answered >= 400
    prompt_tokens: int = 0
    generated_tokens: int = 0
    estimated: int = 0  # requests whose generated tokens are content pieces (no usage given)
    first_token_seconds: float = 0.0  # summed over the requests that had a first token
    first_tokens: int = 0  # ... how many
    generation_seconds: float = 0.0  # first token to the end, summed
    request_seconds: float = 0.0  # request to the end of the response, summed

    def minus(self, earlier: Totals) -> Totals:
        mine, theirs = asdict(self), asdict(earlier)
        return Totals(**{key: mine[key] - theirs[key] for key in mine})

    def receipt(self) -> ProxyReceipt:
        """The fields an iteration's history line gets."""
        first = self.first_token_seconds / self.first_tokens if self.first_tokens else None
        return {
            "requests": self.requests,
            "request_errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "tokens_estimated": self.estimated > 0,
            "first_token_seconds": None if first is None else round(first, 3),
            "generation_seconds": round(self.generation_seconds, 3),
            "request_seconds": round(self.request_seconds, 3),
        }


class Counting:
    """Reads one response's body as it passes: its usage, its content pieces, its timing."""

    def __init__(self, started: float, stream: bool) -> None:
        self.started, self.stream = started, stream
        self.first_byte: float | None = None
        self.first_token: float | None = None
        self.usage: dict[str, Any] | None = None
        self.pieces = 0
        self._buffer = b""
        self._body: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        now = time.monotonic()
        if self.first_byte is None:
            self.first_byte = now
        if not self.stream:
            if self._size <= 16 * MAX_EVENT:
                self._body.append(chunk)
                self._size += len(chunk)
            return
        self._buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            self._event(event, now)
        if len(self._buffer) > MAX_EVENT:
            self._buffer = b""

    def finish(self) -> None:
        if self.stream:
            if self._buffer.strip():
                self._event(self._buffer, time.monotonic())
            return
        try:
            body = json.loads(b"".join(self._body))
        except ValueError:
            return
        if isinstance(body, dict):
            self.usage = _usage(body) or self.usage
            if self.first_byte is not None and self.usage:
                self.first_token = self.first_byte  # a whole answer: its first byte

    def _event(self, event: bytes, now: float) -> None:
        data = b"\n".join(
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data or data == b"[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        usage = _usage(chunk)
        if usage is None and isinstance(chunk.get("response"), dict):
            usage = _usage(chunk["response"])  # responses: response.completed
        if usage is None and isinstance(chunk.get("message"), dict):
            usage = _usage(chunk["message"])  # messages: message_start
        if usage is not None:
            said = chunk.get("usage")
            if isinstance(said, dict) and "input_tokens" not in said and self.usage is not None:
                usage["prompt"] = self.usage["prompt"]  # Anthropic's message_delta: output only
            self.usage = usage
        pieces = _pieces(chunk)
        if pieces:
            self.pieces += pieces
            if self.first_token is None:
                self.first_token = now


def _usage(body: dict[str, Any]) -> dict[str, Any] | None:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    generated = usage.get("completion_tokens", usage.get("output_tokens"))
    if not isinstance(prompt, int) and not isinstance(generated, int):
        return None
    prompt = prompt if isinstance(prompt, int) else 0
    if "input_tokens" in usage:  # the Messages API leaves cached prompt tokens out of it
        for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            prompt += usage[cached] if isinstance(usage.get(cached), int) else 0
    return {"prompt": prompt, "generated": generated or 0}


def _pieces(chunk: dict[str, Any]) -> int:
    """Content pieces in one stream chunk: each one token at least."""
    if chunk.get("type") == "response.output_text.delta":
        return 1 if chunk.get("delta") else 0
    if chunk.get("type") == "content_block_delta":  # messages: text, tool input, thinking
        delta = chunk.get("delta")
        pieces = ("text", "partial_json", "thinking")
        return 1 if isinstance(delta, dict) and any(delta.get(key) for key in pieces) else 0
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return 0
    count = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(delta, dict) and not text:
            text = delta.get("reasoning_content") or delta.get("tool_calls")
        count += 1 if text else 0
    return count


class Proxy:
    """One loop's proxy to `upstream` (an OpenAI base URL such as http://host:8000/v1)."""

    def __init__(
        self,
        upstream: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        client_silence: float = CLIENT_SILENCE,
        upstream_silence: float = UPSTREAM_SILENCE,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"not an http(s) URL: {upstream!r}")
        self.upstream = upstream
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._path = parts.path.rstrip("/")
        self._secret = "/" + secrets.token_urlsafe(18)  # the URL's first segment: ours only
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._totals = Totals()
        self._in_flight = 0
        self._awaiting: dict[int, tuple[float, int]] = {}  # request -> (sent, body bytes)
        self._paces: deque[float] = deque(maxlen=PACES)  # s to first token per body byte
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=16)
        self.client_silence = client_silence
        timeout = httpx.Timeout(upstream_silence, connect=CONNECT_TIMEOUT)
        self._client = httpx.Client(timeout=timeout, limits=limits, trust_env=False)
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="agent-proxy", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The base URL the agent is given: the upstream's path on the proxy, behind the run's
        secret segment."""
        return f"http://127.0.0.1:{self.port}{self._secret}{self._path}"

    def start(self) -> Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self._client.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def in_flight(self) -> int:
        """Requests being served now (sent upstream, their response not yet passed on)."""
        with self._lock:
            return self._in_flight

    def awaiting(self) -> Awaiting | None:
        """The requests sent upstream that have no first token yet (a stream) or no answer (a
        whole body); None when there are none. `expected`: the seconds the largest should take
        to its first token at the slowest pace (s per byte) of the latest streamed requests;
        None before one was measured."""
        with self._lock:
            if not self._awaiting:
                return None
            largest = max(size for _, size in self._awaiting.values())
            return Awaiting(
                count=len(self._awaiting),
                since=min(sent for sent, _ in self._awaiting.values()),
                latest=max(sent for sent, _ in self._awaiting.values()),
                expected=largest * max(self._paces) if self._paces else None,
            )

    def totals(self) -> Totals:
        with self._lock:
            return Totals(**asdict(self._totals))

    def settled(self, timeout: float = SETTLE) -> Totals:
        """The totals once no request is in flight (or `timeout` s later): the agent may
        have read its last byte, and exited, a moment before the proxy counted it."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout)
            return Totals(**asdict(self._totals))

    # what a handler thread calls
    def _began(self, key: int, started: float, size: int) -> None:
        with self._lock:
            self._in_flight += 1
            if size:
                self._awaiting[key] = (started, size)

    def _answered(self, key: int, counting: Counting | None) -> None:
        """The request's first token (or whole answer) came: it no longer waits on a prefill."""
        with self._lock:
            sent_size = self._awaiting.pop(key, None)
            if sent_size is None or counting is None or counting.first_token is None:
                return
            sent, size = sent_size
            if counting.stream:
                self._paces.append((counting.first_token - sent) / size)

    def _ended(self, key: int, counting: Counting | None, started: float, failed: bool) -> None:
        ended = time.monotonic()
        with self._lock:
            self._awaiting.pop(key, None)
            self._in_flight -= 1
            self._idle.notify_all()
            t = self._totals
            t.requests += 1
            t.errors += failed
            t.request_seconds += ended - started
            if counting is None:
                return
            if counting.usage is not None:
                t.prompt_tokens += counting.usage["prompt"]
                t.generated_tokens += counting.usage["generated"]
            elif counting.pieces:
                t.generated_tokens += counting.pieces
                t.estimated += 1
            if counting.first_token is not None:
                t.first_tokens += 1
                t.first_token_seconds += counting.first_token - started
                t.generation_seconds += ended - counting.first_token


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive and chunked, as the agents' clients expect

        def setup(self) -> None:
            super().setup()
            self.connection.settimeout(proxy.client_silence)  # a half-sent request, an idle one

        def do_GET(self) -> None:
            self._forward()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the agent's output is the loop's; a proxy line per request is noise

        def _forward(self) -> None:
            path = self._upstream_path()
            body = self._body() if path is not None else None
            if path is None or body is None:
                return
            headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
            started = time.monotonic()
            request_id = id(self)
            proxy._began(request_id, started, len(body))
            counting: Counting | None = None
            failed = True
            try:
                request = proxy._client.build_request(
                    self.command, proxy._origin + path, headers=headers, content=body
                )
                try:
                    response = proxy._client.send(request, stream=True)
                except httpx.HTTPError as exc:
                    self._bad_gateway(exc)
                    return
                with contextlib.closing(response):
                    kind = response.headers.get("content-type", "")
                    plain = response.headers.get("content-encoding", "identity") == "identity"
                    if plain and ("json" in kind or "event-stream" in kind):
                        counting = Counting(started, "event-stream" in kind)
                    failed = not self._relay(response, counting, request_id)
                    failed = failed or response.status_code >= 400
            finally:
                if counting is not None:
                    counting.finish()
                proxy._ended(request_id, counting, started, failed)

        def _relay(
            self, response: httpx.Response, counting: Counting | None, request_id: int
        ) -> bool:
            """The response passed on as it comes; False when either side broke off."""
            self.send_response_only(response.status_code, response.reason_phrase)
            for key, value in response.headers.multi_items():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            sized = "content-length" in response.headers and self.command != "HEAD"
            if sized:
                self.send_header("Content-Length", response.headers["content-length"])
            bodiless = self.command == "HEAD" or response.status_code in (204, 304)
            chunked = not sized and not bodiless
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                if bodiless:
                    self.wfile.flush()
                    return True
                waiting = True
                for chunk in response.iter_raw():
                    if counting is not None:
                        counting.feed(chunk)
                    if waiting and not _before_first_token(counting):
                        waiting = False  # a first token, or a whole answer's first byte
                        proxy._answered(request_id, counting)
                    if chunked and chunk:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    elif chunk:
                        self.wfile.write(chunk)
                    self.wfile.flush()
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                return True
            except httpx.HTTPError:  # the server broke off: so does the proxy, no last chunk
                self.close_connection = True
                return False
            except OSError:  # the agent went away: the upstream request is closed with it
                self.close_connection = True
                return False

        def _upstream_path(self) -> str | None:
            """The path to ask upstream: the request's, past the run's secret segment (an
            origin-form path, so the upstream's address is the only one ever asked); None,
            and a 403, for a request that does not know the secret."""
            secret = proxy._secret
            if self.path == secret or self.path.startswith((secret + "/", secret + "?")):
                return self.path[len(secret) :] or "/"
            self._refuse(HTTPStatus.FORBIDDEN, "not this loop's agent proxy URL")
            return None

        def _body(self) -> bytes | None:
            """The request's body, within MAX_REQUEST; None (and a 4xx sent) when it is not."""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                return self._read_chunked()
            given = (self.headers.get("Content-Length") or "0").strip()
            if not given.isdigit():
                self._refuse(HTTPStatus.BAD_REQUEST, f"Content-Length {given!r} is no length")
                return None
            length = int(given)
            if length > MAX_REQUEST:
                self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, TOO_LARGE)
                return None
            return self.rfile.read(length) if length else b""

        def _read_chunked(self) -> bytes | None:
            parts: list[bytes] = []
            total = 0
            while True:
                line = self.rfile.readline(1024).split(b";")[0].strip() or b"0"
                try:
                    size = int(line, 16)
                except ValueError:
                    self._refuse(HTTPStatus.BAD_REQUEST, "a chunk size that is no number")
                    return None
                total += size
                if size < 0 or total > MAX_REQUEST:
                    self._refuse(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a body over {MAX_REQUEST} B"
                    )
                    return None
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline(1024)

        def _refuse(self, status: HTTPStatus, why: str) -> None:
            """An answer of the proxy's own (never forwarded); the connection is closed."""
            self._answer(status, f"ralph-run agent proxy: {why}")
            self.close_connection = True

        def _bad_gateway(self, exc: httpx.HTTPError) -> None:
            """The server did not answer: the agent gets a 502 that names it (a refused
            connection reads as "refused" in the agent's error, as it would without the proxy)."""
            self._answer(
                HTTPStatus.BAD_GATEWAY, f"ralph-run agent proxy: {proxy.upstream}: {_why(exc)}"
            )

        def _answer(self, status: HTTPStatus, message: str) -> None:
            payload = {"error": {"message": message, "type": status.phrase, "code": status}}
            data = json.dumps(payload).encode()
            with contextlib.suppress(OSError):
                self.send_response_only(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()

    return Handler


def _before_first_token(counting: Counting | None) -> bool:
    """A stream whose first token has not come yet (its first bytes may be a role, a comment)."""
    return counting is not None and counting.stream and counting.first_token is None


def _why(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError) and "refused" not in text.lower():
        text = f"connection failed ({text})"
    return text


# -- the runner's side ---------------------------------------------------------


def upstream_of(plan: Plan) -> str | None:
    """The URL the proxy forwards to: `loop.proxy.upstream`, else the variable `base_url`;
    None when the runbook does not ask for a proxy."""
    config = plan.model.loop.proxy
    if not config:
        return None
    upstream = getattr(config, "upstream", None)
    if upstream is None:
        value = plan.variables.get("base_url")
        return None if value is None else str(value)
    where = plan.runbook.where(("loop", "proxy", "upstream"))
    return plan.templar.render(upstream, plan.variables, where=where)


@contextlib.contextmanager
def running(plan: Plan, warn: Callable[[str], None]) -> Iterator[Proxy | None]:
    """The run's proxy when the runbook asks for one and it starts; else None and a warning.
    The runner hands its counters (`Proxy.settled`) to the iteration history, which reads them
    for each line's receipt; they stay readable after the stop, for the line a run's end
    closes."""
    if not plan.model.loop.proxy:
        yield None
        return
    proxy = None
    try:
        upstream = upstream_of(plan)
        if upstream is None:
            raise ValueError("no `loop.proxy.upstream` and no variable `base_url` to forward to")
        proxy = Proxy(upstream).start()
    except (OSError, ValueError) as exc:
        warn(f"agent proxy not started: {exc}; the agent talks to the server directly")
    try:
        yield proxy
    finally:
        if proxy is not None:
            with contextlib.suppress(Exception):
                proxy.stop()


def variables(plan: Plan, proxy: Proxy | None) -> dict[str, Any]:
    """`agent_base_url`: the proxy's URL while it runs, else the direct one (`base_url`)."""
    if proxy is not None:
        return {"agent_base_url": proxy.url}
    direct = plan.variables.get("base_url")
    if plan.model.loop.proxy:
        with contextlib.suppress(Exception):
            direct = upstream_of(plan) or direct
    return {} if direct is None else {"agent_base_url": direct}
