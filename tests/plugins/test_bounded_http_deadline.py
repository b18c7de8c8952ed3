"""A server that sends one header line at a time (issue 37, lower findings): httpx's read
timeout is per read, so `bounded_http.fetch` (the probes', the governor's, the recorder's and
the idle watch's reads) waited for as long as the lines came. Its deadline now covers the
headers: a real trickling server on 127.0.0.1, on a new connection and on a reused one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from ralph_runner.plugins.bounded_http import fetch

pytestmark = pytest.mark.timeout(60)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class Trickler:
    """Answers GET /ok at once (keep-alive) and GET /slow with a header line every 0.2 s,
    never ending them, until stopped."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.lines = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while not self.stop.is_set():
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                head, data = data.split(b"\r\n\r\n", 1)
                if b" /ok " in head.split(b"\r\n")[0]:
                    conn.sendall(OK)
                    continue
                try:
                    conn.sendall(b"HTTP/1.1 200 OK\r\n")
                    while not self.stop.wait(0.2):
                        conn.sendall(b"X-Slow: %d\r\n" % self.lines)
                        self.lines += 1
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    server = Trickler()
    yield server
    server.close()


def _timed(client: httpx.Client, url: str, timeout: float) -> tuple[float, BaseException | None]:
    """How long `fetch` took, and what it raised; run in a thread given 8 s, so that a fetch
    that never returns fails the test instead of hanging it."""
    result: list[tuple[float, BaseException | None]] = []

    def run() -> None:
        started = time.monotonic()
        try:
            fetch(client, "GET", url, timeout=timeout)
        except BaseException as err:
            result.append((time.monotonic() - started, err))
        else:
            result.append((time.monotonic() - started, None))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(8)
    assert result, "fetch was still reading headers 8 s into a 1 s deadline"
    return result[0]


@pytest.mark.parametrize("reused", [False, True])
def test_a_header_line_a_second_does_not_hold_fetch(trickler: Trickler, reused: bool) -> None:
    base = f"http://127.0.0.1:{trickler.port}"
    with httpx.Client() as client:
        if reused:  # a keep-alive connection that answered well before
            assert fetch(client, "GET", f"{base}/ok", timeout=1).text == "ok"
        took, raised = _timed(client, f"{base}/slow", timeout=1.0)
    assert isinstance(raised, httpx.TimeoutException), raised
    assert "headers took over 1 s" in str(raised)
    assert 0.9 < took < 2.0, took
    assert trickler.lines >= 3  # it did trickle: each line came well within a read timeout


def test_a_quick_answer_is_unchanged(trickler: Trickler) -> None:
    with httpx.Client() as client:
        response = fetch(client, "GET", f"http://127.0.0.1:{trickler.port}/ok", timeout=1)
    assert (response.status_code, response.text) == (200, "ok")
