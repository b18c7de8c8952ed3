"""ensure_alive, the seed's function made declarative: probe, confirm, capture, report, recover."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ralph_runner.deaths import wiring
from ralph_runner.deaths.log import DeathLog
from ralph_runner.errors import GaveUp
from ralph_runner.liveness import diagnostics, recovery
from ralph_runner.liveness.health import Health
from ralph_runner.loop.state import State
from ralph_runner.probes import ProbeResult
from ralph_runner.runbook import tasks
from ralph_runner.runbook.plan import Plan


class Service:
    """The watched service of one plan: one Health, one death log, the run's state."""

    def __init__(
        self,
        plan: Plan,
        health: Health,
        death_log: DeathLog,
        state: State,
        save: Callable[[], None],
        stop: threading.Event,
        emit: Callable[..., None],
    ) -> None:
        self.plan, self.health, self.death_log = plan, health, death_log
        self.state, self.save, self.stop, self.emit = state, save, stop, emit
        self.config = plan.model.recovery

    def ensure_alive(self, phase: str, facts: dict[str, Any], iteration: int | None) -> None:
        """Returns when healthy (at once) or recovered; raises GaveUp when it cannot be."""
        if not self.plan.runbook.probes:
            return
        alive, rounds = self.health.check(iteration, cancel=self.stop)
        if not alive:
            self.died(phase, rounds, facts)

    def died(self, phase: str, rounds: list[list[ProbeResult]], facts: dict[str, Any]) -> None:
        """Record the death with every diagnostic, then recover or give up."""
        now = time.time()
        state = self.state
        state.deaths += 1
        state.death_times.append(now)
        number = state.deaths
        failing = next((r for r in rounds[-1] if not r.ok), None) if rounds else None
        state.last_death = {
            "death": number,
            "time": iso_time(now),
            "phase": phase,
            "item": (facts.get("item") or {}).get("text"),
            "reason": failing and f"{failing.name}: {failing.reason} ({failing.detail})",
        }
        self.save()
        self.emit("death", death=number, phase=phase, reason=state.last_death["reason"])
        death = recovery.death_of(number, phase, iso_time(now), rounds[-1] if rounds else [])
        variables = {**facts.get("variables", {}), "phase": phase, "deaths": number, "death": death}
        group = diagnostics.group_for(self.plan)
        self.emit("capture", collectors=len(self.plan.runbook.collectors))
        started = time.monotonic()
        collected = diagnostics.collect(self.plan.runbook.collectors, group, variables)
        record = {
            "event": "death",
            "death": number,
            "time": iso_time(now),
            "host": self.plan.host,
            "runbook": str(self.plan.runbook.path),
            "service": self.plan.variables.get("service_name", self.plan.model.name),
            **{k: v for k, v in facts.items() if k != "variables"},
            "phase": phase,
            "probes": [r.as_dict() for r in rounds[-1]] if rounds else [],
            "probe_rounds": len(rounds),
            "collectors": collected,
            "capture_seconds": round(time.monotonic() - started, 3),
        }
        record.update(wiring.at_death(self.plan, record))  # recorder window, signature
        self.death_log.write_death(record)
        self.emit("report", death=number, log=str(self.death_log.log_path))
        outcome = self._recover_or_reason(now, variables)
        self.death_log.write_recovery(
            {
                "event": "recovery",
                "death": number,
                "time": iso_time(time.time()),
                "attempts": outcome.attempts,
                "recovered": outcome.recovered,
                "seconds": round(outcome.seconds, 3),
                "reason": outcome.reason,
                "steps": outcome.steps,
            }
        )
        self.emit(
            "recovery",
            death=number,
            recovered=outcome.recovered,
            attempts=outcome.attempts,
            seconds=round(outcome.seconds, 3),
            reason=outcome.reason,
        )
        if not outcome.recovered:
            raise GaveUp(
                f"service not recovered: {outcome.reason}", exit_code=self.config.exit_code
            )

    def _recover_or_reason(self, now: float, variables: dict) -> recovery.Outcome:
        window = self.config.crash_loop
        recent = [t for t in self.state.death_times if now - t <= window.within]
        if len(recent) > window.deaths:
            reason = (
                f"crash loop: {len(recent)} deaths within {window.within:g} s "
                f"(crash_loop allows {window.deaths}); a person should look"
            )
            return recovery.Outcome(False, 0, 0.0, reason)
        group = tasks.TaskGroup(self.plan)  # recovery steps run on the target host

        return recovery.recover(
            self.config,
            self.plan.runbook.recovery_steps,
            group,
            variables,
            self.health,
            self.stop,
            self.emit,
        )


def iso_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")
