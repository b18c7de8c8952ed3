"""`idle_timeout: S` on a loop step: the agent is killed as *stalled* when, for S seconds
together, nothing shows it is working.

Four signs of work, each cheap, looked at every second (execute.IDLE_EVERY) by `StepIdle`:

- output: any byte the step's tree printed (execute counts them);
- CPU: the user+system time of the tree (psutil; a process's `children_*` times keep what its
  reaped children used), and the set of its processes (one started or ended is work). Below
  CPU_FLOOR s plus CPU_SHARE of one core since the quiet began is noise (timers, a GC), not work;
- the workdir: the newest mtime and the number of entries of a breadth-first walk of at most
  WALK_ENTRIES entries (the top levels come first; .git counts by its index, dependency and cache
  directories by their own entry only; ralph-run's own files are left out). Only walked while the
  tree is silent and still: a tree that writes files uses CPU, so the walk is for writers outside
  it (a container, a daemon the agent drives), and a full recursive stat of a large repository
  every second would cost more than it finds;
- the service: a request in flight, of the agent's or anyone's (one server's /metrics cannot
  tell whose; "maybe ours" is never killed). Seen through the runbook's `progress` probes: their
  /metrics scraped directly (no canary, no probe state touched), and Health.waiting_since(). A
  look runs in a thread of its own every SERVER_EVERY s while the tree is quiet (every
  BUSY_EVERY s while the server is busy: S counts from the last look that saw work), and one
  begun once the S s are full must say "idle" before the kill; a look that fails (a busy server
  answers /metrics slowly) counts as busy. Without a progress probe the service cannot be seen
  and the tree and the workdir decide alone: give such a runbook an idle_timeout longer than its
  longest model call.

The kill is the agent's failure, not the service's: a strike, no death record, and stalls count
toward the broken-agent rule (failures.STALLED).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil

from ralph_runner.probes import ProbeContext, progress

if TYPE_CHECKING:
    from ralph_runner.liveness.health import Health
    from ralph_runner.runbook.plan import Plan

CPU_FLOOR = 0.05  # CPU seconds of the tree since the quiet began that are still "no CPU"
CPU_SHARE = 0.002  # ... plus this share of one core (0.2 %: an idle runtime's timers)
WALK_ENTRIES = 2000  # entries of the workdir looked at, at most, per walk (~10 ms)
NOT_WALKED = frozenset(
    {".git", "node_modules", ".venv", "venv", "__pycache__", ".mypy_cache", ".pytest_cache",
     ".ruff_cache", ".tox", ".cache", "target", "dist", "build"}
)  # fmt: skip
SERVER_EVERY = 5.0  # seconds between looks at the server while the tree is quiet
BUSY_EVERY = 1.0  # ... while the last look saw work (S counts from the last busy look)
LOOK_TIMEOUT = 5.0  # seconds a look's scrape may take, at most


def reason(seconds: float) -> str:
    """What a stalled step's status says after "stalled"."""
    return f"no output, no CPU, no change for {seconds:g} s"


def watches(
    plan: Plan,
    health: Health,
    store_dir: Path,
    workdir: Path | None = None,
    ours: Callable[[], bool] | None = None,
) -> Callable[[float], StepIdle]:
    """The loop's factory of idle watches (tasks.TaskGroup.idle): one per task that sets
    `idle_timeout`, watching the plan's workdir (ralph-run's own files left out), or a
    worker's `workdir` (its worktree's), and the service through the health's `progress`
    probes; or, for a worker whose agent has its own proxy URL, `ours`: a request of its own
    is in flight (other workers' requests keep the server busy, not this agent)."""
    from ralph_runner.deaths.log import records_path

    config = plan.model.diagnostics
    log = plan.path(("diagnostics", "log"), config.log)
    records = config.records and plan.path(("diagnostics", "records"), config.records)
    ignore = [store_dir, log, records_path(log, records)]
    server = ours or server_look(health)

    def make(seconds: float) -> StepIdle:
        return StepIdle(seconds, workdir or plan.workdir, server, ignore)

    return make


def server_look(health: Health) -> Callable[[], bool] | None:
    """Is a request in flight on the server (or may one be)? None: no probe can tell."""
    specs = [spec for spec in health.probes if spec.kind == "progress"]
    if not specs:
        return None

    def busy() -> bool:
        if health.waiting_since() is not None:  # the probes saw work waiting on the engine
            return True
        for spec in specs:
            timeout = min(float(spec.timeout), LOOK_TIMEOUT)
            ctx = ProbeContext(health.client, health.connection, timeout)
            try:
                seen = progress.scrape(spec.params, ctx)
            except (httpx.HTTPError, OSError, ValueError):
                return True  # unknown is not idle
            if not isinstance(seen, progress.Scrape) or seen.active > 0:
                return True
        return False

    return busy


