"""A step ends when its process ends: a watch probe in flight is handed on, never waited for."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from support.e2e import RalphRun, make_workspace
from support.standin import wait_for

from ralph_runner import probes
from ralph_runner.liveness.health import GRACE, Health, ProbeSpec
from ralph_runner.liveness.step_watch import Watch
from ralph_runner.process.connection import for_host

# What these tests assert: leaving a watch, and going from the agent's exit to the next step,
# does not wait for a probe in flight (its timeout is 2-3 s): each is done within 250 ms, which
# a loaded two-core machine running the whole suite keeps. How fast it is (issue 9 aimed at
# 50 ms) is a measurement, for bench/, not a bound asserted here.
EXIT_TO_NEXT_STEP = 0.250
MARGIN = 0.5


class HangsFirst:
    """A real HTTP server whose first request is never answered (until `close`); every later
    one gets 200. It touches `flag` when the hung request arrives."""

    def __init__(self, flag: Path | None = None) -> None:
        self.requests = 0
        self.hung = threading.Event()
        self._release = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                owner.requests += 1
                if owner.requests == 1:
                    if flag is not None:
                        flag.touch()
                    owner.hung.set()
                    owner._release.wait()
                    return
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/models"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hangs_first(tmp_path):
    server = HangsFirst(tmp_path / "probe-in-flight")
    yield server
    server.close()


def test_leaving_a_watch_does_not_wait_for_its_round_and_the_next_round_takes_it_over(
    hangs_first,
):
    params = probes.KINDS["http"].Params.model_validate({"url": hangs_first.url})
    health = Health([ProbeSpec("models", "http", params, timeout=2.0)], connection=for_host({}))
    try:
        watch = Watch(health, 0.01, iteration=1)
        with watch:
            wait_for(hangs_first.hung.is_set, 10, "the watch's probe in flight")
            in_flight = leaving = time.monotonic()
        left_after = time.monotonic() - leaving

        started = time.monotonic()
        (result,) = health.round(1)  # post-step: the check in flight is handed on
        waited = time.monotonic() - started

        assert left_after < EXIT_TO_NEXT_STEP
        assert watch.rounds is None and not watch.cancel.is_set()
        assert hangs_first.requests == 1  # handed on, not queued behind nor sent again
        assert (result.reason, result.detail) == (
            "timeout",
            f"timed out after 2s (read) (GET {hangs_first.url})",
        )
        assert time.monotonic() - in_flight < 2.0 + GRACE + MARGIN
        assert waited < 2.0 + GRACE
    finally:
        health.close()


def test_the_next_step_starts_within_250_ms_of_the_agents_exit_not_after_a_hung_probe(
    tmp_path, hangs_first
):
    """A real loop: the watch's probe hangs (its timeout 3 s), the agent exits as soon as it is
    in flight; the next step starts within 250 ms of the agent's exit (it used to wait for the
    probe's timeout)."""
    work = make_workspace(tmp_path / "work", ["one item"])
    stamp = tmp_path / "agent-exit"
    flag = tmp_path / "probe-in-flight"
    agent = (
        f"while [ ! -e {flag} ]; do sleep 0.005; done; "
        "sed -i 's/- \\[ \\]/- [x]/' CHECKLIST.md && git commit -qam done && "
        f"date +%s.%N > {stamp}"
    )
    runbook = {
        "health": {
            "probes": [{"name": "models", "http": {"url": hangs_first.url}, "timeout": 3}],
            "watch": 0.02,
            "interval": 0.1,
        },
        "loop": {
            "max_iterations": 1,
            "steps": [
                {"name": "agent", "shell": agent, "timeout": 30},
                {"name": "next", "shell": "true"},
                {"ensure_alive": {"phase": "post-step"}},
                {"verify": {"checked": True, "committed": True}},
            ],
        },
    }
    path = tmp_path / "runbook.yaml"
    path.write_text(yaml.safe_dump(runbook))
    run = RalphRun([sys.executable, "-m", "ralph_runner", str(path), "--json"], work)
    try:
        code = run.wait(60)
    finally:
        run.kill()

    exited = float(stamp.read_text())
    (next_step,) = run.of("step", step="next")
    print(f"agent exit -> next step: {(next_step['time'] - exited) * 1000:.1f} ms")
    assert code == 0, (run.events, run.stderr)
    assert next_step["time"] - exited <= EXIT_TO_NEXT_STEP, json.dumps(run.events, indent=1)
    assert not run.of("death")  # the hung check was handed on, then confirmation passed
    assert hangs_first.requests >= 2
