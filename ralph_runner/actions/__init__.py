"""Action kinds: one module each, behind one interface.

A module in this package is an action kind when it defines:

    KEY: str                       # the task key, e.g. "shell"
    Params: type                   # what the key's value must be (a type pydantic validates)
    def run(params, ctx: TaskContext) -> TaskResult
    def describe(params, ctx: TaskContext) -> str   # rendered, for --check; never runs anything

    LOOP_ONLY: bool = False        # optional: True if it needs the loop (refused elsewhere)
    AGENT: bool = True             # optional: False if, as a loop step, it runs no agent (the
                                   #   loop watches the service only while an agent runs)
    QUICK: bool = False            # optional: True if it takes milliseconds (status.json is
                                   #   not rewritten for it)

A LOOP_ONLY kind reaches the loop through `ctx.loop()`: a LoopRuntime, all it may use of it.

Adding an action kind is adding one module here: the schema and the executor find it by KEY.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TypedDict, TypeVar

from pydantic import BaseModel

from ralph_runner.plugins import discovery
from ralph_runner.plugins.fields import validate_rendered

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ralph_runner.errors import Problem
    from ralph_runner.process.connection import Connection
    from ralph_runner.process.execute import IdleWatch, Result
    from ralph_runner.templating import Templar
    from ralph_runner.workspace.git import Snapshot

ParamsT = TypeVar("ParamsT", bound=BaseModel)


@dataclass
class TaskResult:
    """What a task did; `register` turns it into the Ansible-like registered variable."""

    ok: bool
    output: str = ""
    exit_code: int | None = None
    cut_bytes: int = 0
    timed_out: bool = False
    cancelled: bool = False
    seconds: float = 0.0
    data: dict[str, object] = field(default_factory=dict)  # the action's own registered keys
    stalled: str | None = None  # killed by its idle_timeout: why (execute.Result.stalled)

    @classmethod
    def from_process(cls, result: Result) -> TaskResult:
        return cls(
            ok=result.ok,
            output=result.output,
            exit_code=result.exit_code,
            cut_bytes=result.cut_bytes,
            timed_out=result.timed_out,
            cancelled=result.cancelled,
            seconds=result.seconds,
            stalled=result.stalled,
        )

    def register(self) -> dict[str, object]:
        """The registered variable (`register:`), for the tasks' templates."""
        return {
            "rc": self.exit_code,
            "stdout": self.output,
            "stdout_lines": self.output.splitlines(),
            "failed": not self.ok,
            "ok": self.ok,
            "timed_out": self.timed_out,
            "stalled": self.stalled is not None,
            "truncated": self.cut_bytes > 0,
            "seconds": round(self.seconds, 3),
            **self.data,
        }


class LoopRuntime(Protocol):
    """What the loop (loop/runner.Runner) offers its LOOP_ONLY actions, and nothing more."""

    @property
    def checklist_path(self) -> Path: ...

    @property
    def item_in_hand(self) -> str | None:
        """The text of the checklist item this iteration works on."""
        ...

    @property
    def before(self) -> Snapshot | None:
        """The work tree when the iteration began; None outside a git repository."""
        ...

    def look_at_tree(self) -> Snapshot | None:
        """The work tree now (kept by the loop as what the next iteration starts from)."""
        ...

    def ensure_alive(self, phase: str, context: dict[str, object]) -> TaskResult:
        """Probe the service; if dead, capture, report and recover (or raise GaveUp)."""
        ...


@dataclass
class TaskContext:
    """Everything an action may use; actions render and spawn only through these."""

    variables: Mapping[str, object]  # the task's variables, for its templates
    templar: Templar
    connection: Connection
    cwd: Path | None  # None on a remote host: its login directory
    env: dict[str, str]
    timeout: float | None
    max_output: int
    where: Problem
    cancel: threading.Event | None = None
    run: LoopRuntime | None = None  # None outside the loop
    on_output: Callable[[str], None] | None = None  # live output, for `ralph-run -v`
    idle: IdleWatch | None = None  # the task's idle_timeout, as a watch (loop steps only)

    def loop(self) -> LoopRuntime:
        """The loop, for a LOOP_ONLY action (the loader allows those in loop steps only)."""
        if self.run is None:
            raise RuntimeError(f"{self.where}: a loop-only action ran outside the loop")
        return self.run

    def render_params(self, params: ParamsT) -> ParamsT:
        """`params` with every template in them rendered, validated again as their own type."""
        data = self.templar.render_data(params.model_dump(), self.variables, where=self.where)
        return validate_rendered(type(params), data, self.where)

    def process_options(self) -> ProcessOptions:
        """The keywords of Connection.shell / .argv for this task."""
        return ProcessOptions(
            cwd=self.cwd,
            env=self.env,
            timeout=self.timeout,
            max_output=self.max_output,
            cancel=self.cancel,
            on_output=self.on_output,
            idle=self.idle,
        )


class ProcessOptions(TypedDict):
    """How a task's process runs: the keywords of Connection.shell and Connection.argv."""

    cwd: Path | None
    env: dict[str, str]
    timeout: float | None
    max_output: int
    cancel: threading.Event | None
    on_output: Callable[[str], None] | None
    idle: IdleWatch | None


KINDS: dict[str, ModuleType] = discovery.discover(
    __name__, Path(__file__).parent, "KEY", required=("Params", "run", "describe")
)
# The kinds whose step is no agent's work (AGENT = False: a health check, a verify): no watch
# runs beside them and `ralph-run pause --now` does not stop them.
UNWATCHED = frozenset(key for key, kind in KINDS.items() if not getattr(kind, "AGENT", True))
