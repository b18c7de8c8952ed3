"""Probe the service while a loop step runs; on death, cancel the step at once.

A step ends when its process ends: leaving the watch never waits for a round in flight. Its
checks go on in their probes' workers, and the next round that needs them (post-step's, the
next step's watch) takes them over (`Health` hands a running check on).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ralph_runner.liveness.health import Health
from ralph_runner.probes import ProbeResult


class Watch:
    """A background thread: a health check every `every` s; a death sets `cancel`."""

    def __init__(
        self,
        health: Health,
        every: float,
        iteration: int,
        on_round: Callable[[], None] | None = None,
    ) -> None:
        self.health, self.every, self.iteration = health, every, iteration
        self.on_round = on_round  # after each round that found the service alive
        self.cancel = threading.Event()  # the step's cancel: set on death
        self.rounds: list[list[ProbeResult]] | None = None  # the confirming rounds, on death
        self._done = threading.Event()
        self._verdict = threading.Lock()  # a death is reported before the step ends, or never
        self._thread = threading.Thread(target=self._watch, name="watch", daemon=True)

    def __enter__(self) -> Watch:
        if self.every > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._verdict:  # from here on, `rounds` stays as it is
            self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(self._until_due()):
            alive, rounds = self.health.check(self.iteration, cancel=self._done)
            with self._verdict:
                if self._done.is_set():
                    return  # the step has ended: post-step probes see what this round saw
                if not alive:
                    self.rounds = rounds
                    self.cancel.set()
                    return
            if self.on_round is not None:
                self.on_round()

    def _until_due(self) -> float:
        """`every` s after the last round of any source (ensure_alive, the watch of the step
        before): a step that follows another keeps the period, so no gap exceeds `every`."""
        return max(0.0, self.every - (time.monotonic() - self.health.last_round))
