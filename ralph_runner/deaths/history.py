"""The iteration history: one JSON line per iteration in `.ralph/iterations.jsonl`.

It follows the loop's event stream (Output.subscribe), so the loop has no hook for it: an
`iteration` event opens a line, and the event that settles the iteration closes it: `done`,
`retry` (the service died: outcome `death`), `strike`, `skip`, or `limited` (a usage
limit, waited out: loop/limits.py) (a last strike is followed by
its skip, so it waits for it). A run that ends inside an iteration (gave up, interrupted, a
runbook error) closes it with that outcome. `death` events in between give the death numbers.

Receipts: each line also says what the iteration made and spent: `head_before`, `head_after`,
`commit` (HEAD after, when it moved), `files_changed`, `insertions`, `deletions` (`git diff
--shortstat` from the start HEAD to the end HEAD), and, when the loop runs its agent proxy
(loop/proxy.py, `loop: {proxy: true}`), `receipt`: this loop's own requests, prompt and generated
tokens, time to first token and generation time (else `receipt: null` and `receipt_note`).

Append-only, one write per line, no fsync (jsonl.py): a kill -9 loses at most the iteration
in hand, whose line was not written yet; a torn line is skipped by readers.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Self

from ralph_runner.durable import jsonl
from ralph_runner.process import execute
from ralph_runner.workspace import git

EVENT = "iteration"  # the `event` of a history line, as death records have "death"
# A counter of prompt tokens read now: (value, None) or (None, why it cannot be read).
TokenCounter = Callable[[], tuple[float | None, str | None]]


class ProxyTotals(Protocol):
    """What the loop's agent proxy has counted (loop/proxy.py's Totals): the difference of two
    readings is an iteration's receipt."""

    def minus(self, earlier: Self) -> Self: ...

    def receipt(self) -> dict[str, Any]: ...


# What the loop's agent proxy has counted so far (Proxy.totals); None: no proxy runs.
Meter = Callable[[], ProxyTotals]
NO_PROXY = "no agent proxy (loop.proxy): the loop's own tokens are not counted"
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree (SHA-1 repositories)
SHORTSTAT = re.compile(r"(\d+) (file|insertion|deletion)")


class History:
    """Writes one line per iteration of one run; an Output listener."""

    def __init__(
        self,
        path: Path,
        host: str,
        tokens: TokenCounter | None = None,
        warn: Callable[[str], None] = lambda message: None,
        workdir: Path | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.path, self.host, self.tokens, self.warn = path, host, tokens, warn
        self.workdir = workdir  # for the receipts' HEAD and shortstat; None: no git facts
        self.report = report  # handed each receipt the proxy counted (a `receipt` event)
        self.meter: Meter | None = None  # set by the runner while its agent proxy runs
        self._meter_at_start: ProxyTotals | None = None
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
            self.open["reason"] = fields.get("reason")
            self.close("death")
        elif kind == "strike":
            self.open["strikes"] = fields.get("strikes")
            self.open["reason"] = fields.get("reason")
            if (fields.get("strikes") or 0) < (fields.get("of") or 0):
                self.close("strike")  # else: the skip that follows closes it
        elif kind == "skip":
            self.close("skipped")
        elif kind == "limited":  # a usage limit: waited out (or the run stopped), no strike
            self.open["limit"] = {k: fields.get(k) for k in ("source", "seconds", "reset")}
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
        line.update(self._git_receipt(line.pop("head_before", None)))
        line.update(self._proxy_receipt())
        if line.get("receipt") and self.report is not None:
            self.report({"iteration": line["iteration"], "item": line["item"], **line["receipt"]})
        try:
            jsonl.append(self.path, [line])
        except OSError as exc:  # a full disk must not stop the loop; the next line may fit
            self.warn(f"iteration {line['iteration']} not written to {self.path}: {exc}")

    def _begin(self, fields: dict[str, Any]) -> None:
        now = time.time()
        self._started = time.monotonic()
        self._tokens_at_start, self._tokens_why = self._read_tokens()
        self._meter_at_start = self._read_meter()
        head_before = self._head()
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
            "head_before": head_before,
        }

    # -- receipts ------------------------------------------------------------------
    def _read_meter(self) -> ProxyTotals | None:
        if self.meter is None:
            return None
        try:
            return self.meter()
        except Exception as exc:  # receipts are never a reason to lose the line
            self.warn(f"the agent proxy's counters could not be read: {exc}")
            return None

    def _proxy_receipt(self) -> dict[str, Any]:
        start, self._meter_at_start = self._meter_at_start, None
        end = self._read_meter() if start is not None else None
        if start is None or end is None:
            return {"receipt": None, "receipt_note": NO_PROXY}
        return {"receipt": end.minus(start).receipt()}

    def _head(self) -> str | None:
        if self.workdir is None:
            return None
        try:
            return git.head(self.workdir)
        except Exception:  # not a repository, git missing: no git facts, the line stays
            return None

    def _git_receipt(self, before: str | None) -> dict[str, Any]:
        after = self._head()
        facts: dict[str, Any] = {"head_before": before, "head_after": after}
        facts["commit"] = after if after is not None and after != before else None
        facts.update(files_changed=0, insertions=0, deletions=0)
        if after is None:
            return {**facts, "files_changed": None, "insertions": None, "deletions": None}
        if after == before or self.workdir is None:
            return facts
        result = execute.run(
            ["git", "diff", "--shortstat", before or EMPTY_TREE, after],
            cwd=self.workdir,
            timeout=60,
        )
        if not result.ok:
            return {**facts, "files_changed": None, "insertions": None, "deletions": None}
        for number, kind in SHORTSTAT.findall(result.output):
            key = {"file": "files_changed", "insertion": "insertions", "deletion": "deletions"}
            facts[key[kind]] = int(number)
        return facts

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
