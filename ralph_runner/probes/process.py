"""`process: {pidfile, name, cmdline}`: a live (not zombie) process matches every given field.

ralph-run itself and its ancestors never count: `ralph-run runbooks/vllm.yaml` must not pass
for a dead vLLM just because its own command line says "vllm". No match is reason "refused"
(nothing there to answer, the process analog of a closed port); a garbled pidfile is "error".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict, model_validator

from ralph_runner.plugins.fields import Regex
from ralph_runner.probes import ProbeContext, Verdict
from ralph_runner.process.kill import lineage

KIND = "process"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pidfile: str | None = None  # a file holding the pid (~ expanded); no file: not running
    name: str | None = None  # exact process name, as `ps -o comm` shows it
    cmdline: Regex | None = None  # searched in the joined command line

    @model_validator(mode="after")
    def _something(self) -> Params:
        if self.pidfile is None and self.name is None and self.cmdline is None:
            raise ValueError("a process probe needs pidfile, name or cmdline")
        return self

    def wanted(self) -> str:
        fields = {"pidfile": self.pidfile, "name": self.name, "cmdline": self.cmdline}
        return ", ".join(f"{key}={value!r}" for key, value in fields.items() if value is not None)


def ourselves() -> set[int]:
    """This process and its ancestors: they must not pass for the watched service."""
    return lineage()


def matches(process: psutil.Process, params: Params) -> bool:
    """Any process may end, turn zombie or be unreadable while it is read (psutil.Error:
    ZombieProcess, NoSuchProcess, AccessDenied): then it is no match."""
    try:
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        if params.name is not None and process.name() != params.name:
            return False
        return params.cmdline is None or bool(
            re.search(params.cmdline, " ".join(process.cmdline()))
        )
    except psutil.Error:
        return False


def name_of(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"


class NoProcess(Exception):
    """Why a pidfile leads to no process: (reason, detail)."""


def pid_in(pidfile: str) -> int:
    """The pid a pidfile names; a missing file is a stopped service, a garbled one an error."""
    path = Path(os.path.expanduser(pidfile))
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise NoProcess("refused", f"pidfile {pidfile} missing") from None
    except OSError as exc:
        raise NoProcess("error", f"pidfile {pidfile} unreadable: {exc.strerror}") from None
    if not text.isdigit():
        raise NoProcess("error", f"pidfile {pidfile} holds {text[:40]!r}, not a pid")
    return int(text)


def candidates(params: Params) -> list[psutil.Process]:
    if params.pidfile is None:
        excluded = ourselves()
        return [p for p in psutil.process_iter() if p.pid not in excluded]
    pid = pid_in(params.pidfile)
    try:
        return [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        raise NoProcess("refused", f"pid {pid} from {params.pidfile} is not running") from None


def check(params: Params, ctx: ProbeContext) -> Verdict:
    try:
        found = candidates(params)
    except NoProcess as missing:
        reason, detail = missing.args
        return Verdict(False, reason, detail)
    for process in found:
        if matches(process, params):
            return Verdict(True, None, f"pid {process.pid} ({name_of(process)}) is running")
    return Verdict(False, "refused", f"no live process with {params.wanted()}")
