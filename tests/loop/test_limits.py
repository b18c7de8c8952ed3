"""Usage limits end to end: an agent that hit its provider's limit is waited out (no strike, no
broken agent), a reset beyond `limits.max_wait` stops the run with exit 7 and says when to come
back, a 429's Retry-After is honoured, and SIGTERM ends the wait at once.

`ralph-run` runs as a subprocess on a real git repository (tests/loop/test_loop.py's `Loop`);
the agents are small scripts written here, printing what claude and an OpenAI-compatible
endpoint print. Resets are 20 s away, the margin 2 s: every wait is polled, none is a sleep.
"""

from __future__ import annotations

import http.server
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.standin import wait_for
from test_loop import Loop, events, of_kind

from ralph_runner.loop import limits

pytestmark = pytest.mark.timeout(90)

MARGIN = 2
RESET_IN = 8  # s to a limit's reset: the loop must be seen waiting, and wait it out

# claude -p at its usage limit until the epoch in $3 (written at the first call), then it works.
CLAUDE = r"""#!/bin/bash
log=$1 item=$2 stamp=$3 ahead=$4
echo "$(date +%s.%N) $item" >> "$log"
[ -e "$stamp" ] || echo $(( $(date +%s) + ahead )) > "$stamp"
reset=$(cat "$stamp")
if [ "$(date +%s)" -lt "$reset" ]; then
  echo "Claude AI usage limit reached|$reset"
  exit 1
fi
sed -i '0,/^- \[ \] /s//- [x] /' CHECKLIST.md
git commit -qam "done: $item"
"""

# An agent on an OpenAI-compatible endpoint: a 429 is printed with its Retry-After, exit 1.
HTTP_AGENT = r"""#!PYTHON
import pathlib, re, subprocess, sys, time, urllib.error, urllib.request
log, item, url = sys.argv[1:4]
with open(log, "a") as f:
    f.write(f"{time.time()} {item}\n")
request = urllib.request.Request(url, data=b'{"model": "m"}', method="POST")
try:
    urllib.request.urlopen(request, timeout=5).read()
except urllib.error.HTTPError as exc:
    print(f"Error: {exc.code} {exc.reason}: {exc.read().decode()}")
    print(f"Retry-After: {exc.headers.get('Retry-After')}")
    sys.exit(1)
checklist = pathlib.Path("CHECKLIST.md")
checklist.write_text(re.sub(r"^- \[ \] ", "- [x] ", checklist.read_text(), count=1, flags=re.M))
subprocess.run(["git", "commit", "-qam", f"done: {item}"], check=True)
"""


def setup(loop: Loop, script: str, items: list[str], args: str = "", **changes: Any) -> Loop:
    agent = loop.root / "agent.sh"
    agent.write_text(script.replace("PYTHON", sys.executable))
    agent.chmod(0o755)
    step = {"name": "agent", "shell": "{{ agent }} {{ log }} {{ item.text }} " + args}
    steps = {"loop": {"steps": [{**step, "timeout": 20}, {"verify": {"committed": True}}]}}
    return loop.setup(items, **{**steps, **changes})


def agent_calls(loop: Loop) -> list[tuple[float, str]]:
    log = loop.root / "agent.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [(float(when), item) for when, item in (line.split(" ", 1) for line in lines)]


def status(loop: Loop) -> dict[str, Any]:
    try:
        return json.loads(loop.status_path.read_text())
    except (OSError, ValueError):
        return {}


def history(loop: Loop) -> list[str]:
    path = loop.work / ".ralph" / "iterations.jsonl"
    return [json.loads(line)["outcome"] for line in path.read_text().splitlines()]


@pytest.fixture
def loop(tmp_path) -> Iterator[Loop]:
    workspace = Loop(tmp_path, f"m{uuid.uuid4().hex[:12]}")
    yield workspace
    assert workspace.close() == [], "a test left agent processes behind"


def test_a_claude_usage_limit_is_waited_out_with_no_strike(loop):
    # strikes: 1, so a limit counted as a failure would skip the first item and call the second
    # one's limit a broken agent (exit 6)
    stamp = loop.root / "reset"
    setup(
        loop,
        CLAUDE,
        ["first thing", "second thing"],
        args=f"{stamp} {RESET_IN}",
        checklist={"strikes": 1},
        limits={"margin": MARGIN},
    )
    process = loop.start()
    waiting = wait_for(lambda: status(loop).get("limited_until") and status(loop), 20, "a wait")
    reset = int(stamp.read_text())
    assert waiting["limited_until"] == pytest.approx(reset + MARGIN)
    assert waiting["limited"]["source"] == "claude" and waiting["item"] == "first thing"
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err

    calls = agent_calls(loop)
    assert [item for _, item in calls] == ["first thing", "first thing", "second thing"]
    # waited out, not retried: the call that hit the limit is the only one before its reset
    assert [t for t, _ in calls if t < reset] == [calls[0][0]], (reset, calls)
    resumed = calls[1][0]
    assert reset <= resumed <= reset + 15, (reset, resumed)
    all_events = events(out)
    (limited,) = of_kind(all_events, "limited")
    assert limited["item"] == "first thing" and limited["source"] == "claude"
    assert limited["line"] == f"Claude AI usage limit reached|{reset}"
    assert limited["reset_at"] == reset and limited["until"] == reset + MARGIN
    assert 0 < limited["seconds"] <= RESET_IN + MARGIN and not limited["ends_run"]
    assert limited["reset"] == limits.when(reset)
    for kind in ("strike", "skip", "agent-broken"):
        assert not of_kind(all_events, kind), kind
    assert [d["item"] for d in of_kind(all_events, "done")] == ["first thing", "second thing"]
    assert "- [x] first thing\n- [x] second thing\n" in loop.checklist()
    saved = loop.state()
    assert saved["status"] == "finished" and saved["strikes"] == {} and saved["limited"] is None
    assert saved["last_failure"] is None
    assert status(loop)["limited_until"] is None
    assert history(loop) == ["limited", "done", "done"]


