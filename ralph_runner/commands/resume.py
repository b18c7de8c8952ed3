"""`ralph-run resume [WORKDIR|RUNBOOK]`: let a paused loop go on (`-i`: on every host)."""

from __future__ import annotations

import argparse

from ralph_runner.commands.pause import control_main


def main(args: argparse.Namespace) -> int:
    return control_main(args, "resume")
