"""Tell people: Apprise notifications and a dead man's switch, sent in the background.

Apprise speaks ntfy, Slack, Discord, email, Telegram, `json://` and a hundred more from one URL
each. Every message goes through one daemon worker: an attempt that hangs past `timeout` is
abandoned (its thread left to finish on its own), a failed one is retried `retries` times, and
either way the loop never waits. The dead man's switch is healthchecks.io's protocol: `/start`
when a run starts, the bare URL at each iteration, `/<exit code>` at exit, so someone else
notices when the loop itself dies (no ping) or ends badly (a non-zero code).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import apprise
import httpx

from ralph_runner import events
from ralph_runner.errors import ExitCode, FatalError
from ralph_runner.runbook.plan import Plan
from ralph_runner.runbook.schema import Notify

RETRY_PAUSE = 1.0  # seconds between attempts of one message
EXIT_EVENTS: dict[int, str] = {
    ExitCode.DONE: "finished",
    ExitCode.MAX_ITERATIONS: "stopped",
    ExitCode.AGENT_BROKEN: "agent-broken",
}  # gave-up comes with its reason


@dataclass
class Message:
    event: str
    title: str
    body: str


@dataclass
class Targets:
    """The runbook's `notify:` rendered for one host (URLs may hold templated tokens)."""

    to: list[tuple[str, set[str]]]  # (Apprise URL, the events it wants)
    deadman: str | None


def targets(plan: Plan) -> Targets:
    """Render and check every URL: one Apprise cannot send to would page no one."""
    config = plan.model.notify
    to = []
    for index, target in enumerate(config.to):
        where = plan.runbook.where(("notify", "to", index, "url"))
        url = plan.templar.render(target.url, plan.variables, where=where)
        if not apprise.Apprise().add(url):
            message = "Apprise cannot parse this URL (see Apprise's list of services)"
            raise FatalError(replace(where, message=message))
        to.append((url, set(target.events)))
    deadman = config.deadman
    if deadman is not None:
        where = plan.runbook.where(("notify", "deadman"))
        deadman = plan.templar.render(deadman, plan.variables, where=where)
        if not deadman.startswith(("http://", "https://")):
            raise FatalError(replace(where, message="the dead man's switch needs an http(s) URL"))
    return Targets(to, deadman)


class Notifier:
    """An event follower: turns loop events into messages for the targets that want them."""

    def __init__(
        self, config: Notify, targets: Targets, host: str, warn: Callable[[str], None]
    ) -> None:
        self.config, self.host, self.warn = config, host, warn
        self.deadman = targets.deadman
        self._targets: list[tuple[apprise.Apprise, set[str]]] = []
        for url, wanted in targets.to:
            client = apprise.Apprise()
            client.add(url)
            self._targets.append((client, wanted))
        self._jobs: queue.SimpleQueue[Callable[[], bool] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._waiting = False  # paused or waiting out a usage limit: the switch is kept alive
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="notify", daemon=True).start()
        if self.deadman:
            threading.Thread(target=self._keep_alive, name="deadman", daemon=True).start()
        self._ping("/start")

    def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.IterationStarted):
            self._ping("")
        if isinstance(event, events.Paused):
            self._waiting = True
        elif isinstance(event, events.UsageLimitHit):
            self._waiting = not event.ends_run
        elif isinstance(event, events.Resumed | events.IterationStarted):
            self._waiting = False
        message = self._message(event)
        if message is not None:
            self.send(message)

    def close(self, code: int) -> None:
        """The run's end: its event, the switch's exit ping, then at most `timeout` s of wait
        for what is still queued (a gave-up page matters more than a prompt exit)."""
        event = EXIT_EVENTS.get(code)
        if event is not None:
            self.send(Message(event, f"ralph-run {event} on {self.host}", f"exit code {code}"))
        self._closed.set()
        self._ping(f"/{code}")
        self._jobs.put(None)
        if not self._idle.wait(self.config.timeout):
            self.warn(f"{self._pending} notification(s) still unsent at exit")

    def send(self, message: Message) -> None:
        for client, wanted in self._targets:
            if message.event in wanted:
                self._submit(_delivery(client, message))

    def _message(self, event: events.Event) -> Message | None:
        host = self.host
        match event:
            case events.Death():
                title = f"ralph-run: death #{event.death} on {host}"
                return Message("death", title, f"at {event.phase}: {event.reason}")
            case events.Recovery(recovered=True):
                body = f"death #{event.death}: healthy again after {event.seconds:.0f} s"
                return Message("recovered", f"ralph-run: recovered on {host}", body)
            case events.Recovery():
                body = f"death #{event.death} not recovered: {event.reason}"
                return Message("gave-up", f"ralph-run gave up on {host}", body)
            case events.UsageLimitHit():
                reset = "no reset time given" if event.guessed else f"resets at {event.reset}"
                then = (
                    f"stopped (exit {event.exit_code}): run again later"
                    if event.ends_run
                    else f"waiting {event.seconds:.0f} s, then {event.item!r} again"
                )
                body = f"{event.source}: {event.line}; {reset}; {then}"
                return Message("limited", f"ralph-run: usage limit on {host}", body)
            case events.Paused():
                killed = f" ({event.killed} stopped)" if event.killed else ""
                body = f"at iteration {event.iteration}{killed}; `ralph-run resume` goes on"
                return Message("paused", f"ralph-run paused on {host}", body)
            case events.Resumed():
                body = f"after {event.seconds:.0f} s paused"
                return Message("resumed", f"ralph-run resumed on {host}", body)
        return None

    def _ping(self, suffix: str) -> None:
        if self.deadman:
            url = self.deadman.rstrip("/") + suffix
            timeout = self.config.timeout
            self._submit(lambda: httpx.get(url, timeout=timeout).is_success)

    def _keep_alive(self) -> None:
        """Ping every `deadman_every` s while the loop waits: no iteration ends then, and a
        switch that hears nothing for its period pages someone for a loop that is fine."""
        while not self._closed.wait(self.config.deadman_every):
            if self._waiting:
                self._ping("")

    def _submit(self, attempt: Callable[[], bool]) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._jobs.put(attempt)

    def _serve(self) -> None:
        while (attempt := self._jobs.get()) is not None:
            self._deliver(attempt)
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.set()

    def _deliver(self, attempt: Callable[[], bool]) -> None:
        why = "failed"
        for number in range(self.config.retries + 1):
            if number:
                time.sleep(RETRY_PAUSE)
            outcome = _bounded(attempt, self.config.timeout)
            if outcome is True:
                return
            why = "timed out" if outcome is None else "failed"
        self.warn(f"notification {why} after {self.config.retries + 1} attempt(s)")


def _delivery(client: apprise.Apprise, message: Message) -> Callable[[], bool]:
    """One attempt at sending `message` through `client`: True when Apprise reports success."""
    return lambda: bool(client.notify(body=message.body, title=message.title))


def _bounded(attempt: Callable[[], bool], timeout: float) -> bool | None:
    """Run `attempt` on a thread of its own for at most `timeout` s: its result, False when it
    raised, None when it is still running (left behind as a daemon: it cannot block exit)."""
    result: list[bool] = []

    def run() -> None:
        try:
            result.append(bool(attempt()))
        except Exception:
            result.append(False)

    thread = threading.Thread(target=run, name="notify attempt", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else None
