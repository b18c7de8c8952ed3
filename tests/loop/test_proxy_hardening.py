"""Issue 29, finding 4, written as the attack and the broken peers: the loop's agent proxy on
127.0.0.1 (every local user can reach it) against raw request lines on a socket.

- without the run's secret path segment: 403, nothing forwarded;
- an absolute-form or userinfo request line (`GET @127.0.0.2:PORT/`): refused, and the other
  address never asked;
- a Content-Length of `abc` or `-1`: 400, no traceback; a 200 MiB one: 413, nothing read;
- a half-sent request: its connection (and thread) dropped after the client silence;
- an upstream that answers headers and then stops sending: the request is cut after the
  upstream silence, and the in-flight count goes back to 0.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import urlsplit

import pytest
from support.standin import wait_for

from ralph_runner.loop.proxy import Proxy


class Upstream(BaseHTTPRequestHandler):
    """Answers /v1/models at once; /v1/silent sends its headers and then nothing, ever."""

    protocol_version = "HTTP/1.1"
    asked: ClassVar[list[str]] = []  # each server gets a subclass with its own list

    def do_GET(self) -> None:
        type(self).asked.append(self.path)
        if self.path == "/v1/silent":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            time.sleep(30)
            return
        data = b'{"data": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(host: str) -> ThreadingHTTPServer:
    handler = type("Asked", (Upstream,), {"asked": []})
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def upstream() -> Iterator[ThreadingHTTPServer]:
    server = serve("127.0.0.1")
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def elsewhere() -> Iterator[ThreadingHTTPServer]:
    """Another local address the request line must never reach."""
    server = serve("127.0.0.2")
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(upstream) -> Iterator[Proxy]:
    port = upstream.server_address[1]
    with Proxy(f"http://127.0.0.1:{port}/v1", client_silence=1.0, upstream_silence=1.5) as p:
        yield p


def raw(proxy: Proxy, request: bytes, timeout: float = 5.0) -> bytes:
    """`request` as it is on a socket to the proxy; whatever it answers until it closes."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout) as sock:
        sock.sendall(request)
        answer = b""
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def secret(proxy: Proxy) -> str:
    return urlsplit(proxy.url).path.removesuffix("/v1")


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_the_run_s_own_url_is_forwarded(proxy, upstream):
    answer = raw(
        proxy, f"GET {secret(proxy)}/v1/models HTTP/1.1\r\nConnection: close\r\n\r\n".encode()
    )
    assert status(answer) == 200 and answer.endswith(b'{"data": []}'), answer
    assert upstream.RequestHandlerClass.asked == ["/v1/models"]


def test_a_request_without_the_secret_is_refused(proxy, upstream):
    answer = raw(proxy, b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert status(answer) == 403, answer
    assert upstream.RequestHandlerClass.asked == []


@pytest.mark.parametrize(
    "form", ["@127.0.0.2:{port}/v1/models", "http://127.0.0.2:{port}/v1/models"]
)
def test_an_absolute_form_or_userinfo_line_reaches_no_other_address(proxy, elsewhere, form):
    target = form.format(port=elsewhere.server_address[1])
    for line in (target, f"{secret(proxy)}{target}"):
        answer = raw(proxy, f"GET {line} HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
        assert status(answer) == 403, (line, answer)
    assert elsewhere.RequestHandlerClass.asked == []


@pytest.mark.parametrize(("length", "code"), [("abc", 400), ("-1", 400), (str(200 * 2**20), 413)])
def test_a_bad_or_huge_content_length_is_refused(proxy, upstream, length, code):
    head = f"POST {secret(proxy)}/v1/chat/completions HTTP/1.1\r\nContent-Length: {length}\r\n\r\n"
    answer = raw(proxy, head.encode() + b"{}")
    assert status(answer) == code, answer
    assert upstream.RequestHandlerClass.asked == []


def test_a_half_sent_request_is_dropped_after_the_client_silence(proxy):
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"POST {secret(proxy)}/v1/x HTTP/1.1\r\nContent-Len".encode())
        started = time.monotonic()
        assert sock.recv(1024) == b""  # the proxy closed it
        assert time.monotonic() - started < proxy.client_silence + 2


def test_a_silent_upstream_is_cut_and_the_in_flight_count_comes_back(proxy):
    line = f"GET {secret(proxy)}/v1/silent HTTP/1.1\r\nConnection: close\r\n\r\n".encode()
    reader = threading.Thread(target=raw, args=(proxy, line, 10.0), daemon=True)
    reader.start()
    wait_for(lambda: proxy.in_flight() == 1, 5, "the request in flight")
    started = time.monotonic()
    wait_for(lambda: proxy.in_flight() == 0, 10, "the silent upstream's request to be cut")
    assert time.monotonic() - started < 1.5 + 2
    assert proxy.totals().errors == 1


def test_a_trickling_client_is_dropped_at_the_whole_request_s_deadline(proxy):
    """A byte every 0.4 s, under the 1 s silence each: the read was per byte, so the thread was
    held for good (issue 37); the whole request has client_silence now."""
    head = f"POST {secret(proxy)}/v1/chat/completions HTTP/1.1\r\nContent-Length: 999\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for byte in head.encode() + b"x" * 40:
                sock.sendall(bytes([byte]))
                readable, _, _ = select.select([sock], [], [], 0.4)
                if readable and sock.recv(1024) == b"":
                    break  # the proxy closed it
                if time.monotonic() - started > 8:
                    break
        dropped = time.monotonic() - started
    assert dropped < proxy.client_silence + 2, dropped


def test_connections_past_the_cap_get_a_503_at_once(upstream):
    port = upstream.server_address[1]
    with Proxy(f"http://127.0.0.1:{port}/v1", client_silence=5.0, max_clients=3) as proxy:
        idle = [socket.create_connection(("127.0.0.1", proxy.port), timeout=5) for _ in range(3)]
        try:
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as extra:
                answer = extra.recv(1024)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert time.monotonic() - started < 2
        finally:
            for sock in idle:
                sock.close()
        line = f"GET {secret(proxy)}/v1/models HTTP/1.1\r\nConnection: close\r\n\r\n".encode()
        wait_for(lambda: status(raw(proxy, line)) == 200, 5, "a slot freed by a closed client")
