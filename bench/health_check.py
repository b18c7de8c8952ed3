"""`python -m bench.health_check`: the cost of a healthy check on the reused HTTP connection.

The healthy path must stay a reused connection, milliseconds (no process spawned): the median
of 200 `Health.check()` rounds of one http probe against the stand-in, beside the median of a
bare httpx GET on the same kept-alive client in the same run (the floor it cannot beat).
(Was a test that measured and asserted nothing: tests/liveness/test_health.py.)
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from ralph_runner.liveness.health import Health, ProbeSpec
from ralph_runner.probes.http import Params
from ralph_runner.process.connection import Local

ROUNDS = 200


def main() -> int:
    with tempfile.TemporaryDirectory() as state, socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
        probe_port.close()
        command = [sys.executable, "-m", "ralph_runner.standin.server"]
        server = subprocess.Popen(
            [*command, "--port", str(port), "--state-dir", state],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = _up(f"http://127.0.0.1:{port}")
            spec = ProbeSpec("models", "http", Params(url=f"{url}/v1/models"), timeout=3)
            with Health([spec], connection=Local()) as health, httpx.Client() as client:
                checks = [_timed(lambda i=i: health.check(i)) for i in range(1, ROUNDS + 1)]
                gets = [_timed(lambda: client.get(f"{url}/v1/models")) for _ in range(ROUNDS)]
        finally:
            server.terminate()
            server.wait(10)
    check, get = statistics.median(checks) * 1000, statistics.median(gets) * 1000
    print(f"median Health.check(): {check:.2f} ms; bare GET on a kept-alive client: {get:.2f} ms")
    print(f"ratio: {check / get:.2f}x")
    return 0


def _timed(call) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _up(url: str) -> str:
    """`url` once the stand-in answers its /health."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit("the stand-in did not start")


if __name__ == "__main__":
    raise SystemExit(main())
