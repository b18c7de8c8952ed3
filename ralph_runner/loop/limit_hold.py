"""A usage limit with `loop.workers` > 1: one worker's limit holds every worker until its reset.

Why: the quota is the agent's (one subscription, one endpoint), shared by all the workers, so
the attempts another worker would start meanwhile would only hit it too. The attempt that saw
the limit says it (`limited`, as one worker does: iteration.Iteration.limited) and costs no
strike; the pool then starts nothing until the latest reset seen (plus the margin), with a
countdown at most once a minute, and state.limited cleared when it comes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ralph_runner import events
from ralph_runner.loop import limits

if TYPE_CHECKING:
    from ralph_runner.loop.state import State
    from ralph_runner.output.bus import EventBus


class Hold:
    """No new attempt until `until` (epoch); `since`: the first limit of the streak, for
    limits.max_wait (as one worker's `limited_since`)."""

    def __init__(self) -> None:
        self.until: float | None = None
        self.item = ""
        self.since: float | None = None
        self._countdown_at = 0.0  # time.monotonic() of the next countdown line

    def extend(self, item: str, wait: limits.Wait) -> None:
        """A worker's attempt was limited: hold until its wait ends, if that is later."""
        if self.until is None or wait.until > self.until:
            self.until, self.item = wait.until, item
            self._countdown_at = time.monotonic() + limits.COUNTDOWN_EVERY

    def left(self) -> float | None:
        """Seconds the hold has left; None: no hold (or its time came)."""
        if self.until is None:
            return None
        left = self.until - time.time()
        return left if left > 0 else None

    def tell(self, bus: EventBus, state: State) -> bool:
        """Outside the pool's lock (it emits): a countdown line when one is due; at the hold's
        end, state.limited cleared. True when the state changed (a save is due)."""
        if self.until is None:
            return False
        left = self.left()
        if left is None:
            self.until = None
            state.limited = None
            return True
        if time.monotonic() >= self._countdown_at and left > 1:
            self._countdown_at = time.monotonic() + limits.COUNTDOWN_EVERY
            until = limits.when(self.until)
            bus.emit(events.LimitedWait(item=self.item, seconds=left, until=until))
        return False
