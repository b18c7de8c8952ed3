"""`wait: SECONDS`, or wait for the resource: `wait: {gpu_free_mib: N, command: ..., max: S}`.

A fixed delay waits for the clock (and wakes at once on shutdown). The mapping waits for the
GPU instead: it looks every `every` s (0.5) until a GPU has `gpu_free_mib` free (NVML, read in
this process: no nvidia-smi) and `command` (the scheduler's answer: exit 0 when there is room)
succeeds, so a restart starts within a look of the other job's release; past `max` s the task
fails (timed out). A command that cannot run (exit 126 or 127: not found, not executable) fails
the task at its first look, with the shell's error: a typo is not a resource that is busy.
Without an NVIDIA driver (or on a remote host, whose GPUs NVML cannot read) it says so once and
waits on the command alone, or, with none, `fallback` s as a fixed delay would. It registers
`waited` (seconds), `source` (what it waited on) and `free_mib`.
"""

from __future__ import annotations

import threading
import time
from types import ModuleType

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from ralph_runner.actions import TaskContext, TaskResult
from ralph_runner.actions.nvml import MIB

KEY = "wait"
# the shell's "found but not executable" and "not found": the command's answer will never be yes
CANNOT_RUN = (126, 127)
AGENT = False  # a pause of the loop itself: nothing to watch


class Resource(BaseModel):
    """Wait until there is room on the GPU, looking again and again, up to a bound."""

    model_config = ConfigDict(extra="forbid")

    gpu_free_mib: PositiveInt | None = None  # NVML: a GPU with at least this much memory free
    gpu: NonNegativeInt | None = None  # that GPU's index; default: any GPU of this machine
    # a shell command that exits 0 when there is room (e.g. the scheduler's answer); every
    # {{ value }} is one shell word, as in `shell:`
    command: str | None = None
    every: PositiveFloat = 0.5  # seconds between looks
    max: PositiveFloat = 600.0  # the bound, in seconds: past it the task fails (timed out)
    # no NVIDIA driver and no command: wait this many seconds instead (a fixed delay)
    fallback: NonNegativeFloat = 30.0

    @model_validator(mode="after")
    def _waits_for_something(self) -> Resource:
        if self.gpu_free_mib is None and self.command is None:
            raise ValueError("a wait for the resource needs `gpu_free_mib` or `command` (or both)")
        if self.gpu is not None and self.gpu_free_mib is None:
            raise ValueError("`gpu` names the GPU of `gpu_free_mib`: give that too")
        return self


Params = NonNegativeFloat | Resource


def describe(params: float | Resource, ctx: TaskContext) -> str:
    if not isinstance(params, Resource):
        return f"wait {params:g} s"
    wanted = []
    if params.gpu_free_mib is not None:
        which = "a GPU" if params.gpu is None else f"GPU {params.gpu}"
        wanted.append(f"{which} has {params.gpu_free_mib} MiB free (NVML)")
    if params.command is not None:
        wanted.append(f"`{command_line(params.command, ctx)}` succeeds")
    return (
        f"wait until {' and '.join(wanted)}, looking every {params.every:g} s, "
        f"at most {params.max:g} s"
    )


def run(params: float | Resource, ctx: TaskContext) -> TaskResult:
    started = time.monotonic()
    cancel = ctx.cancel or threading.Event()
    if not isinstance(params, Resource):
        cancelled = cancel.wait(params)
        return TaskResult(ok=not cancelled, cancelled=cancelled, seconds=time.monotonic() - started)
    return _ResourceWait(params, ctx, cancel, started).run()


def command_line(text: str, ctx: TaskContext) -> str:
    """`command:` rendered as the shell runs it (each value one shell word)."""
    return ctx.templar.render(text, ctx.variables, shell=True, where=ctx.where)


