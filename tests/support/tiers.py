"""The tiers: each test's marker given from where it lives, the table of the tiers at the end of
the run, and CI's rule that a green run means every tier ran (tests/conftest.py says how).
Loaded as a pytest plugin by tests/conftest.py's `pytest_plugins`."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

TIERS = ("unit", "system", "ssh", "browser", "promtool", "docker", "agents", "real", "llamacpp",
    "slurm")  # fmt: skip
UNIT_MODULES = {  # no server, no ralph-run, no ansible: the tier a developer runs at every save
    "test_templating", "test_runbook_errors", "test_inventory", "test_plugins", "test_checklist",
    "test_signatures", "test_output", "test_death_log", "test_failure_causes",
    "test_limit_patterns", "test_no_mirror_hosts", "test_json_events", "test_iteration",
    "test_status_file", "test_typed_files", "test_claude_limits", "test_governor_policy",
    "test_extra_vars", "test_fault_classes", "test_first_token_pace", "test_item_blame",
    "test_signs", "test_slurm_script",
}  # fmt: skip
# A test of a unit module marked `system` starts a program (ralph-run, ansible, a second Python)
# and runs in the system tier.
SSH_MODULES = {
    "test_remote",
    "test_fleet_status",
    "test_deploy",
    "test_remote_paths",
    "test_host_keys",
}
# The tiers that need an install, and which of their tests need it (its real binary): "all", or
# "marked": only a test that carries the tier's marker itself (its module's pytestmark, a
# parameter's marks); the rest of such a tier (test_real_faithful's [stand-in] halves, the
# agents' recipes and scripted stand-in) needs nothing and runs anywhere.
INSTALL_TIERS = {
    "ssh": "all", "browser": "all", "promtool": "all", "docker": "all",
    "agents": "marked", "real": "marked", "llamacpp": "all", "slurm": "all",
}  # fmt: skip
NEEDS_INSTALL = "needs_install"  # the marker given here to a test that needs its tier's install
_outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_skip_reasons: dict[str, set[str]] = defaultdict(set)
_seconds: dict[str, float] = defaultdict(float)  # setup + call + teardown, per tier
# Under CI: per tier, the tests that need its install and ran, or skipped with an excuse; and
# the skips no RALPH_ALLOW_SKIP entry excuses (their reasons).
_needing: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_unexcused: dict[str, list[str]] = defaultdict(list)
_excuses: dict[str, set[str]] = defaultdict(set)  # the entries that excused a skip, per tier
_selected: list[str] = list(TIERS)  # the tiers this run's `-m` selects (RALPH_EVERY_TIER)


def tier_of(item: pytest.Item) -> str:
    path = Path(str(item.path))
    folder, module = path.parent.name, path.stem
    if folder in ("real", "agents", "docker", "llamacpp", "slurm"):
        return folder
    if module == "test_report_in_a_browser":
        return "browser"
    if module == "test_alerts":
        return "promtool"
    if module in SSH_MODULES or "sshd" in getattr(item, "fixturenames", ()):
        return "ssh"
    in_unit = module in UNIT_MODULES and not item.get_closest_marker("system")
    return "unit" if in_unit else "system"


def needs_install(item: pytest.Item, tier: str) -> bool:
    """Whether the test needs its tier's install (asked before the tier's marker is added)."""
    which = INSTALL_TIERS.get(tier)
    return which == "all" or (which == "marked" and item.get_closest_marker(tier) is not None)


def selected_tiers(markexpr: str) -> list[str]:
    """The tiers that a `-m` expression selects (all of them without one): under
    RALPH_EVERY_TIER each must run a test. tests/run's two parts select two halves of them."""
    if not markexpr.strip():
        return list(TIERS)
    expression = Expression.compile(markexpr)
    return [tier for tier in TIERS if expression.evaluate(lambda name, t=tier, **_: name == t)]


def pytest_configure(config: pytest.Config) -> None:
    _selected[:] = selected_tiers(config.getoption("markexpr") or "")
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/support/tiers.py)")
    config.addinivalue_line(
        "markers", f"{NEEDS_INSTALL}: the test needs its tier's install (tests/support/tiers.py)"
    )


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
        tier = tier_of(item)
        if needs_install(item, tier):
            item.add_marker(NEEDS_INSTALL)
        item.add_marker(tier)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = next((t for t in TIERS if t in report.keywords), "system")
    needing = NEEDS_INSTALL in report.keywords
    _seconds[tier] += report.duration
    if report.skipped:
        _outcomes[tier]["skipped"] += 1
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        _skip_reasons[tier].add(reason)
        excuse = excuse_for(tier, reason)
        if excuse is None:
            _unexcused[tier].append(reason)
        else:
            _excuses[tier].add(excuse)
            _needing[tier]["excused"] += needing
    elif report.when == "call":
        _outcomes[tier]["passed" if report.passed else "failed"] += 1
        _needing[tier]["ran"] += needing
    elif report.failed:
        _outcomes[tier]["failed"] += 1


