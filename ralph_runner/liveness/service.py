"""ensure_alive, the seed's function made declarative: probe, confirm, capture, report, recover.

Three things are not deaths of the kind the seed counted, and are told apart here:
- the first check of a run finds nothing listening, or a server still loading its model
  (llama.cpp answers 503 "Loading model"): the server is *not running* yet, so it is started
  or waited for (the recovery steps, as a start), recorded as a `start`, not a death;
- another loop on this host already recovers the same service: this loop records its own
  death, waits for that recovery (recovery_lock.py) and runs no step of its own;
- the server was restarted by someone else during an attempt (`restarted`): a death record,
  no recovery (it is up), and no strike for the agent.

A server that answers is trusted only when its loopback port is ours (port_owner.py): at every
check that finds it alive, and whenever a recovery, a start or someone else brings it back.
Another user's is a death of its own class that no recovery can mend: the run gives up.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Protocol

from ralph_runner import events
from ralph_runner.deaths.log import DeathLog
from ralph_runner.deaths.record import Blame, DeathRecord, DuringRecovery, Facts, Known, Outcome
from ralph_runner.deaths.wiring import Session
from ralph_runner.errors import GaveUp
from ralph_runner.liveness import diagnostics, faults, port_owner, recovery, recovery_lock
from ralph_runner.liveness.health import Health
from ralph_runner.probes import ProbeResult
from ralph_runner.runbook import tasks
from ralph_runner.runbook.plan import Plan
from ralph_runner.workspace.status_file import LastDeath, LastStart

# Why a service on another user's port is given up on at once (the recovery's reason)
UNRECOVERABLE = (
    "no recovery frees a port another user holds: stop their server, give ours a port or a unix "
    "socket of its own, or, if that user runs it for you, name them in health.trusted_users "
    "(docs/security.md)"
)


class ServiceState(Protocol):
    """What the service keeps in the run's state (loop/state.py's State), saved by `save`: its
    deaths, their times (the crash-loop window), the last death and the last start."""

    deaths: int
    death_times: list[float]
    last_death: LastDeath | None
    last_start: LastStart | None


class DeathControl(Protocol):
    """What the loop must do at a death, called by the service itself: a follower of the run's
    events that raises is dropped, and a control path must not be droppable."""

    def dying(self) -> Blame | None:
        """Said, not yet captured: stop the work in flight, start none until it is recovered;
        the items that were in flight, for the record (None: none was)."""

    def signed(self, death: int, signature: str | None) -> None:
        """Recorded, with its signature (a KV-cache pressure death sheds a worker)."""


class NoControl:
    """A service outside a loop (`ralph-run probe`, a fleet's check): nothing to stop."""

    def dying(self) -> Blame | None:
        return None

    def signed(self, death: int, signature: str | None) -> None:
        pass


class Service:
    """The watched service of one plan: one Health, one death log, the run's state, and the
    run's records (`session`: what a death record gets from the recorder, its signature)."""

    def __init__(
        self,
        plan: Plan,
        health: Health,
        death_log: DeathLog,
        state: ServiceState,
        save: Callable[[], None],
        stop: threading.Event,
        emit: Callable[[events.Event], None],
        session: Session,
    ) -> None:
        self.plan, self.health, self.death_log = plan, health, death_log
        self.state, self.save, self.stop, self.emit = state, save, stop, emit
        self.session = session
        self.control: DeathControl = NoControl()  # the loop's scheduler, once it has one
        self.config = plan.model.recovery
        self.checked = False  # has this run checked the service yet?
        self.owners_unknown = False  # said once: the ports' owners cannot be looked up here
        self.signatures: list[str] = []  # this run's deaths, by signature (the summary's)
        self.lock_key = recovery_lock.key_for(
            self.config.lock, [str(spec.params) for spec in health.probes]
        )
        recovery_lock.prepare()  # a directory another user made fails the start, not a recovery

    def ensure_alive(self, phase: str, facts: Facts, iteration: int | None) -> None:
        """Returns when healthy (at once) or recovered; raises GaveUp when it cannot be."""
        if not self.plan.runbook.probes:
            return
        first, self.checked = not self.checked, True
        alive, rounds = self.health.check(iteration, cancel=self.stop)
        if alive:
            self._ours(phase, rounds, facts)
            return
        if first and all(faults.not_serving_yet(r) for r in rounds[-1] if not r.ok):
            self.start(rounds, facts)
        else:
            self.died(phase, rounds, facts)

    def start(self, rounds: list[list[ProbeResult]], facts: Facts) -> None:
        """Nothing served at the run's first check (nothing listened, or a model was loading):
        start the service (the recovery steps) and record a `start`, which no death statistic
        counts."""
        now = time.time()
        failing = next(r for r in rounds[-1] if not r.ok)
        name = str(self.plan.variables.get("service_name", "the service"))
        self.emit(events.Start(service=name, reason=f"{failing.name}: {failing.detail}"))
        death = recovery.death_of(0, "start", iso_time(now), rounds[-1], faults.NOT_RUNNING)
        variables = {**facts.get("variables", {}), "phase": "start", "death": death}
        outcome = self._still_ours(self._recover_or_reason(now, variables, crash_loop=False))
        self.death_log.write_start(
            {
                "time": iso_time(now),
                "host": self.plan.host,
                "runbook": str(self.plan.runbook.path),
                "service": name,
                "probes": [r.as_dict() for r in rounds[-1]],
                **self.outcome_fields(outcome),
            }
        )
        self.state.last_start = {
            "time": iso_time(now),
            "recovered": outcome.recovered,
            "seconds": round(outcome.seconds, 1),
            "reason": outcome.reason,
        }
        self.save()
        self.emit(
            events.Started(
                recovered=outcome.recovered,
                seconds=round(outcome.seconds, 3),
                attempts=outcome.attempts,
                reason=outcome.reason,
                by=outcome.by,
            )
        )
        if not outcome.recovered:
            raise GaveUp(f"service not started: {outcome.reason}", exit_code=self.config.exit_code)

    def restarted(self, phase: str, evidence: str, facts: Facts) -> None:
        """A failed attempt during which another server came to answer (by another loop, a
        restart policy, a person): a death of its own class, no recovery (it is up again)."""
        self.died(phase, [], facts, fault=(faults.RESTARTED, evidence))

    def died(
        self,
        phase: str,
        rounds: list[list[ProbeResult]],
        facts: Facts,
        *,
        fault: tuple[str, str] | None = None,
        recover: bool | None = None,
    ) -> None:
        """Record the death with every diagnostic, then recover (unless it is up again, as
        after someone else's restart) or give up."""
        now = time.time()
        state = self.state
        state.deaths += 1
        state.death_times.append(now)
        number = state.deaths
        results = rounds[-1] if rounds else []
        fault_class, evidence = fault or faults.classify(results)
        state.last_death = {
            "death": number,
            "time": iso_time(now),
            "phase": phase,
            "item": (facts.get("item") or {}).get("text"),
            "reason": evidence,
            "fault": fault_class,
        }
        self.save()
        self.emit(events.Death(death=number, phase=phase, reason=evidence, fault=fault_class))
        blame = self.control.dying()
        death = recovery.death_of(number, phase, iso_time(now), results, fault_class)
        variables = {**facts.get("variables", {}), "phase": phase, "deaths": number, "death": death}
        group = diagnostics.group_for(self.plan)
        during = self._recovery_under_way()
        self.emit(
            events.Capture(
                collectors=len(self.plan.runbook.collectors),
                during_recovery=during["by"] if during else None,
            )
        )
        started = time.monotonic()
        collected = diagnostics.collect(self.plan.runbook.collectors, group, variables)
        rest = facts.copy()
        rest.pop("variables", None)  # the recovery steps', not the record's
        known: Known = rest
        record: DeathRecord = {
            "event": "death",
            "death": number,
            "time": iso_time(now),
            "host": self.plan.host,
            "runbook": str(self.plan.runbook.path),
            "service": str(self.plan.variables.get("service_name", self.plan.model.name)),
            **known,
            "phase": phase,
            "fault": fault_class,
            "evidence": evidence,
            "probes": [r.as_dict() for r in results],
            "probe_rounds": len(rounds),
            "collectors": collected,
            "capture_seconds": round(time.monotonic() - started, 3),
            **({"during_recovery": during} if during else {}),
            **({"blame": blame} if blame else {}),
        }
        record.update(self.session.at_death(record))  # recorder window, signature
        unwritten = self.death_log.write_death(record)
        self.signatures.append(str(record.get("signature") or "unknown"))
        self.control.signed(number, record.get("signature"))
        self.emit(
            events.Report(
                death=number,
                log=str(self.death_log.log_path),
                signature=record.get("signature"),
                written=not unwritten,
                error="; ".join(unwritten) if unwritten else None,
            )
        )
        if recover is None:
            recover = fault_class != faults.RESTARTED
        if fault_class == faults.FOREIGN:
            outcome = recovery.Outcome(False, 0, 0.0, f"{evidence}; {UNRECOVERABLE}")
        elif recover:
            outcome = self._still_ours(self._recover_or_reason(now, variables))
        else:
            by = "someone else (a new server answers)"
            outcome = self._still_ours(recovery.Outcome(True, 0, 0.0, by=by))
        self.death_log.write_recovery(
            {"death": number, "time": iso_time(time.time()), **self.outcome_fields(outcome)}
        )
        self.emit(
            events.Recovery(
                death=number,
                recovered=outcome.recovered,
                attempts=outcome.attempts,
                seconds=round(outcome.seconds, 3),
                reason=outcome.reason,
                by=outcome.by,
            )
        )
        if not outcome.recovered:
            raise GaveUp(
                f"service not recovered: {outcome.reason}", exit_code=self.config.exit_code
            )

    def rejuvenate(self, signs: list[str], variables: dict[str, object]) -> recovery.Outcome:
        """A restart of a server that rots (loop/rejuvenation.py), between attempts: the
        `health.rejuvenate` steps, else the recovery steps, then healthy within
        `healthy_within`. They see `death` as a hung server's (up: stop it before starting
        another), phase `rejuvenate`, its signs as reasons; no death is counted."""
        now = time.time()
        death = recovery.death_of(0, "rejuvenate", iso_time(now), [], faults.REJUVENATION)
        death = {**death, "hung": True, "reasons": signs}
        runbook = self.plan.runbook
        outcome = recovery.recover(
            self.config,
            runbook.rejuvenate_steps or runbook.recovery_steps,
            tasks.TaskGroup(self.plan),
            {**variables, "phase": "rejuvenate", "death": death},
            self.health,
            self.stop,
            self.emit,
        )
        return self._still_ours(outcome)

    def _ours(self, phase: str, rounds: list[list[ProbeResult]], facts: Facts) -> None:
        """A service that answers on another user's port is a death (its probe fails as
        `foreign`), recorded as deaths are; then the run gives up (GaveUp)."""
        foreign = {result.name: result for result in self._foreign()}
        if not foreign:
            return
        last = [foreign.pop(result.name, result) for result in rounds[-1]]
        self.died(phase, [*rounds[:-1], [*last, *foreign.values()]], facts)

    def _still_ours(self, outcome: recovery.Outcome) -> recovery.Outcome:
        """A service back up (recovered, started, or restarted by someone else) on another
        user's port is not back: no agent step may send it a prompt."""
        if not outcome.recovered or not (foreign := self._foreign()):
            return outcome
        reason = f"{faults.classify(list(foreign))[1]}; {UNRECOVERABLE}"
        return replace(outcome, recovered=False, reason=reason, by=None)

    def _foreign(self) -> tuple[ProbeResult, ...]:
        """The probes whose loopback port another user holds, as failed results."""
        owners = port_owner.check(self.health.probes, self.plan.model.health.trusted_users)
        if owners.unknown is not None and not self.owners_unknown:
            self.owners_unknown = True
            self.emit(
                events.Warned(
                    message=f"who listens on the probes' ports cannot be told here "
                    f"({owners.unknown}): a server another user started there would be trusted"
                )
            )
        return owners.foreign

    @staticmethod
    def outcome_fields(outcome: recovery.Outcome) -> Outcome:
        return {
            "attempts": outcome.attempts,
            "recovered": outcome.recovered,
            "seconds": round(outcome.seconds, 3),
            "reason": outcome.reason,
            "steps": outcome.steps,
            **({"by": outcome.by} if outcome.by else {}),
        }

    def _recover_or_reason(
        self, now: float, variables: dict, crash_loop: bool = True
    ) -> recovery.Outcome:
        window = self.config.crash_loop
        recent = [t for t in self.state.death_times if now - t <= window.within]
        if crash_loop and len(recent) > window.deaths:
            reason = (
                f"crash loop: {len(recent)} deaths within {window.within:g} s "
                f"(crash_loop allows {window.deaths}); a person should look"
            )
            return recovery.Outcome(False, 0, 0.0, reason)
        if self.config.lock == "":
            return self._recover(variables)
        me = {
            "pid": os.getpid(),
            "workdir": str(self.plan.workdir),
            "host": self.plan.host,
            "records": str(self.death_log.records_path),
            "death": self.state.deaths,
        }
        started = time.monotonic()
        with recovery_lock.held(self.lock_key, me, self._lock_wait(), self.stop) as waited:
            # Another loop may have brought it back while we confirmed the death or waited:
            # look before running a step that would stop the server it just started.
            if waited is not None:
                waiting = events.RecoveryWait(by=waited.text(), seconds=round(waited.seconds, 1))
                self.emit(waiting)
            if all(result.ok for result in self.health.round()):
                by = waited.text() if waited else "itself (healthy again before any step)"
                return recovery.Outcome(True, 0, time.monotonic() - started, by=by)
            return self._recover(variables)

    def _recovery_under_way(self) -> DuringRecovery | None:
        """Another loop's recovery of this service, when one holds the lock now."""
        if self.config.lock == "":
            return None
        holder = recovery_lock.in_progress(self.lock_key)
        if holder is None:
            return None
        during: DuringRecovery = {"by": recovery_lock.Waited(holder, 0.0).text()}
        if isinstance(holder.get("records"), str):
            during["records"] = holder["records"]
        if isinstance(holder.get("death"), int):
            during["death"] = holder["death"]
        return during

    def _recover(self, variables: dict) -> recovery.Outcome:
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

    def _lock_wait(self) -> float:
        """How long another loop's recovery may take: every attempt's steps to their timeouts,
        the health wait and the delays, plus a minute."""
        config = self.config
        steps = sum(spec.task.timeout or 0.0 for spec in self.plan.runbook.recovery_steps)
        delays = sum(config.delay * config.backoff**i for i in range(config.attempts - 1))
        return config.attempts * (steps + config.healthy_within) + delays + 60.0


def iso_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")