class Gpus:
    """NVML held open for one wait (an init per look would cost milliseconds each)."""

    def __init__(self, pynvml: ModuleType, index: int | None) -> None:
        self.pynvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        indexes = range(count) if index is None else [index]
        if index is not None and index >= count:
            raise LookupError(f"no GPU {index}: this machine has {count}")
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indexes]

    @classmethod
    def open(cls, index: int | None, local: bool) -> Gpus | str:
        """The GPUs, or why NVML cannot read them (said once in the task's output)."""
        if not local:
            return "NVML reads this machine's GPUs, not the remote host's"
        try:
            import pynvml
        except ImportError as exc:
            return f"no NVIDIA driver: {exc}"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return f"no NVIDIA driver: {exc}"
        try:
            return cls(pynvml, index)
        except (pynvml.NVMLError, LookupError) as exc:
            pynvml.nvmlShutdown()
            return f"NVML: {exc}"

    def free_mib(self) -> int | None:
        """The most free memory on one of the GPUs; None when NVML cannot say."""
        found = []
        for handle in self.handles:
            try:
                found.append(self.pynvml.nvmlDeviceGetMemoryInfo(handle).free // MIB)
            except self.pynvml.NVMLError:
                continue
        return max(found, default=None)

    def close(self) -> None:
        self.pynvml.nvmlShutdown()


class _ResourceWait:
    def __init__(
        self, params: Resource, ctx: TaskContext, cancel: threading.Event, started: float
    ) -> None:
        self.params, self.ctx, self.cancel, self.started = params, ctx, cancel, started
        self.said: list[str] = []
        self.free: int | None = None

    def run(self) -> TaskResult:
        params = self.params
        gpus: Gpus | None = None
        if params.gpu_free_mib is not None:
            opened = Gpus.open(params.gpu, self.ctx.connection.name == "local")
            if isinstance(opened, str):
                instead = "the command alone" if params.command else f"{params.fallback:g} s"
                self.said.append(f"{opened}: waiting on {instead} instead")
            else:
                gpus = opened
        try:
            if gpus is None and params.command is None:
                return self._delay()
            return self._poll(gpus)
        finally:
            if gpus is not None:
                gpus.close()

    def _delay(self) -> TaskResult:
        cancelled = self.cancel.wait(min(self.params.fallback, self._bound()))
        return self._result(not cancelled, "delay", cancelled=cancelled)

    def _poll(self, gpus: Gpus | None) -> TaskResult:
        params = self.params
        source = "+".join(
            name for name, used in (("nvml", gpus), ("command", params.command)) if used
        )
        deadline = self.started + self._bound()
        command = command_line(params.command, self.ctx) if params.command else None
        looks = 0
        while True:
            looks += 1
            room = True
            if gpus is not None and params.gpu_free_mib is not None:
                self.free = gpus.free_mib()
                room = self.free is not None and self.free >= params.gpu_free_mib
            if room and command is not None:
                options = self.ctx.process_options()
                options["timeout"] = max(deadline - time.monotonic(), params.every)
                answer = self.ctx.connection.shell(command, **options)
                if answer.exit_code in CANNOT_RUN:  # a typo, not a busy resource: no 600 s wait
                    said = answer.output.strip() or f"exit {answer.exit_code}"
                    self.said.append(f"the command cannot run (exit {answer.exit_code}): {said}")
                    return self._result(False, source)
                room = answer.ok
            if room:
                self.said.append(f"room after {looks} look(s)")
                return self._result(True, source)
            left = deadline - time.monotonic()
            if left <= 0:
                self.said.append(f"no room after {looks} look(s) in {self._bound():g} s")
                return self._result(False, source, timed_out=True)
            if self.cancel.wait(min(params.every, left)):
                return self._result(False, source, cancelled=True)

    def _bound(self) -> float:
        """`max`, or the task's `timeout` when that is shorter."""
        timeout = self.ctx.timeout
        return self.params.max if timeout is None else min(self.params.max, timeout)

    def _result(
        self, ok: bool, source: str, *, timed_out: bool = False, cancelled: bool = False
    ) -> TaskResult:
        seconds = time.monotonic() - self.started
        if self.free is not None:
            self.said.append(f"{self.free} MiB free (NVML), {self.params.gpu_free_mib} wanted")
        return TaskResult(
            ok=ok,
            output="\n".join(self.said),
            timed_out=timed_out,
            cancelled=cancelled,
            seconds=seconds,
            data={"waited": round(seconds, 3), "source": source, "free_mib": self.free},
        )
