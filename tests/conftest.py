"""Fixtures shared by the test modules (helpers live in *_helpers.py beside them), and the tiers.

Every test belongs to one tier (its marker, given here from where it lives): `unit` (pure
functions, no process started: the inner loop, `pytest -m unit`), `system` (real processes on
loopback: the default), and the tiers that need an install: `ssh`, `browser`, `promtool`,
`docker`, `agents`, `real`. The run ends with a table of the tiers: ran, skipped and why. Under
`CI=true` a tier that skipped fails the run unless `RALPH_ALLOW_SKIP` names it (`tier: reason;
...`), so a green CI means every tier ran.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the *_helpers modules, for every folder
from e2e_helpers import RalphRun, Scenario

TIERS = ("unit", "system", "ssh", "browser", "promtool", "docker", "agents", "real")
UNIT_MODULES = {  # no server, no ralph-run, no ansible: the tier a developer runs at every save
    "test_templating", "test_runbook_errors", "test_inventory", "test_plugins", "test_checklist",
    "test_signatures", "test_output", "test_death_log", "test_failure_causes",
    "test_limit_patterns", "test_no_mirror_hosts",
}  # fmt: skip
# A test of a unit module marked `system` starts a program (ralph-run, ansible, a second Python)
# and runs in the system tier.
SSH_MODULES = {"test_remote", "test_fleet_status", "test_deploy"}
_outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_skip_reasons: dict[str, set[str]] = defaultdict(set)
_seconds: dict[str, float] = defaultdict(float)  # setup + call + teardown, per tier


def tier_of(item: pytest.Item) -> str:
    path = Path(str(item.path))
    folder, module = path.parent.name, path.stem
    if folder in ("real", "agents", "docker"):
        return folder
    if module == "test_report_in_a_browser":
        return "browser"
    if module == "test_alerts":
        return "promtool"
    if module in SSH_MODULES or "sshd" in getattr(item, "fixturenames", ()):
        return "ssh"
    in_unit = module in UNIT_MODULES and not item.get_closest_marker("system")
    return "unit" if in_unit else "system"


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/conftest.py)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m unit` does not import the other tiers' modules at all: collecting every module took
    9 s of the unit tier's run, the unit modules alone take a fraction of it."""
    if config.getoption("markexpr") != "unit" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return True if collection_path.stem not in UNIT_MODULES else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = next((t for t in TIERS if t in report.keywords), "system")
    _seconds[tier] += report.duration
    if report.skipped:
        _outcomes[tier]["skipped"] += 1
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skip_reasons[tier].add(reason.removeprefix("Skipped: "))
    elif report.when == "call":
        _outcomes[tier]["passed" if report.passed else "failed"] += 1
    elif report.failed:
        _outcomes[tier]["failed"] += 1


def _allowed_skips() -> dict[str, str]:
    pairs = (part.split(":", 1) for part in os.environ.get("RALPH_ALLOW_SKIP", "").split(";"))
    return {
        tier.strip(): why.strip() for tier, *rest in pairs if tier.strip() for why in rest or [""]
    }


def _unexplained_skips() -> list[str]:
    if os.environ.get("CI") != "true":
        return []
    allowed = _allowed_skips()
    return [tier for tier, counts in _outcomes.items() if counts["skipped"] and tier not in allowed]


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not _outcomes:
        return
    write = terminalreporter.write_line
    terminalreporter.section("tiers")
    allowed = _allowed_skips()
    for tier in TIERS:
        counts = _outcomes.get(tier)
        if not counts:
            continue
        ran = counts["passed"] + counts["failed"]
        line = f"{tier:9} ran {ran:4} ({counts['failed']} failed)  skipped {counts['skipped']:4}"
        line += f"  {_seconds[tier]:7.1f} s"
        if counts["skipped"]:
            why = allowed.get(tier) or "; ".join(sorted(_skip_reasons[tier]))[:160]
            line += f"  why: {why}"
        write(line)
    for tier in _unexplained_skips():
        write(f"CI: the {tier} tier skipped and RALPH_ALLOW_SKIP does not name it: failing the run")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexplained_skips() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def no_ralph_run_left() -> Iterator[None]:
    """A test that fails half-way leaves no ralph-run behind. One that was left went on
    recovering the real engine after the session's teardown had stopped it, and left a vLLM
    server that nothing stopped."""
    yield
    while RalphRun.started:
        RalphRun.started.pop().kill()


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Scenario]:
    """A workspace, a stand-in server and a runbook under tmp_path; whatever still runs at the
    end (a failed test's ralph-run, its server) is killed."""
    built = Scenario(tmp_path)
    try:
        yield built
    finally:
        built.close()
