"""Text for people, in one style: every table, count and cut-off line ralph-run prints."""

from __future__ import annotations

import signal
from collections.abc import Sequence


def columns(rows: Sequence[Sequence[str]], align: str = "", indent: str = "") -> list[str]:
    """`rows` (a header first, if any) as lines of columns two spaces apart, each as wide as
    its widest cell; `align` holds "<" or ">" per column (left where it says nothing). No line
    ends in spaces, so the last column is never padded."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        (
            indent
            + "  ".join(
                cell.rjust(width) if align[i : i + 1] == ">" else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        ).rstrip()
        for row in rows
    ]


def step_ended(
    exit_code: int | None, timed_out: bool, killed: bool, stalled: str | None = None
) -> str | None:
    """How a step ended, in words: "killed (service died)", "timed out", "stalled (why)",
    "exit 137 (SIGKILL)"; None when it has no exit code (the caller says why)."""
    if killed:
        return "killed (service died)"
    if timed_out:
        return "timed out"
    if stalled:
        return f"stalled ({stalled})"
    if exit_code is None:
        return None
    if 128 < exit_code <= 128 + 64:
        try:
            return f"exit {exit_code} ({signal.Signals(exit_code - 128).name})"
        except ValueError:
            pass
    return f"exit {exit_code}"


IRREGULAR = {"recovery": "recoveries", "process": "processes"}


def plural(count: object, noun: str) -> str:
    """A count with its noun: "1 death", "3 deaths", "2 recoveries", "? attempts"."""
    return f"{count} {noun if count == 1 else IRREGULAR.get(noun, noun + 's')}"


# C0 controls but tab and newline, DEL and C1: what can move a terminal's cursor or start an
# escape sequence, shown as \xNN instead (an item, a status line, a loop's output in `top`)
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)}


def printable(text: str) -> str:
    """`text` safe for a terminal: its control characters (ESC, CR, BEL...; not tab or newline)
    written as `\\x1b`, so text from a checklist or a file never drives the terminal."""
    return text.translate(_CONTROLS)


def shorten(text: str, width: int) -> str:
    """`text` cut to at most `width` characters, a cut marked with "…"."""
    return text if len(text) <= width else text[: width - 1] + "…"
