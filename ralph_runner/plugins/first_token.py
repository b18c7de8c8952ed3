"""How long a prompt should take to its first token: the pace measured, and by what.

The hang bound must cover a prompt's first engine step, the one step that comes before anything
of that prompt can be seen (docs: hangs). It is the prompt's size in tokens times a pace
(seconds per prompt token), taken from the most precise source that has measured one:

1. ENGINE: the engine's own numbers (vLLM's prefill-time and prompt-token histograms,
   llama.cpp's prompt seconds and tokens), read at every scrape: every finished request of any
   client, the probe's own included;
2. STREAMED: this loop's streamed requests (the agent proxy times their first token);
3. CALIBRATION: one request of known size the probe sends at the run's first healthy check when
   nothing above has measured yet (a prefill of about CALIBRATION_WORDS words, 1 token out);
4. WHOLE: this loop's requests answered whole (not streamed): their whole time is an upper bound
   of their first token;
5. none: the ceiling.

A measure of few tokens a request (a canary) is overhead, not pace: it bounds what any prompt
takes, never the time per token. The calibration's measure is kept for the run (the prefix
cache makes an agent's later prompts look faster than a new one's first step: the calibration,
its prefix a fresh nonce, is never cached); the others for WINDOW s, the slowest counting.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import httpx

from ralph_runner.plugins.bounded_http import fetch

Source = Literal["the engine's histograms", "this loop's streamed requests", "calibration",
                 "this loop's whole answers (an upper bound)"]  # fmt: skip
ENGINE: Source = "the engine's histograms"
STREAMED: Source = "this loop's streamed requests"
CALIBRATION: Source = "calibration"
WHOLE: Source = "this loop's whole answers (an upper bound)"
SOURCES: tuple[Source, ...] = (ENGINE, STREAMED, CALIBRATION, WHOLE)
MIN_TOKENS = 256  # prompt tokens a request below which a measure is overhead, not pace
WINDOW = 900.0  # s a measure counts (but the calibration's): an engine's pace is what it is now
TOKENS_PER_BYTE = 0.5  # a request body's prompt tokens per byte before a usage answer measured it
CALIBRATION_WORDS = 700  # words of the calibration prompt: about 1,000 tokens in most tokenizers
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
]


@dataclass(frozen=True)
class Measure:
    """`requests` requests took `seconds` (summed) to their first token for `tokens` prompt
    tokens (summed), measured at `when` (monotonic) by `source`."""

    source: Source
    seconds: float
    tokens: float
    when: float
    requests: float = 1.0

    def pace(self) -> float | None:
        """Seconds per prompt token; None for a measure of overhead (few tokens a request)."""
        if self.tokens <= 0 or self.requests <= 0 or self.tokens / self.requests < MIN_TOKENS:
            return None
        return self.seconds / self.tokens


@dataclass(frozen=True)
class Expectation:
    """What a prompt should take to its first token, and the source of the pace."""

    seconds: float
    source: Source | Literal["overhead"]


def expected(measures: Iterable[Measure], tokens: float, now: float) -> Expectation | None:
    """`tokens` x the slowest pace of the most precise source (never below the calibration's),
    and never less than the slowest request of few tokens; None when no pace is known for a
    prompt that needs one."""
    recent = [m for m in measures if m.source == CALIBRATION or m.when >= now - WINDOW]
    small = [m for m in recent if m.source != WHOLE and m.pace() is None and m.requests > 0]
    overhead = max((m.seconds / m.requests for m in small), default=0.0)
    calibrated = [p for m in recent if m.source == CALIBRATION and (p := m.pace()) is not None]
    for source in SOURCES:
        paces = [p for m in recent if m.source == source and (p := m.pace()) is not None]
        if paces:
            pace = max(paces)
            if source in (ENGINE, STREAMED) and calibrated and max(calibrated) > pace:
                pace, source = max(calibrated), CALIBRATION
            if tokens * pace >= overhead:
                return Expectation(tokens * pace, source)
            return Expectation(overhead, "overhead")
    if tokens < MIN_TOKENS and overhead > 0:
        return Expectation(overhead, "overhead")
    return None


def knows_pace(measures: Iterable[Measure], now: float) -> bool:
    """Has any source measured a pace (not only overhead)?"""
    return expected(measures, MIN_TOKENS, now) is not None


@dataclass(frozen=True)
class EngineCounts:
    """The engine's own numbers at one scrape (None: /metrics lacks them): its prefill seconds,
    prompt tokens and prefilled requests, summed since it started, and its steps."""

    seconds: float | None
    tokens: float | None
    requests: float | None
    steps: float | None


@dataclass
class EngineMeter:
    """The engine's numbers across scrapes: a measure where requests finished their prefill
    since the last scrape, and the steps it counted, to tell how many ran since a time."""

    last: EngineCounts | None = None
    # (when, steps counted, the engine idle then) at each scrape, the latest
    steps_seen: deque[tuple[float, float, bool]] = field(default_factory=lambda: deque(maxlen=16))

    def read(self, counts: EngineCounts, now: float, idle: bool) -> Measure | None:
        """This scrape's numbers (`idle`: no request active or queued); the measure of the
        requests prefilled since the last one."""
        last, self.last = self.last, counts
        if counts.steps is not None:
            if self.steps_seen and counts.steps < self.steps_seen[-1][1]:
                self.steps_seen.clear()  # a new server: its count starts again
            self.steps_seen.append((now, counts.steps, idle))
        if last is None or None in (counts.seconds, counts.tokens, last.seconds, last.tokens):
            return None
        assert counts.seconds is not None and counts.tokens is not None  # for mypy: just checked
        assert last.seconds is not None and last.tokens is not None
        seconds, tokens = counts.seconds - last.seconds, counts.tokens - last.tokens
        requests = 1.0
        if counts.requests is not None and last.requests is not None:
            requests = counts.requests - last.requests
        if tokens <= 0 or seconds < 0 or requests <= 0:
            return None  # nothing finished, or a new server (its sums start again)
        return Measure(ENGINE, seconds, tokens, now, requests)

    def steps_since(self, when: float, settled: float) -> float:
        """Steps the engine counted since `when`: since the last scrape before it when that
        one saw the engine idle after the loop's last request ended (`settled`: no step
        between is of a request of the loop's that was already there), else since the first
        scrape after it (a lower bound); 0 when it counts none. Another client's request
        between that scrape and `when` counts too (docs: hangs, several loops on one server)."""
        before = [(at, count, idle) for at, count, idle in self.steps_seen if at <= when]
        after = [count for at, count, _ in self.steps_seen if at > when]
        if not after:
            return 0.0
        quiet = before and before[-1][2] and before[-1][0] > settled
        return after[-1] - (before[-1][1] if quiet else after[0])


class Calibration:
    """One chat completion of about CALIBRATION_WORDS words and 1 token out, on a thread of its
    own (a slow engine's prefill may outlast a check): its time and prompt tokens (the answer's
    usage) are a measure. Its prompt starts with a nonce so that no prefix cache answers it."""

    def __init__(
        self, client: httpx.Client, url: str, model: str, headers: dict[str, str], timeout: float
    ) -> None:
        self.sent = time.monotonic()
        self.tokens = CALIBRATION_WORDS * 1.5  # until the answer says
        self.measure: Measure | None = None
        self.error: str | None = None
        self.told = False  # its failure said once, in a check's detail
        self.ended = 0.0  # when its answer came or it failed (monotonic)
        self.done = threading.Event()
        words = " ".join(WORDS[i % len(WORDS)] for i in range(CALIBRATION_WORDS))
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"{secrets.token_hex(8)} {words}"}],
            "max_tokens": 1,
        }
        target = f"{url.rstrip('/')}/chat/completions"
        args = (client, target, body, headers, timeout)
        threading.Thread(target=self._send, args=args, name="calibration", daemon=True).start()

    def wait(self, seconds: float) -> bool:
        return self.done.wait(max(seconds, 0.0))

    def _send(
        self,
        client: httpx.Client,
        url: str,
        body: dict[str, object],
        headers: dict[str, str],
        timeout: float,
    ) -> None:
        try:
            response = fetch(client, "POST", url, timeout=timeout, json=body, headers=headers)
            took = time.monotonic() - self.sent
            usage = response.json().get("usage") if response.status_code == 200 else None
            prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            if isinstance(prompt, int) and prompt > 0:
                self.measure = Measure(CALIBRATION, took, prompt, time.monotonic())
            else:
                self.error = f"HTTP {response.status_code}, no prompt_tokens in its usage"
        except Exception as exc:  # its thread's end: any failure leaves the pace unmeasured
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended = time.monotonic()
            self.done.set()