class StepIdle:
    """One step's idle watch (execute.IdleWatch): see the module's docstring."""

    def __init__(
        self,
        seconds: float,
        workdir: Path,
        server: Callable[[], bool] | None,
        ignore: Iterable[Path] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds, self.workdir, self.server, self.clock = seconds, workdir, server, clock
        self.ignore = {os.path.abspath(p) for p in ignore}
        self._pid: int | None = None
        self._output = 0  # output bytes at the last look
        self._cpu, self._processes = 0.0, frozenset[int]()  # the tree at the last sign of work
        self._active_at = 0.0  # the last sign of work of the tree or the workdir
        self._files: tuple[int, int] | None = None  # the workdir since then (None: not looked)
        self._busy_at: float | None = None  # the start of the last look that saw work
        self._idle_at: float | None = None  # ... that saw none
        self._look: _Look | None = None

    def stalled(self, pid: int, output_bytes: int) -> str | None:
        now = self.clock()
        if pid != self._pid:  # a new command (the task's first attempt, or a retry)
            self._pid, self._output = pid, output_bytes
            self._cpu, self._processes = tree_cpu(pid)
            self._active_at, self._files = now, None
            self._busy_at = self._idle_at = None
            self._look = None
            return None
        if self._working(pid, output_bytes, now):
            self._active_at, self._files = now, None
            return None
        if self._files is None:  # quiet from now on: what the workdir looks like
            self._files = fingerprint(self.workdir, self.ignore)
        elif (files := fingerprint(self.workdir, self.ignore)) != self._files:
            self._active_at, self._files = now, files
            return None
        if self.server is None:
            return reason(self.seconds) if now - self._active_at >= self.seconds else None
        return self._by_server(now)

    def _working(self, pid: int, output_bytes: int, now: float) -> bool:
        if output_bytes != self._output:
            self._output = output_bytes
            self._cpu, self._processes = tree_cpu(pid)
            return True
        cpu, processes = tree_cpu(pid)
        allowed = CPU_FLOOR + CPU_SHARE * (now - self._active_at)
        if processes != self._processes or abs(cpu - self._cpu) > allowed:
            self._cpu, self._processes = cpu, processes
            return True
        return False

    def _by_server(self, now: float) -> str | None:
        look = self._look
        if look is not None and look.done.is_set():
            if look.busy:
                self._busy_at = look.started
            else:
                self._idle_at = look.started
            self._look = look = None
        quiet_since = max(self._active_at, self._busy_at or self._active_at)
        # the kill needs a look that began once the window was full and saw no work
        if self._idle_at is not None and self._idle_at - quiet_since >= self.seconds:
            return reason(self.seconds)
        if look is None:
            last = max(self._busy_at or -1.0, self._idle_at or -1.0)
            every = BUSY_EVERY if last == self._busy_at else SERVER_EVERY
            if last < 0 or now - last >= every or now - quiet_since >= self.seconds:
                self._look = _Look(self.server, now)  # at S: the kill waits for its answer
        return None


class _Look:
    """One look at the server, in a daemon thread: a slow /metrics never holds up the step's
    output, cancel or deadline (execute's loop asks the watch in between)."""

    def __init__(self, busy: Callable[[], bool] | None, started: float) -> None:
        self.started, self.busy = started, True
        self.done = threading.Event()
        self._ask = busy
        threading.Thread(target=self._run, name="idle look", daemon=True).start()

    def _run(self) -> None:
        try:
            self.busy = self._ask() if self._ask is not None else False
        except Exception:
            self.busy = True  # unknown is not idle
        finally:
            self.done.set()


def tree_cpu(pid: int) -> tuple[float, frozenset[int]]:
    """CPU seconds (user+system, reaped children's included) of pid's tree, and its pids."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, frozenset()
    total, pids = 0.0, set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
            pids.add(process.pid)
    return total, frozenset(pids)


def fingerprint(workdir: Path, ignore: set[str], limit: int = WALK_ENTRIES) -> tuple[int, int]:
    """The newest mtime (ns) and the count of the first `limit` entries of a breadth-first walk
    of `workdir`: a file written, added, removed or renamed changes it (a removal or rename
    changes its directory's mtime). .git counts by its index (add, commit, checkout)."""
    newest, seen = 0, 0
    index = os.path.join(workdir, ".git", "index")
    with contextlib.suppress(OSError):
        newest = os.stat(index).st_mtime_ns
    queue = deque([os.path.abspath(workdir)])
    while queue and seen < limit:
        with contextlib.suppress(OSError), os.scandir(queue.popleft()) as entries:
            for entry in entries:
                if entry.path in ignore:
                    continue
                with contextlib.suppress(OSError):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime_ns)
                seen += 1
                if entry.name not in NOT_WALKED and entry.is_dir(follow_symlinks=False):
                    queue.append(entry.path)
                if seen >= limit:
                    break
    return newest, seen
