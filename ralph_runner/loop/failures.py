"""What a failed step said, and when failures mean the agent itself is broken.

A step's output becomes an *output tail*: ANSI escapes and progress-bar overwrites removed,
secrets masked, at most `TAIL_LINES` lines and `TAIL_BYTES` bytes (the end of the output: where
an agent prints its error). Reasons shown on one line are cut at a word boundary or not at all.

A failed attempt gets *signatures*; two failures on consecutive different items that share a
signature mean the agent is broken (exit 6), not the items:

- the same failing step, the same status (exit code, timed out) and the same output tail once
  numbers, paths, hex ids, the item's text and whitespace are normalised away
  ("Model not found" on every item, a missing binary's exit 127);
- "exited at once without touching the repository": the item's command steps took less than
  `AT_ONCE_SECONDS` together and `git status` (HEAD and the changed paths, agent housekeeping
  left out) is the same after the attempt as before it;
- "stalled": the same step killed by its `idle_timeout` (no output, no CPU, no change in the
  workdir and no request on the server for that long), whatever it printed before.

A verify failure alone ("no new commit") is no signature: genuinely hard items fail it the
same way. Deaths never count: an attempt that saw one is retried, not compared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ralph_runner.durable.redaction import Redactor
from ralph_runner.loop.state import LastFailure
from ralph_runner.output.text import step_ended
from ralph_runner.process.output_text import clean, explaining_line, one_line

TAIL_LINES = 20
TAIL_BYTES = 2048
AT_ONCE_SECONDS = 10.0
AT_ONCE = "exited at once without touching the repository"
STALLED = "stalled (killed by its idle_timeout)"

_HEX = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{8,}\b", re.IGNORECASE)
_PATH = re.compile(r"(?:~|\.{1,2})?/[\w.@+-]+(?:/[\w.@+-]*)*")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def output_tail(text: str, redactor: Redactor) -> str:
    """The end of a step's output, cleaned, masked, at most TAIL_LINES lines / TAIL_BYTES bytes."""
    lines = [line for line in redactor.text(clean(text)).split("\n")]
    kept = "\n".join(lines[-TAIL_LINES:]).strip("\n")
    data = kept.encode("utf-8")
    if len(data) <= TAIL_BYTES:
        return kept
    cut = data[-TAIL_BYTES:].decode("utf-8", errors="ignore")
    newline = cut.find("\n")
    return cut[newline + 1 :] if 0 <= newline < len(cut) - 1 else cut


def status_text(
    exit_code: int | None,
    timed_out: bool,
    cancelled: bool,
    output: str = "",
    stalled: str | None = None,
) -> str:
    """How a step ended, in words: never "exit None" (no exit code: what its output says)."""
    ended = step_ended(exit_code, timed_out, cancelled, stalled)
    return ended or one_line(clean(output).replace("\n", "; ")) or "failed"


def reason(step: str, status: str, tail: str, from_process: bool) -> str:
    """The one-line reason of a strike: step, status and the line that explains it (an error
    message), else the last line the step printed."""
    last = next((line for line in reversed(tail.split("\n")) if line.strip()), "")
    said = explaining_line(tail) or last
    if not from_process or not said:
        return f"{step}: {status}"
    return f"{step}: {status}: {one_line(said)}"


def normalise(text: str, item: str) -> str:
    """The error text with what differs between items and runs taken out."""
    if item.strip():
        text = re.sub(rf"(?<!\w){re.escape(item.strip())}(?!\w)", "<item>", text)
    text = _HEX.sub("<hex>", text)
    text = _PATH.sub("<path>", text)
    text = _NUMBER.sub("#", text)
    return " ".join(text.split())


@dataclass
class Failure:
    """One failed attempt at an item, as the broken-agent rule compares them."""

    item: str
    reason: str
    output_tail: str
    signatures: list[str] = field(default_factory=list)

    def as_dict(self) -> LastFailure:
        return {
            "item": self.item,
            "reason": self.reason,
            "output_tail": self.output_tail,
            "signatures": self.signatures,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Failure | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                str(data["item"]),
                str(data.get("reason", "")),
                str(data.get("output_tail", "")),
                [str(s) for s in data.get("signatures", [])],
            )
        except (KeyError, TypeError):
            return None

    def same_as(self, other: Failure | None) -> bool:
        return other is not None and bool(set(self.signatures) & set(other.signatures))


def signatures(
    step: str,
    status: str,
    tail: str,
    item: str,
    *,
    from_process: bool,
    at_once_untouched: bool,
    stalled: bool = False,
) -> list[str]:
    """The ways this failure can be "the same" as another one (see the module's docstring)."""
    found = []
    if from_process:
        found.append(f"{step}: {status}: {normalise(tail, item)}")
    if stalled:
        found.append(f"{step}: {STALLED}")
    if at_once_untouched:
        found.append(AT_ONCE)
    return found
