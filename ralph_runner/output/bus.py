"""The run's event bus: `emit(event)` is the one way a run reports; followers observe.

Control is not a follower: what must happen on a death (kill the attempts in flight) is called
by the service itself (liveness/service.py, `DeathControl`); a follower that raises is dropped
with a warning and the run goes on."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

from ralph_runner import events
from ralph_runner.durable.redaction import Redactor

if TYPE_CHECKING:
    from ralph_runner.output.console import Console


class Follower(Protocol):
    """Follows the run's events (the history, the metrics textfile, the notifier, the pause
    control, the console), each by the event's class."""

    def on_event(self, event: events.Event) -> None: ...


class EventBus:
    """`emit(event)` is the one way the run reports; thread-safe. Every follower, the console
    last, sees the event with its secrets masked."""

    def __init__(self, console: Console, redactor: Redactor | None = None) -> None:
        self.console = console
        self.redactor = redactor or Redactor([])
        self._followers: list[Follower] = []
        # one event at a time: workers' threads emit too, and followers (the history) append
        self._emitting = threading.RLock()

    @property
    def verbose(self) -> int:
        return self.console.verbose

    def follow(self, follower: Follower) -> None:
        """Also hand every event to `follower`: the iteration history, the metrics textfile and
        notifications follow the loop this way, not by hooks in it. A follower that raises is
        reported once as a warning and dropped; the loop goes on."""
        self._followers.append(follower)

    def emit(self, event: events.Event) -> None:
        event = events.masked(event, self.redactor.data(event.json_fields()))
        with self._emitting:
            for follower in list(self._followers):
                try:
                    follower.on_event(event)
                except Exception as exc:  # a broken follower must never stop the loop
                    self._followers.remove(follower)
                    self.warn(f"event listener {follower!r} failed: {exc}")
            self.console.on_event(event)

    def warn(self, message: str) -> None:
        self.emit(events.Warned(message=message))
