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
their size in tokens and how long the earlier ones took to theirs: the progress probe's hang
bound covers a long prompt's first engine step with it (docs: hangs). A proxy that cannot
start leaves the agent on the direct URL (`running` warns): receipts are no reason to stop a loop.

It listens on 127.0.0.1, where every local user can connect: its URL's path starts with a
secret of the run's (`/<token>/v1`), and a request without it is refused (403). It forwards to
its upstream only (the request line's path, never an absolute form or userinfo), takes bodies
up to MAX_REQUEST with a valid Content-Length, gives a client CLIENT_SILENCE s to send its whole
request (head and body) and MAX_CLIENTS connections at once (503 past them), and an upstream
UPSTREAM_SILENCE s between bytes.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import secrets
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from ralph_runner.durable import redaction
from ralph_runner.loop.proxy_counting import Counting, Totals, before_first_token
from ralph_runner.plugins.first_token import STREAMED, TOKENS_PER_BYTE, WHOLE, Measure
from ralph_runner.probes import Awaiting

if TYPE_CHECKING:
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
# Connections served at once, each a thread: loop.workers' agents keep a few each; past it a
# client gets a 503 at once, not a thread (a local user opening thousands held our memory).
MAX_CLIENTS = 256
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
MAX_REQUEST = 64 * 1024 * 1024  # bytes of a request body (a prompt, images included)
TOO_LARGE = f"a request body over {MAX_REQUEST // 2**20} MiB"
SETTLE = 0.5  # s an iteration's receipt waits for a request still being counted
RATIO_BYTES = 4096  # the smallest body whose prompt tokens teach how many a byte holds
MEASURES = 64  # the latest requests whose time to their first token is remembered


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
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"not an http(s) URL: {upstream!r}")
        self.upstream = upstream
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._path = parts.path.rstrip("/")
        self._secret = "/" + secrets.token_urlsafe(18)  # the URL's first segment: ours only
        redaction.register(self._secret[1:])  # an agent's error that prints its URL: masked
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._totals = Totals()
        self._in_flight = 0
        # loop.workers > 1: a URL per worker (its own secret segment), its own totals
        self._labels: dict[str, str] = {}  # secret segment -> label
        self._secret_of: dict[str, str] = {}  # label -> secret segment
        self._label_totals: dict[str, Totals] = {}
        self._label_in_flight: dict[str, int] = {}
        self._awaiting: dict[int, tuple[float, int]] = {}  # request -> (sent, body bytes)
        self._sizes: dict[int, int] = {}  # request -> body bytes, until it ends
        self._settled = 0.0  # when a request last ended
        self._measures: deque[Measure] = deque(maxlen=MEASURES)  # first tokens, timed
        self._tokens_per_byte: float | None = None  # the most prompt tokens a body byte held
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=16)
        self.client_silence = client_silence
        timeout = httpx.Timeout(upstream_silence, connect=CONNECT_TIMEOUT)
        self._client = httpx.Client(timeout=timeout, limits=limits, trust_env=False)
        self._server = _Server((host, port), _handler(self), max_clients)
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

    def url_for(self, label: str) -> str:
        """The base URL for one of the run's agents (a worker): counted on its own too, in
        `totals(label)` and `in_flight(label)`, as well as in the run's."""
        with self._lock:
            if label not in self._secret_of:
                secret = "/" + secrets.token_urlsafe(18)
                redaction.register(secret[1:])
                self._labels[secret], self._secret_of[label] = label, secret
                self._label_totals[label], self._label_in_flight[label] = Totals(), 0
            return f"http://127.0.0.1:{self.port}{self._secret_of[label]}{self._path}"

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

    def in_flight(self, label: str | None = None) -> int:
        """Requests being served now (sent upstream, their response not yet passed on): all,
        or those of `label`'s URL."""
        with self._lock:
            return self._in_flight if label is None else self._label_in_flight.get(label, 0)

    def awaiting(self) -> Awaiting | None:
        """The requests sent upstream that have no first token yet (a stream) or no answer (a
        whole body); None when there are none. With them: the largest one's prompt tokens
        (its bytes at the most tokens a byte held in this loop's answered requests, or
        TOKENS_PER_BYTE), and the loop's measures of first tokens (plugins/first_token.py)."""
        with self._lock:
            if not self._awaiting:
                return None
            largest = max(size for _, size in self._awaiting.values())
            return Awaiting(
                count=len(self._awaiting),
                since=min(sent for sent, _ in self._awaiting.values()),
                latest=max(sent for sent, _ in self._awaiting.values()),
                tokens=largest * (self._tokens_per_byte or TOKENS_PER_BYTE),
                measures=tuple(self._measures),
                settled=self._settled,
            )

    def totals(self, label: str | None = None) -> Totals:
        with self._lock:
            return Totals(**asdict(self._counted(label)))

    def settled(self, timeout: float = SETTLE, label: str | None = None) -> Totals:
        """The totals (all, or `label`'s) once none of their requests is in flight (or
        `timeout` s later): the agent may have read its last byte, and exited, a moment before
        the proxy counted it."""
        with self._idle:
            self._idle.wait_for(lambda: self._flying(label) == 0, timeout)
            return Totals(**asdict(self._counted(label)))

    def meter(self, worker: int | None = None) -> Totals:
        """The history's receipts: the run's totals, or one worker's (settled)."""
        return self.settled(label=None if worker is None else worker_label(worker))

    def _counted(self, label: str | None) -> Totals:
        return self._totals if label is None else self._label_totals.get(label, Totals())

    def _flying(self, label: str | None) -> int:
        return self._in_flight if label is None else self._label_in_flight.get(label, 0)

    # what a handler thread calls
    def _began(self, key: int, started: float, size: int, label: str | None) -> None:
        with self._lock:
            self._in_flight += 1
            if label is not None:
                self._label_in_flight[label] += 1
            if size:
                self._awaiting[key] = (started, size)
                self._sizes[key] = size

    def _answered(self, key: int) -> None:
        """The request's first token (or whole answer) came: it no longer waits on a prefill."""
        with self._lock:
            self._awaiting.pop(key, None)

    def _ended(
        self, key: int, counting: Counting | None, started: float, failed: bool, label: str | None
    ) -> None:
        ended = time.monotonic()
        with self._lock:
            self._awaiting.pop(key, None)
            size = self._sizes.pop(key, 0)
            self._settled = ended
            if not failed and counting is not None:
                self._measure(counting, started, size, ended)
            self._in_flight -= 1
            if label is not None:
                self._label_in_flight[label] -= 1
            self._idle.notify_all()
            for t in (self._totals, *([self._label_totals[label]] if label else [])):
                t.add(counting, started, ended, failed)

    def _measure(self, counting: Counting, started: float, size: int, ended: float) -> None:
        """An answered request's time to its first token, for the hang bound (with the lock):
        a stream's own; a whole answer's first byte, an upper bound. Its prompt tokens are its
        usage's, and they teach how many tokens a byte holds."""
        prompt = counting.usage["prompt"] if counting.usage is not None else 0
        if prompt and size >= RATIO_BYTES:  # a small body is mostly its JSON's frame
            self._tokens_per_byte = max(self._tokens_per_byte or 0.0, prompt / size)
        tokens = prompt or size * (self._tokens_per_byte or TOKENS_PER_BYTE)
        if counting.first_token is None or not tokens:
            return
        source = STREAMED if counting.stream else WHOLE
        self._measures.append(Measure(source, counting.first_token - started, tokens, ended))


