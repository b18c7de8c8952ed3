"""`ralph-run resume [WORKDIR|RUNBOOK]`: let a paused loop go on (`-i`: on every host)."""

from __future__ import annotations

import argparse

from ralph_runner.commands import options
from ralph_runner.commands.pause import control_main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run resume`'s options: pause's, without --now."""
    options.loop_target(parser)
    options.loop_control(parser)


def main(args: argparse.Namespace) -> int:
    return control_main(args, "resume")