def test_a_reset_beyond_max_wait_stops_with_exit_7_and_says_when(loop):
    stamp = loop.root / "reset"
    textfile = loop.root / "ralph.prom"
    setup(
        loop,
        CLAUDE,
        ["first thing"],
        args=f"{stamp} 7200",
        limits={"max_wait": 3600},
        metrics={"textfile": str(textfile)},
    )
    done = loop.run()
    assert done.returncode == 7, done.stderr
    reset = int(stamp.read_text())
    assert f"it resets at {limits.when(reset)}" in done.stderr
    assert f"Run again after {limits.when(reset + 10)}" in done.stderr
    assert "Claude AI usage limit reached" in done.stderr and "Traceback" not in done.stderr
    (limited,) = of_kind(events(done.stdout), "limited")
    assert limited["ends_run"] and limited["exit_code"] == 7 and limited["reset_at"] == reset
    assert not of_kind(events(done.stdout), "strike")
    assert len(agent_calls(loop)) == 1 and "- [ ] first thing" in loop.checklist()
    saved = loop.state()
    assert saved["status"] == "limited" and saved["strikes"] == {}
    assert saved["limited"]["until"] == reset + 10
    assert status(loop)["limited_until"] == reset + 10
    metrics = {
        sample.name: sample.value
        for family in text_string_to_metric_families(textfile.read_text())
        for sample in family.samples
    }
    assert metrics["ralph_limited_until_timestamp_seconds"] == reset + 10
    assert metrics["ralph_exit_code"] == 7
    shown = loop.command("status", str(loop.work)).stdout
    assert "not running (limited)" in shown
    assert f"limited:    until {limits.when(reset + 10)} (claude: Claude AI usage" in shown


class TooManyRequests(http.server.BaseHTTPRequestHandler):
    """429 with Retry-After for the first request, 200 afterwards."""

    requests: list[float]
    retry_after = str(RESET_IN)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append(time.time())
        limited = len(self.requests) == 1
        body = (
            b'{"error": {"message": "Rate limit exceeded", "type": "rate_limit_error"}}'
            if limited
            else b'{"choices": []}'
        )
        self.send_response(429 if limited else 200)
        if limited:
            self.send_header("Retry-After", self.retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[tuple[str, list[float]]]:
    requests: list[float] = []
    handler = type("Handler", (TooManyRequests,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions", requests
    finally:
        server.shutdown()
        server.server_close()


def test_a_429_retry_after_is_honoured(loop, endpoint):
    url, requests = endpoint
    setup(
        loop,
        HTTP_AGENT,
        ["first thing", "second thing"],
        args=url,
        checklist={"strikes": 1},
        limits={"margin": MARGIN},
    )
    done = loop.run()
    assert done.returncode == 0, done.stderr
    (limited,) = of_kind(events(done.stdout), "limited")
    assert limited["source"] == "http-429" and limited["line"].startswith("Error: 429 Too Many")
    assert limited["reset_at"] == pytest.approx(requests[0] + RESET_IN, abs=2)
    assert not of_kind(events(done.stdout), "strike")
    calls = agent_calls(loop)
    assert [item for _, item in calls] == ["first thing", "first thing", "second thing"]
    assert RESET_IN <= calls[1][0] - calls[0][0] <= RESET_IN + 15
    assert len(requests) == 3


def test_sigterm_ends_the_wait_at_once(loop):
    stamp = loop.root / "reset"
    setup(loop, CLAUDE, ["first thing"], args=f"{stamp} 600")
    process = loop.start()
    wait_for(lambda: status(loop).get("limited_until"), 20, "a wait")
    asked = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=20)
    assert process.returncode == 143, err
    assert time.monotonic() - asked < 10
    assert of_kind(events(out), "interrupted")
    saved = loop.state()
    assert saved["status"] == "interrupted" and saved["strikes"] == {}
    assert status(loop)["limited_until"] is None
    assert len(agent_calls(loop)) == 1
