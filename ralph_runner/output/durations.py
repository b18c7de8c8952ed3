"""Every span of time ralph-run shows, in one place. The formats differ on purpose: a wait in
words (`span`), a statistic with its decimal (`statistic`), a table cell of at most 6
characters (`cell`), the console's clock (`clock`), a status's age (`ago`)."""

from __future__ import annotations

import time


def clock(seconds: float) -> str:
    """Elapsed time as the console's prefix shows it: "01:02:03"."""
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}"


def span(seconds: float) -> str:
    """A wait in words: "3 h 12 min", "45 s"."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    if minutes:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    return f"{secs} s"


def statistic(seconds: float | None) -> str:
    """A statistic's span, one decimal: "9.5 s", "10.3 min", "2.1 h" (a p50 or a mean is no
    whole number of seconds)."""
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def cell(seconds: float) -> str:
    """A span in a table cell: "45s", "3m05s", "2h07m" (at most 6 characters, whole seconds)."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def ago(updated: float) -> str:
    """How long ago a status was written: "12 s ago", "3 min ago"; "-" when it does not say."""
    if not updated:
        return "-"
    seconds = max(0, int(time.time() - updated))
    return f"{seconds} s ago" if seconds < 120 else f"{seconds // 60} min ago"
