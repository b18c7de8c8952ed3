"""Whether this machine has a working NVIDIA driver: the GPU tests' expectations differ there."""

from __future__ import annotations


def nvml_works() -> bool:
    """NVML initialises (a driver and a GPU): the test reads real numbers instead of a refusal."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True
