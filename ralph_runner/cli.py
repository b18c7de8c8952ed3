"""Arguments, subcommands and exit codes: the only place that calls sys.exit."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Protocol

from ralph_runner import crash
from ralph_runner.errors import ExitCode, FatalError, Interrupted

DESCRIPTION = "Run a Ralph loop from a runbook, and keep its LLM server alive while it runs."
EPILOG = """\
commands:
  ralph-run RUNBOOK [-i INVENTORY] [--limit PATTERN] [--forks N] [-e KEY=VALUE|@file] [--check]
                [-v] [--json]                       one loop per matching host
  ralph-run probe|diagnose RUNBOOK [-i INVENTORY] [--limit PATTERN] [-e KEY=VALUE|@file]
                [-v] [--json]                       probe once / capture a report now
  ralph-run status [WORKDIR|RUNBOOK] [-i INVENTORY]  the loop's status (every host's with -i)
  ralph-run pause [WORKDIR|RUNBOOK] [--now] [-i INVENTORY]   hold the loop before its next
                                                     iteration (--now: stop the step, no strike)
  ralph-run resume [WORKDIR|RUNBOOK] [-i INVENTORY]  let a paused loop go on
  ralph-run top [WORKDIR|RUNBOOK...] [-i INVENTORY]  a live full-screen view of the loops
  ralph-run deaths WORKDIR|RUNBOOK|RECORDS.jsonl... [--json]   what the deaths say
  ralph-run report WORKDIR|RUNBOOK|RECORDS.jsonl... [-o FILE]  the same as one HTML page
  ralph-run schema [--markdown]                      the runbook language as JSON Schema
                                                     (--markdown: as a Markdown reference)
  ralph-run demo [--dir DIR]                         the whole thing on a stand-in server
  ralph-run slurm submit|status|top|pause|resume|stop JOBS.yaml [--job NAME] [--check]
                                                     loops as Slurm jobs (docs/slurm.md)

exit codes:
  0 checklist finished   2 invalid runbook, inventory or arguments   3 workdir locked by another
  4 service not recovered (recovery.exit_code)   5 max_iterations reached with items left
  6 the agent is broken (the same failure on consecutive items, service healthy)
  7 the agent's usage limit resets after limits.max_wait (limits.exit_code; it says when)
  70 internal error: a bug in ralph-run (the crash file it names has the traceback)
  130/143 interrupted (state saved)
"""

DESCRIPTIONS = {  # each subcommand's --help page opens with its own
    "probe": "Run the runbook's health probes once, now, on each matching host, and print each "
    "probe's result. Exit 0 when every probe is healthy, 1 when one is not.",
    "diagnose": "Run every collector of the runbook now, on each matching host, and print the "
    "death report it would write (nothing is written, nothing recovered).",
    "status": "Where a loop stands, read from its .ralph/status.json: while it runs and after "
    "it ended. With -i, every host's loop, over its connection.",
    "pause": "Hold a running loop before its next iteration (--now: stop the running step, "
    "no strike). It writes .ralph/pause; a loop that is not running waits before its first "
    "iteration. `ralph-run resume` lets it go on.",
    "resume": "Let a paused loop go on (removes .ralph/pause), or clear a pause left on a "
    "loop that is not running.",
    "top": "A live full-screen view of one or more loops: state, item, step, deaths, and the "
    "selected loop's engine, iterations and output. Keys: p pause, r resume, o report, q quit.",
    "deaths": "What the deaths say: by signature, phase and host, time between deaths, "
    "recovery times and the death rate by prompt size, from death records and histories.",
    "report": "The answers of `ralph-run deaths` as one self-contained offline HTML page, with "
    "charts (timeline, signatures, prompt size, the flight recorder before each death).",
    "schema": "Print the runbook language as JSON Schema (for editors), or as a Markdown "
    "reference.",
    "slurm": "Loops as Slurm jobs: submit one batch job per loop of a jobs file (--check "
    "prints each job's script), watch them (status, top: Slurm's view joined with each loop's "
    "status.json), pause, resume or stop (scancel: the loop runs its teardown) one or all.",
    "demo": "The whole thing on a stand-in server: a throw-away workspace and a loop whose "
    "server is broken twice on purpose, recovered each time; ends with its deaths and report.",
}
COMMANDS = tuple(DESCRIPTIONS)


def version() -> str:
    """The installed package's version (pyproject.toml's)."""
    from importlib import metadata

    try:
        return metadata.version("ralph-run")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class Runs(Protocol):
    """A module of ralph_runner/commands that runs with the parsed arguments (check.py runs
    with the run's: `--check`)."""

    def main(self, args: argparse.Namespace) -> int: ...


class Command(Runs, Protocol):
    """A command: it declares its own options, as pip's commands do."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...


def _command(name: str) -> Command:
    """The module of a command, imported when it is asked for: only the one that runs."""
    return importlib.import_module(f"ralph_runner.commands.{name}")


def _parser(command: str | None) -> argparse.ArgumentParser:
    """The parser of a command, or of the run (`ralph-run RUNBOOK`) with no command."""
    if command is None:
        parser = argparse.ArgumentParser(
            prog="ralph-run",
            description=DESCRIPTION,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
        _command("run").add_arguments(parser)
        return parser
    parser = argparse.ArgumentParser(prog=f"ralph-run {command}", description=DESCRIPTIONS[command])
    _command(command).add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for stream in (sys.stdout, sys.stderr):  # a value with a lone surrogate prints, escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    command = argv[0] if argv and argv[0] in COMMANDS else None
    for index, arg in enumerate(argv, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode (surrogateescape)
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            print(
                f"ralph-run: error: argument {index} is not valid UTF-8: {shown}", file=sys.stderr
            )
            return 2
    try:
        args = _parser(command).parse_args(argv[1:] if command else argv)
        module: Runs = _command(command) if command else _command("check" if args.check else "run")
        code = module.main(args)
    except FatalError as exc:
        for problem in exc.problems:
            print(f"ralph-run: error: {crash.mask(str(problem))}", file=sys.stderr)
        code = exc.exit_code
    except Interrupted as exc:  # the run saved its state and reported the signal
        code = exc.exit_code
    except KeyboardInterrupt:
        code = ExitCode.SIGINT
    except BrokenPipeError:  # `ralph-run schema | head`: the reader left; leave quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except Exception as exc:  # a bug: one line, a crash file, a documented exit code
        code = crash.report(exc, argv)
    sys.exit(code)