class _Server(ThreadingHTTPServer):
    """A thread per connection, `slots` at most: one more is answered 503 and closed."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, slots: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(slots)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.setblocking(False)  # never wait on that client: the answer fits
                request.send(BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left (an agent killed mid-request: a death, a stop) is no error to
        print on the operator's console; anything else is, as socketserver prints it."""
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class _Reads(socket.SocketIO):
    """A connection's reads, all before `deadline` (monotonic) while one is set: the socket's
    timeout is per read, so a client sending a byte a second held a thread for good."""

    deadline: float | None = None

    def readinto(self, b: Any) -> int | None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the client's request took too long")
            self._sock.settimeout(left)  # type: ignore[attr-defined]
        return super().readinto(b)


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive and chunked, as the agents' clients expect

        def setup(self) -> None:
            super().setup()
            self.connection.settimeout(proxy.client_silence)  # a half-sent request, an idle one
            self.rfile.close()  # unread yet: replaced by one that keeps the deadline
            self._reads = _Reads(self.connection, "rb")
            self.rfile = io.BufferedReader(self._reads)

        def handle_one_request(self) -> None:
            """A request, head and body, within client_silence of its wait's start (an idle
            keep-alive connection's wait included); the answer's writes as before."""
            self._reads.deadline = time.monotonic() + proxy.client_silence
            super().handle_one_request()

        def _read(self) -> None:
            """The request is in: the deadline no longer runs while the answer is relayed."""
            self._reads.deadline = None
            self.connection.settimeout(proxy.client_silence)

        def do_GET(self) -> None:
            self._forward()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the agent's output is the loop's; a proxy line per request is noise

        def _forward(self) -> None:
            found = self._upstream_path()
            body = self._body() if found is not None else None
            self._read()
            if found is None or body is None:
                return
            path, label = found
            headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
            started = time.monotonic()
            request_id = id(self)
            proxy._began(request_id, started, len(body), label)
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
                proxy._ended(request_id, counting, started, failed, label)

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
                    if waiting and not before_first_token(counting):
                        waiting = False  # a first token, or a whole answer's first byte
                        proxy._answered(request_id)
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

        def _upstream_path(self) -> tuple[str, str | None] | None:
            """The path to ask upstream: the request's, past the run's secret segment (an
            origin-form path, so the upstream's address is the only one ever asked), and the
            label of a worker's secret; None, and a 403, for a request that knows neither."""
            segment = "/" + self.path[1:].split("/", 1)[0].split("?", 1)[0]
            given = segment.encode("utf-8", "surrogateescape")  # compared in constant time
            if hmac.compare_digest(given, proxy._secret.encode()):
                return self.path[len(segment) :] or "/", None
            with proxy._lock:
                labels = list(proxy._labels.items())
            found = [label for s, label in labels if hmac.compare_digest(given, s.encode())]
            label = found[0] if found else None
            if label is not None:
                return self.path[len(segment) :] or "/", label
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


def _why(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError) and "refused" not in text.lower():
        text = f"connection failed ({text})"
    return text


def worker_label(worker: int) -> str:
    """The label of worker `worker`'s URL (loop.workers > 1: `url_for`)."""
    return f"worker-{worker}"


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


def variables(plan: Plan, proxy: Proxy | None, label: str | None = None) -> dict[str, Any]:
    """`agent_base_url`: the proxy's URL while it runs (a worker's own: `label`), else the
    direct one (`base_url`)."""
    if proxy is not None:
        return {"agent_base_url": proxy.url if label is None else proxy.url_for(label)}
    direct = plan.variables.get("base_url")
    if plan.model.loop.proxy:
        with contextlib.suppress(Exception):
            direct = upstream_of(plan) or direct
    return {} if direct is None else {"agent_base_url": direct}
