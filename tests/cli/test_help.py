"""`ralph-run --version` and every `--help` page (issue 31, item 10): each subcommand's page opens
with a description, every option says what it does, `report -o` shows its default, and the
top-level epilog says what probe/diagnose take (not "[same options]")."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata

import pytest
from support.standin import python_env

from ralph_runner import cli

pytestmark = pytest.mark.timeout(120)
PAGES = [None, *cli.COMMANDS]


def ralph_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", *args],
        env={**python_env(), "COLUMNS": "100"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version_prints_the_package_version() -> None:
    done = ralph_run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ralph-run {metadata.version('ralph-run')}"


@pytest.mark.parametrize("command", PAGES, ids=lambda c: c or "ralph-run")
def test_every_help_page_has_a_description_and_help_for_every_option(command: str | None) -> None:
    done = ralph_run(*([command] if command else []), "--help")
    assert done.returncode == 0, done.stderr
    page = done.stdout
    assert page.startswith(f"usage: ralph-run{' ' + command if command else ''} ")
    # argparse prints the description between the usage and the first section
    head = re.split(r"\n(?:positional arguments|options):\n", page, maxsplit=1)[0]
    description = head.split("\n\n", 1)[1] if "\n\n" in head else ""
    assert len(description.split()) >= 5, page
    if command:
        assert " ".join(description.split()) == " ".join(cli.DESCRIPTIONS[command].split())

    parser = cli._parser(command)
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{command}: {name} has no help"
    for option in ("-v", "--json", "-e"):  # named in the issue: no help before
        if option in parser._option_string_actions:
            help_text = parser._option_string_actions[option].help
            assert help_text and help_text.split()[0].lower() in page.lower()


def test_report_shows_its_output_default_and_the_epilog_names_probe_options() -> None:
    report = ralph_run("report", "--help").stdout
    help_text = " ".join(report.split())  # argparse wraps the help: compare its words
    expected = "-o FILE, --output FILE the HTML file (default: a workdir's .ralph/report.html"
    assert expected in help_text
    top = ralph_run("--help").stdout
    assert "[same options]" not in top
    line = next(line for line in top.splitlines() if "probe|diagnose" in line)
    assert "RUNBOOK [-i INVENTORY] [--limit PATTERN] [-e KEY=VALUE|@file]" in line
    for command in ("probe", "diagnose"):  # what the epilog says is what the parser takes
        options = cli._parser(command)._option_string_actions
        assert {"-i", "--limit", "-e", "-v", "--json"} <= set(options)
        assert "--forks" not in options and "--check" not in options


def test_getting_started_lists_every_command() -> None:
    from support.standin import ROOT

    text = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    listing = text.split("## The commands", 1)[1].split("```", 2)[1]
    listed = {line.split()[1] for line in listing.splitlines() if line.startswith("ralph-run ")}
    assert set(cli.COMMANDS) <= listed, set(cli.COMMANDS) - listed
