"""What follows a loop from outside: the Prometheus textfile, Apprise notifications and the dead
man's switch, each through a real loop on the stand-in, real Apprise, loopback HTTP receivers."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.e2e import Scenario, make_workspace, runbook
from support.standin import wait_for

from ralph_runner.loop import pause

pytestmark = pytest.mark.timeout(90)

ITEMS = ["add the road", "add the car"]


class Receiver:
    """An HTTP server on 127.0.0.1 that records every request (path, JSON body); with `hang`
    it reads the request and never answers."""

    def __init__(self, hang: bool = False) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.times: list[float] = []  # time.monotonic() of each request, in their order
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._record(None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                self._record(json.loads(body) if body else None)

            def _record(self, body: Any) -> None:
                receiver.requests.append((self.path, body))
                receiver.times.append(time.monotonic())
                if hang:
                    receiver.release.wait(60)
                    return
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"OK")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for receiver in made:
        receiver.close()


def prepare(scenario: Scenario, **extra: Any) -> None:
    """The e2e runbook plus top-level keys (metrics:, notify:)."""
    make_workspace(scenario.workspace, ITEMS)
    data = {**runbook(agent_sleep="0.3"), **extra}
    scenario.runbook_path.write_text(yaml.safe_dump(data, sort_keys=False))
    scenario.standin.start(HEALTH_TIMEOUT="1")


def samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The textfile through prometheus_client's own parser: (name, labels) -> value."""
    found = {}
    for family in text_string_to_metric_families(path.read_text(encoding="utf-8")):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "host"))
            found[(sample.name, labels)] = sample.value
    return found


def test_the_textfile_follows_the_loop_and_says_down_at_exit(
    scenario: Scenario, tmp_path: Path
) -> None:
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    prepare(scenario, metrics={"textfile": str(textdir / "ralph-{{ inventory_hostname }}.prom")})
    path = textdir / "ralph-localhost.prom"
    run = scenario.start()

    run.wait_agent(1)
    assert samples(path)[("ralph_up", ())] == 1.0
    scenario.standin.trigger(die=True)
    run.wait_event("recovery", death=1)
    assert run.wait() == 0, run.stderr

    found = samples(path)
    assert found[("ralph_up", ())] == 0.0
    assert found[("ralph_exit_code", ())] == 0.0
    assert found[("ralph_iterations_total", ())] == 3.0  # two items, one retried
    assert found[("ralph_items", (("state", "done"),))] == 2.0
    assert found[("ralph_items", (("state", "todo"),))] == 0.0
    (phase,) = [labels for name, labels in found if name == "ralph_deaths_total"]
    assert found[("ralph_deaths_total", phase)] == 1.0
    assert found[("ralph_recovery_duration_seconds_count", ())] == 1.0
    assert found[("ralph_recoveries_total", (("outcome", "recovered"),))] == 1.0
    assert found[("ralph_last_death_timestamp_seconds", ())] <= time.time()
    assert [p.name for p in textdir.iterdir()] == ["ralph-localhost.prom"]  # no temp file left


def test_a_missing_textfile_directory_is_an_error_at_check(scenario: Scenario) -> None:
    prepare(scenario, metrics={"textfile": "/nonexistent/dir/ralph.prom"})
    run = scenario.start()
    assert run.wait() == 2
    assert "no such directory for the metrics textfile" in run.stderr
    assert "metrics.textfile" in run.stderr and "runbook.yaml:" in run.stderr


