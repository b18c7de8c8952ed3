"""Issue 29, finding 3, written as the broken server: every read ralph-run makes from a server
has a size cap and a deadline (plugins/bounded_http.py).

- an endless /metrics (it streams for ever): `ralph-run probe` cuts it at the cap, within its
  timeout, and its peak memory stays under MEMORY_BOUND (it took 951 MiB in 2.9 s before);
- a trickling /metrics (a byte every 0.2 s, for ever): the check itself ends as a timeout
  within its own timeout (httpx's read timeout never fires: a byte always comes);
- a loop whose flight recorder samples the trickling /metrics keeps iterating and ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from support.e2e import Scenario
from support.standin import python_env

from ralph_runner.probes import ProbeContext, ProbeResult, progress, run_probe
from ralph_runner.process.connection import for_host

MEMORY_BOUND = 200 * 1024 * 1024  # bytes of peak RSS for `ralph-run probe` (it starts at ~60)
PROBE_TIMEOUT = 2.0
SLACK = 3.0  # s: ralph-run's start (about 1 s) and a loaded two-core machine


class Broken(BaseHTTPRequestHandler):
    """/endless streams a metrics-like body for ever; /trickle sends a byte every 0.2 s."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        line = b"vllm:num_requests_running 0\n" * 2000
        try:
            while True:
                data = line if self.path == "/endless" else b"#"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                if self.path != "/endless":
                    time.sleep(0.2)
        except OSError:
            return  # the client went away

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def broken() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def probe_runbook(tmp_path: Path, metrics: str) -> Path:
    runbook = tmp_path / "runbook.yaml"
    probe = {"name": "engine progress", "progress": {"metrics": metrics}}
    runbook.write_text(
        json.dumps(
            {
                "workdir": str(tmp_path),
                "health": {"probes": [{**probe, "timeout": PROBE_TIMEOUT}]},
                "loop": {"steps": [{"shell": "true"}]},
            }
        )
    )
    return runbook


def probe(runbook: Path) -> tuple[int, dict, float, int]:
    """`ralph-run probe RUNBOOK --json` (one JSON line, the probe's result): exit code, the
    result, seconds, peak RSS in bytes (the child's own, from wait4)."""
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "ralph_runner", "probe", str(runbook), "--json"],
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    out, err = child.stdout.read(), child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - started
    assert out, err
    return child.returncode, json.loads(out), seconds, usage.ru_maxrss * 1024


def test_an_endless_metrics_is_cut_and_memory_stays_bounded(broken, tmp_path):
    code, result, seconds, peak = probe(probe_runbook(tmp_path, f"{broken}/endless"))

    assert code != 0 and result["ok"] is False, result
    # cut at the cap (16 MiB come in well under a second on loopback), not a timeout: a read
    # without its cap would also end at the deadline, with a timeout, having held all it read
    assert "KiB: cut" in result["detail"] and result["reason"] != "timeout", result
    assert seconds < PROBE_TIMEOUT + SLACK, seconds
    assert peak < MEMORY_BOUND, f"peak RSS {peak / 2**20:.0f} MiB"


def test_a_trickling_metrics_ends_the_check_itself_within_its_timeout(broken):
    """The check itself ends (not only the round that waits for it: a check left reading for
    ever holds its probe's worker, and every later round fails as "still hung")."""
    params = progress.Params.model_validate({"metrics": f"{broken}/trickle"})
    done: list[ProbeResult] = []
    with httpx.Client() as client:
        ctx = ProbeContext(client, for_host({}), PROBE_TIMEOUT)
        check = threading.Thread(
            target=lambda: done.append(run_probe("p", "progress", params, ctx)), daemon=True
        )
        started = time.monotonic()
        check.start()
        check.join(PROBE_TIMEOUT + SLACK)
    assert done, f"the check still reads after {time.monotonic() - started:.1f} s"
    assert (done[0].ok, done[0].reason) == (False, "timeout"), done[0]
    assert done[0].seconds < PROBE_TIMEOUT + 1, done[0]


def test_a_loop_keeps_iterating_beside_a_trickling_recorder_scrape(scenario: Scenario, broken):
    items = ["one", "two", "three"]
    scenario.prepare(items)
    book = yaml.safe_load(scenario.runbook_path.read_text())
    book["recorder"] = {
        "url": f"{broken}/trickle",
        "metrics": ["vllm:num_requests_running"],
        "period": 0.5,
    }
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))

    run = scenario.start()
    code = run.wait(60)

    assert code == 0, (run.events[-5:], run.stderr)
    assert scenario.marks() == ["x"] * len(items)
    assert [e["item"] for e in run.of("iteration")] == items
