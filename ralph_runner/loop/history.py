"""The iteration history: one JSON line per iteration in `.ralph/iterations.jsonl`.

It follows the loop's event stream (Output.subscribe), so the loop has no hook for it: an
`iteration` event opens a line, and the event that settles the iteration closes it: `done`,
`retry` (the service died: outcome `death`), `strike`, `skip`, or `limited` (a usage
limit, waited out: loop/limits.py) (a last strike is followed by
its skip, so it waits for it). A run that ends inside an iteration (gave up, interrupted, a
runbook error) closes it with that outcome. `death` events in between give the death numbers.

Append-only, one write per line, no fsync (jsonl.py): a kill -9 loses at most the iteration
in hand, whose line was not written yet; a torn line is skipped by readers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from ralph_runner.durable import jsonl

FILE = "iterations.jsonl"
EVENT = "iteration"  # the `event` of a history line, as death records have "death"
# A counter of prompt tokens read now: (value, None) or (None, why it cannot be read).
TokenCounter = Callable[[], tuple[float | None, str | None]]


class History:
    """Writes one line per iteration of one run; an Output listener."""

    def __init__(
        self,
        path: Path,
        host: str,
        tokens: TokenCounter | None = None,
        warn: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.path, self.host, self.tokens, self.warn = path, host, tokens, warn
        self.machine = socket.gethostname()
        self.open: dict[str, Any] | None = None
        self._tokens_at_start: float | None = None
        self._tokens_why: str | None = None
        self._started = 0.0

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "iteration":
            self.close("unknown")  # a line left open would be an iteration the loop abandoned
            self._begin(fields)
        elif self.open is None:
            return
        elif kind == "death":
            self.open["deaths"].append(fields.get("death"))
        elif kind == "done":
            self.close("done")
        elif kind == "retry":
            self.close("death")
        elif kind == "strike":
            self.open["strikes"] = fields.get("strikes")
            if (fields.get("strikes") or 0) < (fields.get("of") or 0):
                self.close("strike")  # else: the skip that follows closes it
        elif kind == "skip":
            self.close("skipped")
        elif kind == "limited":  # a usage limit: waited out (or the run stopped), no strike
            self.close("limited")
        elif kind == "paused":  # `pause --now` ended the iteration: no outcome counted
            self.close("paused")

    def close(self, outcome: str) -> None:
        """Write the iteration in hand with `outcome`; nothing when none is open."""
        line, self.open = self.open, None
        if line is None:
            return
        line["outcome"] = outcome
        line["seconds"] = round(time.monotonic() - self._started, 3)
        line["prompt_tokens"], line["tokens_note"] = self._token_delta(bool(line["deaths"]))
        try:
            jsonl.append(self.path, [line])
        except OSError as exc:  # a full disk must not stop the loop; the next line may fit
            self.warn(f"iteration {line['iteration']} not written to {self.path}: {exc}")

    def _begin(self, fields: dict[str, Any]) -> None:
        now = time.time()
        self._started = time.monotonic()
        self._tokens_at_start, self._tokens_why = self._read_tokens()
        self.open = {
            "event": EVENT,
            "time": datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"),
            "started": round(now, 3),
            "host": self.host,
            "machine": self.machine,
            "iteration": fields.get("iteration"),
            "item": fields.get("item"),
            "strikes_before": fields.get("attempts"),
            "prompt_chars": fields.get("prompt_size"),
            "prompt_bytes": fields.get("prompt_bytes"),
            "deaths_before": fields.get("deaths"),
            "deaths": [],
        }

    def _read_tokens(self) -> tuple[float | None, str | None]:
        if self.tokens is None:
            return None, "no recorder: prompt tokens come from its /metrics samples"
        return self.tokens()

    def _token_delta(self, died: bool) -> tuple[int | None, str | None]:
        """Prompt tokens the server counted during the iteration, or why there is no figure."""
        start, why = self._tokens_at_start, self._tokens_why
        if start is None:
            return None, why
        restarted = "the server restarted during the iteration (its counter began again)"
        if died:
            return None, restarted
        end, why = self._read_tokens()
        if end is None:
            return None, why
        return (None, restarted) if end < start else (int(end - start), None)
