"""`ralph-run schema`: the runbook language as JSON Schema, for editors."""

from __future__ import annotations

import argparse
import json

from ralph_runner.runbook import schema


def main(args: argparse.Namespace) -> int:
    print(json.dumps(schema.json_schema(), indent=2))
    return 0
