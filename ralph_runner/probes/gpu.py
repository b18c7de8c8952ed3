"""`gpu: {index, min_free_mib, max_used_percent}`: the GPU answers NVML and has room.

A GPU that fell off the bus, or memory still held by a dead server, shows up here. No driver
(or no `pynvml`) is a failed probe, reason error, never an exception.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from ralph_runner.plugins.fields import Templated
from ralph_runner.probes import ProbeContext, Verdict

KIND = "gpu"
MIB = 1024 * 1024


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: Templated[NonNegativeInt] = 0  # the GPU's NVML index
    min_free_mib: Templated[NonNegativeInt] | None = None  # fails with fewer MiB of memory free
    # fails with more than this percent of its memory used
    max_used_percent: Templated[Annotated[float, Field(ge=0, le=100)]] | None = None


def verdict(params: Params, used: int, total: int) -> Verdict:
    free_mib, used_mib, total_mib = (total - used) // MIB, used // MIB, total // MIB
    percent = 100 * used / total if total else 0.0
    detail = f"GPU {params.index}: {used_mib} MiB used, {free_mib} MiB free of {total_mib} MiB"
    min_free, max_used = params.min_free_mib, params.max_used_percent
    # check() is given params already rendered: the limits are numbers, no templates
    assert not isinstance(min_free, str) and not isinstance(max_used, str)
    if min_free is not None and free_mib < min_free:
        return Verdict(False, "status", f"{detail} (want >= {min_free} MiB free)")
    if max_used is not None and percent > max_used:
        return Verdict(False, "status", f"{detail} ({percent:.1f}% used, want <= {max_used:g}%)")
    return Verdict(True, None, detail)


def check(params: Params, ctx: ProbeContext) -> Verdict:
    try:
        import pynvml
    except ImportError as exc:
        return Verdict(False, "error", f"no NVIDIA driver ({exc})")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Verdict(False, "error", f"no NVIDIA driver ({exc})")
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(params.index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return verdict(params, memory.used, memory.total)
    except pynvml.NVMLError as exc:
        return Verdict(False, "error", f"GPU {params.index}: NVML: {exc}")
    finally:
        pynvml.nvmlShutdown()
