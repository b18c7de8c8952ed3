"""`command: STRING`: a shell check run on the host's connection; healthy on exit 0 in time.

Like a `shell` task, each {{ value }} in the string becomes one shell word (SHELL below).
"""

from __future__ import annotations

from ralph_runner.probes import ProbeContext, Verdict, excerpt

KIND = "command"
Params = str
SHELL = True  # rendered in shell mode: values are quoted
MAX_OUTPUT = 4096  # a probe's output only explains a failure: its last lines are enough


def check(params: str, ctx: ProbeContext) -> Verdict:
    result = ctx.connection.shell(params, timeout=ctx.timeout, max_output=MAX_OUTPUT)
    lines = result.output.strip().splitlines()
    last = f": {excerpt(lines[-1])}" if lines else ""
    if result.timed_out:
        return Verdict(False, "timeout", f"timed out after {ctx.timeout:g}s{last}")
    if result.exit_code != 0:
        return Verdict(False, "status", f"exit {result.exit_code}{last}")
    return Verdict(True, None, f"exit 0{last}")