def test_notifications_and_the_dead_mans_switch_reach_their_receivers(
    scenario: Scenario, receivers: list[Receiver]
) -> None:
    hook, switch = Receiver(), Receiver()
    receivers += [hook, switch]
    notify = {
        "to": [
            {
                "url": f"json://127.0.0.1:{hook.port}/hook",
                "events": ["death", "recovered", "finished"],
            }
        ],
        "deadman": f"http://127.0.0.1:{switch.port}/ping/abc",
        "timeout": 5,
    }
    prepare(scenario, notify=notify)
    run = scenario.start()
    run.wait_agent(1)
    scenario.standin.trigger(die=True)
    assert run.wait() == 0, run.stderr

    wait_for(lambda: len(hook.requests) >= 3, 10, "three notifications")
    titles = [body["title"] for _, body in hook.requests]
    assert titles[0].startswith("ralph-run: death #1 on localhost"), titles
    assert titles[1] == "ralph-run: recovered on localhost"
    assert titles[2] == "ralph-run finished on localhost"
    assert "exit code 0" in hook.requests[2][1]["message"]
    paths = switch.paths()
    assert paths[0] == "/ping/abc/start" and paths[-1] == "/ping/abc/0", paths
    assert paths.count("/ping/abc") == 3  # one per iteration


def test_the_switch_is_kept_alive_while_the_loop_is_paused(
    scenario: Scenario, receivers: list[Receiver]
) -> None:
    """No iteration ends during a pause: the switch still hears from the loop, a ping about
    every `deadman_every` s (not faster), and once it is working again no more than one per
    iteration."""
    switch = Receiver()
    receivers.append(switch)
    every = 0.3
    notify = {"deadman": f"http://127.0.0.1:{switch.port}/ping", "deadman_every": every}
    prepare(scenario, notify=notify)
    run = scenario.start()
    run.wait_agent(1)
    pause.request(scenario.workspace)
    run.wait_event("paused")
    at_pause = switch.paths().count("/ping")
    wait_for(lambda: switch.paths().count("/ping") >= at_pause + 3, 10, "pings while paused")
    assert pause.release(scenario.workspace)
    # the loop reads the release at its next look: keep-alives until then are still the pause's
    run.wait_event("resumed")
    released = len(switch.requests)
    assert run.wait() == 0, run.stderr
    paths = switch.paths()
    assert paths[0] == "/ping/start" and paths[-1] == "/ping/0", paths
    pings = [
        t for (path, _), t in zip(switch.requests[:released], switch.times, strict=False)
        if path == "/ping"
    ]  # fmt: skip
    paused = pings[at_pause:]  # the keep-alive pings of the pause (by then at least 3)
    gaps = [later - earlier for earlier, later in itertools.pairwise(paused)]
    assert gaps and min(gaps) >= every * 0.8, gaps  # a ping per `deadman_every`, no flood
    # working again: only the iterations' pings (one each, at most one per item), no keep-alive
    assert paths[released:].count("/ping") <= len(ITEMS), paths[released:]


def test_a_receiver_that_never_answers_never_delays_the_loop(
    scenario: Scenario, receivers: list[Receiver]
) -> None:
    hung = Receiver(hang=True)
    receivers.append(hung)
    notify = {
        "to": [{"url": f"json://127.0.0.1:{hung.port}/hook", "events": ["death", "finished"]}],
        "deadman": f"http://127.0.0.1:{hung.port}/ping",
        "timeout": 1,
        "retries": 0,
    }
    prepare(scenario, notify=notify)
    run = scenario.start()
    run.wait_agent(1)
    scenario.standin.trigger(die=True)
    assert run.wait(timeout=30) == 0, run.stderr
    done = [e for e in run.events if e["event"] in ("iteration", "done")]
    assert len(done) >= 4  # the loop went on while every send hung
    warnings = [e["message"] for e in run.of("warning")]
    assert any("timed out" in w for w in warnings), warnings
    assert any("still unsent at exit" in w for w in warnings), warnings


def test_an_unparsable_apprise_url_is_an_error_at_check(scenario: Scenario) -> None:
    prepare(scenario, notify={"to": [{"url": "nonsense://what"}]})
    run = scenario.start()
    assert run.wait() == 2
    assert "Apprise cannot parse this URL" in run.stderr and "notify.to[0].url" in run.stderr
