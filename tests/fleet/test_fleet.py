"""Several hosts from one inventory: a loop per host, each its own process, workdir and state;
one host's give-up never stops another; the worst exit code wins; SIGTERM stops them all."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import AGENT_STEP, RalphRun, make_workspace, processes_in, runbook
from support.standin import START_SCRIPT, StandIn, wait_for

pytestmark = pytest.mark.timeout(120)

ITEMS = ["add the road", "add the car"]


class Fleet:
    """N local hosts, each with its own stand-in server and workspace under one directory."""

    def __init__(self, root: Path, hosts: list[str]) -> None:
        self.root, self.hosts = root, hosts
        self.standins = {h: StandIn(root / "vllm" / h) for h in hosts}
        self.runs: list[RalphRun] = []
        self.runbook_path = root / "runbook.yaml"
        self.inventory_path = root / "inventory.yaml"

    def prepare(self, workdir: str = "work/{{ inventory_hostname }}", **settings: Any) -> Fleet:
        for host in self.hosts:
            make_workspace(self.root / "work" / host, ITEMS)
            self.standins[host].start(HEALTH_TIMEOUT="1")
        data = runbook(**{"agent_sleep": "0.3", **settings})
        data["hosts"] = "gpu"
        data["workdir"] = workdir
        self.runbook_path.write_text(yaml.safe_dump(data, sort_keys=False))
        hosts = {
            host: {
                "ansible_connection": "local",
                "port": standin.port,
                "standin_dir": str(standin.state_dir),
            }
            for host, standin in self.standins.items()
        }
        common = {"standin_start": str(START_SCRIPT), "python": sys.executable}
        inventory = {"all": {"vars": common, "children": {"gpu": {"hosts": hosts}}}}
        self.inventory_path.write_text(yaml.safe_dump(inventory))
        return self

    def start(self, *extra: str) -> RalphRun:
        command = [sys.executable, "-m", "ralph_runner", str(self.runbook_path), "--json"]
        command += ["-i", str(self.inventory_path), *extra]
        run = RalphRun(command, self.root)
        self.runs.append(run)
        return run

    def status(self, host: str) -> dict[str, Any]:
        path = self.root / "work" / host / ".ralph" / "status.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}

    def marks(self, host: str) -> list[str]:
        text = (self.root / "work" / host / "CHECKLIST.md").read_text(encoding="utf-8")
        return [line[3] for line in text.splitlines() if line.startswith("- [")]

    def close(self) -> None:
        for run in self.runs:
            run.kill()
        for standin in self.standins.values():
            standin.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    built = Fleet(tmp_path, ["alpha", "beta", "gamma"])
    try:
        yield built
    finally:
        built.close()


def windows(run: RalphRun) -> dict[str, tuple[float, float]]:
    """Each host's loop, from its first event to its `host-done`, in the fleet's own times."""
    first: dict[str, float] = {}
    for event in run.events:
        if "host" in event:
            first.setdefault(event["host"], event["time"])
    return {e["host"]: (first[e["host"]], e["time"]) for e in run.of("host-done")}


def test_each_host_gets_its_loop_and_the_worst_exit_code_wins(fleet: Fleet) -> None:
    fleet.prepare(attempts=1, delay=0)
    (fleet.standins["gamma"].state_dir / "fail_starts").write_text("5\n")  # gamma cannot restart
    run = fleet.start("--forks", "2")

    wait_for(lambda: fleet.status("beta").get("phase") == AGENT_STEP, 30, "beta's agent")
    fleet.standins["beta"].trigger(die=True)
    # gamma starts only when alpha or beta is done: --forks 2
    wait_for(lambda: fleet.status("gamma").get("phase") == AGENT_STEP, 60, "gamma's agent")
    fleet.standins["gamma"].trigger(die=True)

    assert run.wait(timeout=90) == 4, run.stderr  # gamma gave up: the worst code
    assert all("host" in e for e in run.events if e["event"] not in ("fleet", "fleet-summary"))
    assert fleet.marks("alpha") == ["x", "x"] and fleet.marks("beta") == ["x", "x"]
    assert fleet.marks("gamma") != ["!", "!"]  # a give-up skips nothing
    (summary,) = run.of("fleet-summary")
    rows = {row["host"]: row for row in summary["hosts"]}
    assert {h: rows[h]["exit_code"] for h in rows} == {"alpha": 0, "beta": 0, "gamma": 4}
    assert (rows["beta"]["done"], rows["beta"]["deaths"]) == (2, 1)
    assert rows["gamma"]["deaths"] == 1
    assert [e["host"] for e in run.of("death")] == ["beta", "gamma"]
    assert fleet.status("gamma")["status"] == "gave-up"
    # --forks 2: alpha's and beta's loops ran at once, gamma's began only when one had ended
    spans = windows(run)
    assert set(spans) == {"alpha", "beta", "gamma"}, spans
    assert max(spans["alpha"][0], spans["beta"][0]) < min(spans["alpha"][1], spans["beta"][1])
    assert spans["gamma"][0] >= min(spans["alpha"][1], spans["beta"][1]), spans
    for standin in fleet.standins.values():
        standin.stop()
    assert processes_in(fleet.root) == []


def test_sigterm_stops_every_loop_with_its_state_saved(fleet: Fleet) -> None:
    fleet.prepare(agent_sleep="30", agent_timeout=60, step_timeout=60)
    run = fleet.start()
    for host in fleet.hosts:
        wait_for(lambda h=host: fleet.status(h).get("phase") == AGENT_STEP, 30, f"{host} agent")

    run.send(signal.SIGTERM)
    assert run.wait(timeout=40) == 143, run.stderr
    statuses = {h: fleet.status(h) for h in fleet.hosts}
    assert {s["status"] for s in statuses.values()} == {"interrupted"}, statuses  # "crash" why
    for standin in fleet.standins.values():
        standin.stop()
    assert processes_in(fleet.root) == []


def test_two_hosts_on_one_workdir_are_refused_at_check(fleet: Fleet) -> None:
    fleet.prepare(workdir="work/alpha")
    run = fleet.start("--check")
    assert run.wait() == 2
    workdir = fleet.root / "work" / "alpha"
    said = f"hosts 'alpha' and 'beta' resolve to the same workdir {workdir}"
    assert said in run.stderr, run.stderr  # the first two hosts that share it, and the folder


@pytest.mark.parametrize("forks", ["0", "-1", "many"])
def test_forks_must_be_a_positive_number(fleet: Fleet, forks: str) -> None:
    fleet.prepare()
    run = fleet.start("--check", "--forks", forks)
    assert run.wait() == 2
    assert "--forks" in run.stderr and "at least 1" in run.stderr
