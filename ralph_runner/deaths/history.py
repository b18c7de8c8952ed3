"""The iteration history: one JSON line per iteration in `.ralph/iterations.jsonl`.

It follows the run's events (a Follower of output.bus.EventBus), so the loop has no hook for it: an
`IterationStarted` event opens a line, and the `IterationEnded` the loop emits for that iteration
closes it with the outcome the loop decided (done, death, strike, skipped, set-aside, limited,
paused; or how the run ended inside it: gave-up, interrupted, failed); a line open when the run
ends is `unknown`. `Death` events in between give the death numbers, to every line open.

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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NotRequired, Protocol, Self, TypedDict

from ralph_runner import events
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

    def receipt(self) -> ProxyReceipt: ...


class ProxyReceipt(TypedDict):
    """An iteration's own requests, as the agent proxy counted them (loop/proxy.py)."""

    requests: int
    request_errors: int
    prompt_tokens: int
    generated_tokens: int
    tokens_estimated: bool
    first_token_seconds: float | None
    generation_seconds: float
    request_seconds: float


class Line(TypedDict):
    """One line of `.ralph/iterations.jsonl` (docs/deaths.md), in the order it is written."""

    event: str
    time: str
    started: float
    host: str
    machine: str
    iteration: int
    item: str
    strikes_before: int
    prompt_chars: int
    prompt_bytes: int
    deaths_before: int
    deaths: list[int]
    worker: NotRequired[int]  # loop.workers > 1: the worker that made the attempt
    reason: NotRequired[str]
    strikes: NotRequired[int]
    limit: NotRequired[events.LimitFacts]
    outcome: NotRequired[str]
    seconds: NotRequired[float]
    prompt_tokens: NotRequired[int | None]
    tokens_note: NotRequired[str | None]
    head_before: NotRequired[str | None]
    head_after: NotRequired[str | None]
    commit: NotRequired[str | None]
    files_changed: NotRequired[int | None]
    insertions: NotRequired[int | None]
    deletions: NotRequired[int | None]
    receipt: NotRequired[ProxyReceipt | None]
    receipt_note: NotRequired[str]


class GitReceipt(TypedDict):
    """What the iteration changed in the repository; None: no git facts (not a repository)."""

    head_before: str | None
    head_after: str | None
    commit: str | None  # HEAD after, when it moved
    files_changed: int | None
    insertions: int | None
    deletions: int | None


# What the loop's agent proxy has counted so far (Proxy.meter): all of it, or one worker's
# (loop.workers > 1: each worker's agent has its own URL); None: no proxy runs.
Meter = Callable[[int | None], ProxyTotals]
NO_PROXY = "no agent proxy (loop.proxy): the loop's own tokens are not counted"
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree (SHA-1 repositories)
SHORTSTAT = re.compile(r"(\d+) (file|insertion|deletion)")


@dataclass
class _Open:
    """An open line and what its receipts start from, till its iteration ends."""

    line: Line
    started: float  # monotonic
    head: str | None
    tokens: float | None  # the server's prompt tokens at its start, or why not
    tokens_why: str | None
    meter: ProxyTotals | None  # the agent proxy's counters at its start (its worker's)
    worker: int | None


