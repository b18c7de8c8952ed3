"""The signs that a server rots (issue 40), measured against its own baseline since its start.

Pure computation: fed scrapes of /metrics (and the process's resident memory), it says which
sign has held for `sustained_for` s. Like with like: decode speed is the inter-token latency
histogram's deltas between scrapes (tokens per second of decode, per running request), never
whole requests mixed with their prefills; time to first token is its histogram's mean over the
same window. A window with too few tokens (an idle server) says nothing, and neither extends
nor ends a breach.

- decode_drop D: decode tokens/s below (1 - D) x the baseline's
- first_token_rise R: mean time to first token above (1 + R) x the baseline's
- preemptions_per_minute P: over P preemptions a minute
- memory_limit_mb M with memory_horizon H: resident memory's slope (least squares over the
  window) reaches M within H s, or it is already past M

The baseline is measured over `baseline` s once `warmup` s of the server's life have passed;
a new server (its process_start_time_seconds changed, or a counter went down) starts over.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ralph_runner.plugins import prometheus_text

MIB = 1024 * 1024


@dataclass(frozen=True)
class Names:
    """The series read (vLLM's by default; older vLLM: vllm:time_per_output_token_seconds)."""

    inter_token: str = "vllm:inter_token_latency_seconds"
    first_token: str = "vllm:time_to_first_token_seconds"
    preemptions: str = "vllm:num_preemptions_total"
    resident: str = "process_resident_memory_bytes"
    started: str = "process_start_time_seconds"


@dataclass(frozen=True)
class Scrape:
    """One look at the server: histogram sums and counts, counters, resident memory."""

    at: float  # monotonic seconds
    inter_token_seconds: float = 0.0
    inter_tokens: float = 0.0
    first_token_seconds: float = 0.0
    first_tokens: float = 0.0
    preemptions: float = 0.0
    resident_bytes: float | None = None
    started: float | None = None  # the server process's start (a new one starts the signs over)


def parse(text: str, at: float, names: Names = Names()) -> Scrape:
    """A scrape from /metrics' text (every engine's samples summed)."""
    wanted = {
        f"{names.inter_token}_sum": "inter_token_seconds",
        f"{names.inter_token}_count": "inter_tokens",
        f"{names.first_token}_sum": "first_token_seconds",
        f"{names.first_token}_count": "first_tokens",
        names.preemptions: "preemptions",
        names.resident: "resident_bytes",
        names.started: "started",
    }
    sums: dict[str, float] = {}
    for sample in prometheus_text.samples(text, list(wanted)):
        key = wanted[sample.name]
        sums[key] = sums.get(key, 0.0) + sample.value
    return Scrape(
        at=at,
        inter_token_seconds=sums.get("inter_token_seconds", 0.0),
        inter_tokens=sums.get("inter_tokens", 0.0),
        first_token_seconds=sums.get("first_token_seconds", 0.0),
        first_tokens=sums.get("first_tokens", 0.0),
        preemptions=sums.get("preemptions", 0.0),
        resident_bytes=sums.get("resident_bytes"),
        started=sums.get("started"),
    )


@dataclass(frozen=True)
class Thresholds:
    """What counts as rot, and for how long (the runbook's `health.rejuvenate`)."""

    decode_drop: float | None = None
    first_token_rise: float | None = None
    preemptions_per_minute: float | None = None
    memory_limit_mb: float | None = None
    memory_horizon: float = 7200.0
    sustained_for: float = 600.0
    warmup: float = 60.0
    baseline: float = 300.0
    window: float = 120.0
    min_tokens: int = 200


@dataclass(frozen=True)
class Finding:
    """A sign that has held for `sustained_for` s: what, since when, and its numbers."""

    sign: str  # decode_drop | first_token_rise | preemptions | memory
    since: float  # monotonic: the breach began
    now: float  # the reading (tokens/s, s, preemptions/min, MiB)
    baseline: float | None  # its baseline (the limit for memory)
    text: str
    held: float = 0.0  # s it has held


@dataclass(frozen=True)
class Reading:
    """The window's numbers now (None: not enough to tell)."""

    decode: float | None = None  # tokens/s per running request
    first_token: float | None = None  # s, mean
    preemptions_per_minute: float | None = None
    resident_mb: float | None = None
    memory_slope_mb_per_hour: float | None = None


@dataclass
class Signs:
    """The signs of one server, fed one scrape at a time (`look`)."""

    limits: Thresholds
    born: float | None = None  # monotonic: the first scrape of this server
    started: float | None = None
    decode_baseline: float | None = None
    first_token_baseline: float | None = None
    reading: Reading = field(default_factory=Reading)
    breaches: dict[str, float] = field(default_factory=dict)  # sign -> since
    _base_from: Scrape | None = None
    _window: deque[Scrape] = field(default_factory=deque)

    def reset(self) -> None:
        """A new server: everything is measured again from its start."""
        self.born = self.started = self.decode_baseline = self.first_token_baseline = None
        self.reading, self._base_from = Reading(), None
        self.breaches.clear()
        self._window.clear()

    def age(self, now: float) -> float:
        return 0.0 if self.born is None else now - self.born

    def look(self, scrape: Scrape) -> list[Finding]:
        """One scrape in; the signs that have held for `sustained_for` s out."""
        last = self._window[-1] if self._window else None
        if last is not None and (
            scrape.started != self.started or scrape.inter_tokens < last.inter_tokens
        ):
            self.reset()
        if self.born is None:
            self.born, self.started = scrape.at, scrape.started
        self._window.append(scrape)
        limits = self.limits
        while len(self._window) > 2 and scrape.at - self._window[1].at >= limits.window:
            self._window.popleft()
        self._measure_baseline(scrape)
        self.reading = self._read()
        if scrape.at - self.born < limits.warmup:
            return []
        return self._breaches(scrape.at)

    def _measure_baseline(self, scrape: Scrape) -> None:
        limits = self.limits
        if self.decode_baseline is not None or self.born is None:
            return
        if scrape.at - self.born < limits.warmup:
            return
        if self._base_from is None:
            self._base_from = scrape
            return
        start = self._base_from
        tokens = scrape.inter_tokens - start.inter_tokens
        if scrape.at - start.at < limits.baseline or tokens < limits.min_tokens:
            return
        self.decode_baseline = _rate(tokens, scrape.inter_token_seconds - start.inter_token_seconds)
        self.first_token_baseline = _mean(
            scrape.first_token_seconds - start.first_token_seconds,
            scrape.first_tokens - start.first_tokens,
        )

    def _read(self) -> Reading:
        first, last = self._window[0], self._window[-1]
        span = last.at - first.at
        tokens = last.inter_tokens - first.inter_tokens
        decode = None
        if tokens >= self.limits.min_tokens:
            decode = _rate(tokens, last.inter_token_seconds - first.inter_token_seconds)
        first_token = _mean(
            last.first_token_seconds - first.first_token_seconds,
            last.first_tokens - first.first_tokens,
        )
        preemptions = (last.preemptions - first.preemptions) * 60.0 / span if span > 0 else None
        memory = [(s.at, s.resident_bytes / MIB) for s in self._window if s.resident_bytes]
        slope = None
        if len(memory) >= 3 and memory[-1][0] > memory[0][0]:
            times, sizes = zip(*memory, strict=True)
            slope = statistics.linear_regression(times, sizes).slope * 3600.0
        return Reading(
            decode=decode,
            first_token=first_token,
            preemptions_per_minute=preemptions,
            resident_mb=memory[-1][1] if memory else None,
            memory_slope_mb_per_hour=slope,
        )

    def _breaches(self, now: float) -> list[Finding]:
        found: list[Finding] = []
        for sign, breached, numbers in self._states():
            if breached is None:
                continue  # not enough to tell: the breach neither ends nor begins
            if not breached:
                self.breaches.pop(sign, None)
                continue
            since = self.breaches.setdefault(sign, now)
            if now - since >= self.limits.sustained_for:
                value, baseline, text = numbers
                found.append(Finding(sign, since, value, baseline, text, now - since))
        return found

    def _states(self) -> list[tuple[str, bool | None, tuple[float, float | None, str]]]:
        """Each declared sign: breached (None: cannot tell now) and its numbers."""
        limits, reading = self.limits, self.reading
        states: list[tuple[str, bool | None, tuple[float, float | None, str]]] = []
        if limits.decode_drop is not None and self.decode_baseline is not None:
            base, now = self.decode_baseline, reading.decode
            drop = None if now is None else 1.0 - now / base
            breached = None if drop is None else drop >= limits.decode_drop
            text = f"decode {now or 0:.1f} tokens/s, {drop or 0:.0%} below its baseline {base:.1f}"
            states.append(("decode_drop", breached, (now or 0.0, base, text)))
        if limits.first_token_rise is not None and self.first_token_baseline is not None:
            base, ttft = self.first_token_baseline, reading.first_token
            breached = None if ttft is None else ttft >= base * (1.0 + limits.first_token_rise)
            text = f"time to first token {ttft or 0:.3f} s, baseline {base:.3f} s"
            states.append(("first_token_rise", breached, (ttft or 0.0, base, text)))
        if limits.preemptions_per_minute is not None:
            rate = reading.preemptions_per_minute
            breached = None if rate is None else rate > limits.preemptions_per_minute
            most = limits.preemptions_per_minute
            text = f"{rate or 0:.1f} preemptions a minute (at most {most:g})"
            states.append(("preemptions", breached, (rate or 0.0, None, text)))
        if limits.memory_limit_mb is not None:
            states.append(self._memory(limits.memory_limit_mb))
        return states

    def _memory(self, limit: float) -> tuple[str, bool | None, tuple[float, float | None, str]]:
        reading, horizon = self.reading, self.limits.memory_horizon
        mb, slope = reading.resident_mb, reading.memory_slope_mb_per_hour
        if mb is None or slope is None:
            return ("memory", None, (0.0, limit, ""))
        if mb >= limit:
            reaches = 0.0
        elif slope > 0:
            reaches = (limit - mb) / slope * 3600.0
        else:
            reaches = float("inf")
        text = (
            f"resident {mb:.0f} MiB growing {slope:.0f} MiB/h: the limit {limit:g} MiB "
            f"in {reaches:.0f} s (horizon {horizon:g} s)"
        )
        return ("memory", reaches <= horizon, (mb, limit, text))


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _mean(total: float, count: float) -> float | None:
    return total / count if count > 0 else None
