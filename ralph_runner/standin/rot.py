"""The stand-in's rot: a server that degrades without dying, as vLLM's do (issue 40).

vLLM users report servers warm for an hour with slower decode and a longer time to first token
(vLLM #42484), host memory that grows until the OOM killer ends the server mid-generation
(#44175; llama.cpp #27725), preemption storms (#25538). ralph-run restarts such a server at an
item boundary before it dies (loop/rejuvenation.py); the tests drive this with a real process.

Set at start (`--decode-halflife` and the rest; start_server.sh passes them from its
environment), each off at 0:

option                   what the stand-in does
------------------------ --------------------------------------------------------------------
decode_halflife S        decode tokens/s per sequence halves every S seconds of the server's age
decode_floor R           ... but never below R tokens/s
leak_kb_per_request K    each generation keeps K KiB of real, written memory for ever
memory_limit_mb M        resident memory past M MiB: `Out of memory`, then SIGKILL (the OOM
                         killer's way: no exit marker, no shutdown lines)
preemptions_per_request N  each generation counts N preemptions (vllm:num_preemptions_total)

A restarted server starts fresh: full speed, its memory back, no preemption.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PAGE = resource.getpagesize()


@dataclass(frozen=True)
class RotSettings:
    """How the server degrades (the table above); 0 is off."""

    decode_halflife: float = 0.0
    decode_floor: float = 0.0
    leak_kb_per_request: int = 0
    memory_limit_mb: float = 0.0
    preemptions_per_request: int = 0


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm: pages)."""
    try:
        fields = Path("/proc/self/statm").read_text(encoding="ascii").split()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, not now
    return int(fields[1]) * PAGE


class Rot:
    """The server's age, its speed by age, and the memory it keeps (thread-safe)."""

    def __init__(self, settings: RotSettings, tokens_per_second: float) -> None:
        self.settings = settings
        self.base = tokens_per_second
        self.born = time.monotonic()
        self.kept: list[bytearray] = []
        self._lock = threading.Lock()

    def decode_rate(self, now: float | None = None) -> float | None:
        """Tokens/s per sequence at this age (None: decode does not rot)."""
        halflife = self.settings.decode_halflife
        if not halflife:
            return None
        age = (time.monotonic() if now is None else now) - self.born
        return max(self.settings.decode_floor, self.base * 0.5 ** (age / halflife))

    def leak(self) -> None:
        """One generation's leak: written bytes, so that they are resident."""
        size = self.settings.leak_kb_per_request * 1024
        if size:
            with self._lock:
                self.kept.append(bytearray(b"\x5a") * size)

    def over_limit(self) -> int | None:
        """Resident MiB when past memory_limit_mb (None: under it, or no limit)."""
        limit = self.settings.memory_limit_mb
        if not limit:
            return None
        mib = resident_bytes() // (1024 * 1024)
        return mib if mib > limit else None


def oom_kill() -> None:
    """The kernel's OOM killer: SIGKILL, nothing written after it."""
    os.kill(os.getpid(), signal.SIGKILL)