def allowed_skips(value: str | None = None) -> dict[tuple[str, str], str]:
    """RALPH_ALLOW_SKIP (or `value`) as {(tier, what): why}: entries `tier/what: why`, `;` apart.
    An entry with no `/what` names nothing that is missing, and excuses no test."""
    value = os.environ.get("RALPH_ALLOW_SKIP", "") if value is None else value
    allowed = {}
    for entry in value.split(";"):
        name, _, why = entry.partition(":")
        tier, _, what = name.strip().partition("/")
        if tier and what.strip():
            allowed[(tier, what.strip())] = why.strip()
    return allowed


def excuse_for(tier: str, reason: str, value: str | None = None) -> str | None:
    """The RALPH_ALLOW_SKIP entry (`tier/what: why`) that excuses a skip of `tier` with `reason`:
    one whose `what` the reason's head (before its first ": ") names as a word, any case. None
    when none does. "opencode not installed at .cache/...: install-agents: ... could not: npm
    install opencode-ai ... failed" is excused by `agents/opencode`, not by `agents/aider`."""
    head = reason.split(": ", 1)[0]
    for (allowed_tier, what), why in allowed_skips(value).items():
        named = re.search(rf"(?<![\w-]){re.escape(what)}(?![\w-])", head, re.IGNORECASE)
        if allowed_tier == tier and named:
            return f"{allowed_tier}/{what}: {why}"
    return None


def ci_failures() -> list[str]:
    """Under CI=true, why the run fails though every test that ran passed: skips no entry of
    RALPH_ALLOW_SKIP excuses, and install tiers that ran none of the tests needing the install
    (only stand-in halves, recipes) while none of those was excused either; with
    RALPH_EVERY_TIER=1 (ci/run-tests.sh), each tier the run selects must have run a test: a tier
    whose tests were all deselected or never collected does not vanish from the table."""
    if os.environ.get("CI") != "true":
        return []
    failures = []
    for tier, reasons in _unexcused.items():
        why = "; ".join(sorted(set(reasons)))[:200]
        failures.append(
            f"the {tier} tier skipped {len(reasons)} test(s) that RALPH_ALLOW_SKIP does not"
            f" excuse ({why})"
        )
    every_tier = os.environ.get("RALPH_EVERY_TIER") == "1"
    for tier in _selected if every_tier else ():
        counts = _outcomes.get(tier, {})
        if not counts.get("passed", 0) + counts.get("failed", 0) + counts.get("skipped", 0):
            failures.append(
                f"the {tier} tier ran no test (none collected, or all deselected), and"
                " RALPH_EVERY_TIER=1 expects every tier this run selects"
            )
    for tier in INSTALL_TIERS:
        needing = _needing.get(tier, {})
        present = tier in _outcomes or (every_tier and tier in _selected)
        if present and not needing.get("ran") and not needing.get("excused"):
            ran = _outcomes[tier]["passed"] + _outcomes[tier]["failed"] if tier in _outcomes else 0
            failures.append(
                f"the {tier} tier ran no test that needs its install ({ran} ran that need"
                " nothing), and RALPH_ALLOW_SKIP excuses none"
            )
    return failures


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not _outcomes and not ci_failures():
        return
    write = terminalreporter.write_line
    terminalreporter.section("tiers")
    for tier in TIERS:
        counts = _outcomes.get(tier)
        if not counts:
            continue
        ran = counts["passed"] + counts["failed"]
        line = f"{tier:9} ran {ran:4} ({counts['failed']} failed)  skipped {counts['skipped']:4}"
        line += f"  {_seconds[tier]:7.1f} s"
        if tier in INSTALL_TIERS:
            line += f"  needing its install: ran {_needing[tier]['ran']}"
        if counts["skipped"]:
            line += f"  why: {'; '.join(sorted(_skip_reasons[tier]))[:160]}"
        write(line)
        if _excuses[tier]:
            write(f"{'':9} excused by RALPH_ALLOW_SKIP: {'; '.join(sorted(_excuses[tier]))[:200]}")
    for failure in ci_failures():
        write(f"CI: {failure}: failing the run")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if ci_failures() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