class History:
    """Writes one line per iteration of one run; a follower of the run's events. One mode for
    one worker and many: the lines open by iteration (with workers they overlap), a death goes
    on every line open, and an iteration's own end closes its line."""

    def __init__(
        self,
        path: Path,
        host: str,
        tokens: TokenCounter | None = None,
        warn: Callable[[str], None] = lambda message: None,
        workdir: Path | None = None,
        report: Callable[[events.Receipt], None] | None = None,
        meter: Meter | None = None,
    ) -> None:
        self.path, self.host, self.tokens, self.warn = path, host, tokens, warn
        self.workdir = workdir  # for the receipts' HEAD and shortstat; None: no git facts
        self.report = report  # handed each receipt the proxy counted (a `receipt` event)
        self.meter = meter  # the run's agent proxy's counters; None: no proxy runs
        self.machine = socket.gethostname()
        self.open: dict[int, _Open] = {}  # iteration -> its line, till it ends
        self._worker_of: dict[int, int] = {}  # iteration -> its worker (loop.workers > 1)

    def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.WorkerStarted):
            self._worker_of[event.iteration] = event.worker
        elif isinstance(event, events.IterationStarted):
            self.open[event.iteration] = self._begin(event)
        elif isinstance(event, events.Death):
            for open_line in self.open.values():
                open_line.line["deaths"].append(event.death)
        elif isinstance(event, events.IterationEnded):
            begun = self.open.pop(event.iteration, None)
            if begun is None:
                return
            if event.reason is not None:
                begun.line["reason"] = event.reason
            if event.strikes is not None:
                begun.line["strikes"] = event.strikes
            if event.limit is not None:
                begun.line["limit"] = event.limit
            self._write(begun, event.outcome)

    def close(self, outcome: str) -> None:
        """Write every line still open with `outcome` (the run ended inside them)."""
        for iteration in sorted(self.open):
            self._write(self.open.pop(iteration), outcome)

    def _write(self, begun: _Open, outcome: str) -> None:
        line = begun.line
        line["outcome"] = outcome
        line["seconds"] = round(time.monotonic() - begun.started, 3)
        line["prompt_tokens"], line["tokens_note"] = self._token_delta(begun)
        line.update(self._git_receipt(begun.head))
        receipt = self._proxy_receipt(begun)
        line["receipt"] = receipt
        if receipt is None:
            line["receipt_note"] = NO_PROXY
        elif self.report is not None:
            self.report(events.Receipt(iteration=line["iteration"], item=line["item"], **receipt))
        try:
            jsonl.append(self.path, [dict(line)])
        except OSError as exc:  # a full disk must not stop the loop; the next line may fit
            self.warn(f"iteration {line['iteration']} not written to {self.path}: {exc}")

    def _begin(self, event: events.IterationStarted) -> _Open:
        now = time.time()
        started = time.monotonic()
        tokens, tokens_why = self._read_tokens()
        worker = self._worker_of.pop(event.iteration, None)
        line: Line = {
            "event": EVENT,
            "time": datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"),
            "started": round(now, 3),
            "host": self.host,
            "machine": self.machine,
            "iteration": event.iteration,
            "item": event.item,
            "strikes_before": event.attempts,
            "prompt_chars": event.prompt_size,
            "prompt_bytes": event.prompt_bytes,
            "deaths_before": event.deaths,
            "deaths": [],
        }
        if worker is not None:
            line["worker"] = worker
        meter = self._read_meter(worker)
        return _Open(line, started, self._head(), tokens, tokens_why, meter, worker)

    # -- receipts ------------------------------------------------------------------
    def _read_meter(self, worker: int | None) -> ProxyTotals | None:
        if self.meter is None:
            return None
        try:
            return self.meter(worker)
        except Exception as exc:  # receipts are never a reason to lose the line
            self.warn(f"the agent proxy's counters could not be read: {exc}")
            return None

    def _proxy_receipt(self, begun: _Open) -> ProxyReceipt | None:
        """The iteration's own requests; None: no proxy runs (or it could not be read)."""
        end = self._read_meter(begun.worker) if begun.meter is not None else None
        if begun.meter is None or end is None:
            return None
        receipt: ProxyReceipt = end.minus(begun.meter).receipt()
        return receipt

    def _head(self) -> str | None:
        if self.workdir is None:
            return None
        try:
            return git.head(self.workdir)
        except Exception:  # not a repository, git missing: no git facts, the line stays
            return None

    def _git_receipt(self, before: str | None) -> GitReceipt:
        after = self._head()
        commit = after if after is not None and after != before else None
        facts = GitReceipt(
            head_before=before,
            head_after=after,
            commit=commit,
            files_changed=0,
            insertions=0,
            deletions=0,
        )
        unknown: GitReceipt = {
            **facts,
            "files_changed": None,
            "insertions": None,
            "deletions": None,
        }
        if after is None:
            return unknown
        if after == before or self.workdir is None:
            return facts
        result = execute.run(
            ["git", "diff", "--shortstat", before or EMPTY_TREE, after],
            cwd=self.workdir,
            timeout=60,
        )
        if not result.ok:
            return unknown
        for number, kind in SHORTSTAT.findall(result.output):
            if kind == "file":
                facts["files_changed"] = int(number)
            elif kind == "insertion":
                facts["insertions"] = int(number)
            else:
                facts["deletions"] = int(number)
        return facts

    def _read_tokens(self) -> tuple[float | None, str | None]:
        if self.tokens is None:
            return None, "no recorder: prompt tokens come from its /metrics samples"
        return self.tokens()

    def _token_delta(self, begun: _Open) -> tuple[int | None, str | None]:
        """Prompt tokens the server counted during the iteration, or why there is no figure."""
        start, why = begun.tokens, begun.tokens_why
        if start is None:
            return None, why
        restarted = "the server restarted during the iteration (its counter began again)"
        if begun.line["deaths"]:
            return None, restarted
        end, why = self._read_tokens()
        if end is None:
            return None, why
        return (None, restarted) if end < start else (int(end - start), None)
