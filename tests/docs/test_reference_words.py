"""docs/reference.md speaks the user's words (issue 31, item 8): no Python names from our source
(`housekeeping.DEFAULT_IGNORE`) leak into the generated descriptions."""

from __future__ import annotations

import re
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
# module.CONSTANT or module.function(): how our code names things, never how a runbook does.
SOURCE_NAME = re.compile(r"\b[a-z_]+\.[A-Z][A-Z0-9_]{2,}\b|\b[a-z_]+\.[a-z_]+\(\)")


def test_the_reference_names_no_source_constants():
    leaks = [
        f"{number}: {match.group()}"
        for number, line in enumerate(REFERENCE.read_text().splitlines(), 1)
        for match in SOURCE_NAME.finditer(line)
    ]
    assert leaks == []
