"""`nvml: {}`: what the GPUs hold right now, read through NVML (no nvidia-smi process).

Per GPU: name, memory used/free/total (MiB), utilization, and each compute process with its pid,
GPU memory and name; a field the GPU does not report (unified-memory GPUs such as the GB10 have
no separate memory figures) reads "n/a". No driver -> ok False, "no NVIDIA driver: ...", never
an exception. NVML reads the GPUs of the machine ralph-run runs on, so on a remote (ssh) host
the task fails and says so rather than report the wrong machine's GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypedDict

import psutil
from pydantic import BaseModel, ConfigDict

from ralph_runner.actions import TaskContext, TaskResult

KEY = "nvml"
MIB = 1024 * 1024


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


Params = Options | None


def describe(params: Options | None, ctx: TaskContext) -> str:
    return "read the GPUs through NVML"


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"  # gone, or in another pid namespace (a container)


class GpuProcess(TypedDict):
    """A compute process on a GPU, as registered (`gpus[i].processes`)."""

    pid: int
    used_mib: int | None
    name: str


class GpuFacts(TypedDict):
    """One GPU, as registered (`gpus[i]`) and reported; a field NVML cannot give is None."""

    index: int
    name: str | None
    memory_used_mib: int | None
    memory_free_mib: int | None
    memory_total_mib: int | None
    utilization_percent: int | None
    processes: list[GpuProcess]


def gpu_facts(pynvml: Any, index: int) -> GpuFacts:
    """One GPU's facts; a field NVML cannot give is None."""

    def read(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except pynvml.NVMLError:
            return None

    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = read(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    rates = read(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    running = read(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
    return {
        "index": index,
        "name": read(lambda: pynvml.nvmlDeviceGetName(handle)),
        "memory_used_mib": memory and memory.used // MIB,
        "memory_free_mib": memory and memory.free // MIB,
        "memory_total_mib": memory and memory.total // MIB,
        "utilization_percent": rates and rates.gpu,
        "processes": [
            {
                "pid": p.pid,
                "used_mib": p.usedGpuMemory // MIB if p.usedGpuMemory is not None else None,
                "name": process_name(p.pid),
            }
            for p in running
        ],
    }


def shown(value: object, unit: str = "") -> str:
    return "n/a" if value is None else f"{value}{unit}"


def report(gpus: list[GpuFacts], driver: str | None) -> str:
    lines = [f"NVIDIA driver {shown(driver)}, {len(gpus)} GPU(s)"]
    for gpu in gpus:
        lines.append(
            f"GPU {gpu['index']}: {shown(gpu['name'])}, "
            f"{shown(gpu['memory_used_mib'], ' MiB')} used, "
            f"{shown(gpu['memory_free_mib'], ' MiB')} free, "
            f"{shown(gpu['memory_total_mib'], ' MiB')} total, "
            f"utilization {shown(gpu['utilization_percent'], '%')}"
        )
        lines += [
            f"  pid {p['pid']}: {shown(p['used_mib'], ' MiB')} {p['name']}"
            for p in gpu["processes"]
        ] or ["  no compute processes"]
    return "\n".join(lines)


def snapshot() -> tuple[bool, str, dict[str, object]]:
    """(ok, text, registered facts); NVML is always shut down again."""
    try:
        import pynvml
    except ImportError as exc:
        return False, f"no NVIDIA driver: {exc}", {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return False, f"no NVIDIA driver: {exc}", {}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = [gpu_facts(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:
        return False, f"NVML: {exc}", {}
    finally:
        pynvml.nvmlShutdown()
    return True, report(gpus, driver), {"gpus": gpus}


def run(params: Options | None, ctx: TaskContext) -> TaskResult:
    if ctx.connection.name != "local":
        return TaskResult(
            ok=False,
            output=f"nvml reads this machine's GPUs, not those of {ctx.connection.name}: "
            "use a shell task running nvidia-smi there",
        )
    started = time.monotonic()
    ok, output, data = snapshot()
    return TaskResult(ok=ok, output=output, seconds=time.monotonic() - started, data=data)
