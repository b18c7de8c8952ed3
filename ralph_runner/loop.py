"""The Ralph loop: one checklist item per iteration, steps as tasks, no false strikes."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from ralph_runner import checklist, execute, git, orphans, probes, reports, state, tasks
from ralph_runner.actions import TaskResult
from ralph_runner.errors import FatalError
from ralph_runner.health import Health, ProbeSpec
from ralph_runner.output import Output
from ralph_runner.plan import Plan
from ralph_runner.service import GaveUp, Service
from ralph_runner.watch import Watch

EXIT_DONE, EXIT_MAX_ITERATIONS = 0, 5
FRESH_STATUSES = {"idle", "finished", "stopped", "gave-up"}
UNWATCHED = {"ensure_alive", "verify", "wait"}


class Interrupted(BaseException):
    """SIGINT/SIGTERM. A BaseException, like KeyboardInterrupt, so that no `except Exception`
    (a template's error handler, a probe's) turns the signal into an ordinary failure."""

    def __init__(self, signum: int) -> None:
        self.exit_code = 128 + signum
        super().__init__(signal.Signals(signum).name)


def probe_specs(plan: Plan) -> list[ProbeSpec]:
    """The runbook's probes rendered with the plan's variables and validated again."""
    specs = []
    for raw in plan.runbook.probes:
        module = probes.KINDS[raw.kind]
        params = getattr(raw.probe, raw.kind)
        if getattr(module, "SHELL", False):
            rendered = plan.templar.render(params, plan.variables, shell=True, where=raw.where)
        else:
            data = params.model_dump() if isinstance(params, BaseModel) else params
            rendered = plan.templar.render_data(data, plan.variables, where=raw.where)
        try:
            params = TypeAdapter(module.Params).validate_python(rendered)
        except ValidationError as exc:  # e.g. `port: "{{ port }}"` rendered to a word
            errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise FatalError(replace(raw.where, message=f"once rendered: {errors}")) from None
        specs.append(ProbeSpec(raw.name, raw.kind, params, raw.probe.timeout, raw.probe.every))
    return specs


def health_for(plan: Plan) -> Health:
    config = plan.model.health
    return Health(
        probe_specs(plan),
        failures_before_dead=config.failures_before_dead,
        interval=config.interval,
        connection=plan.connection_for(None),
    )


def death_log_for(plan: Plan) -> reports.DeathLog:
    config = plan.model.diagnostics
    log = plan.path(("diagnostics", "log"), config.log)
    records = config.records and plan.path(("diagnostics", "records"), config.records)
    where = plan.runbook.where(("diagnostics", "template"))
    if config.template == "default":
        template = reports.default_template()
    else:
        try:
            template = (plan.runbook.directory / config.template).read_text(encoding="utf-8")
        except OSError as exc:
            raise FatalError(replace(where, message=f"cannot read template: {exc}")) from None
    return reports.DeathLog(
        log,
        reports.records_path(log, records),
        template=template,
        templar=plan.templar,
        redactor=reports.Redactor(plan.secret_values()),
        where=where,
    )


class Runner:
    """Runs one plan's loop until the checklist is done, max_iterations, give-up or a signal."""

    def __init__(self, plan: Plan, output: Output) -> None:
        self.plan, self.output = plan, output
        self.model = plan.model
        self.store = state.Store(plan.workdir, output.redactor, self._warn)
        self.checklist_path = plan.path(("checklist", "path"), self.model.checklist.path)
        self.stop = threading.Event()
        self.state = state.State()
        self.started = time.monotonic()
        self.iteration_vars: dict[str, Any] = {}
        self.head_before: str | None = None
        self._partial_line = ""

    # -- the run --------------------------------------------------------------
    def run(self) -> int:
        self._preflight()
        with self.store.lock(), _signals_raise(), orphans.recorded(self.store.dir):
            self.state = self._resume()
            death_log = death_log_for(self.plan)
            state.exclude_from_git(
                self.plan.workdir, [self.store.dir, death_log.log_path, death_log.records_path]
            )
            health = health_for(self.plan)
            self.service = Service(
                self.plan, health, death_log, self.state, self._save, self.stop, self.output.event
            )
            self.health = health
            try:
                code = self._loop()
                self.state.status = "finished" if code == EXIT_DONE else "stopped"
                return code
            except GaveUp:
                self.state.status = "gave-up"
                raise
            except FatalError:  # e.g. a template error in a step: fix the runbook, run again
                self.state.status = "failed"
                raise
            except Interrupted:
                self.stop.set()
                execute.kill_all()
                self.state.status = "interrupted"
                raise
            finally:
                health.close()
                self.state.phase = None
                self._save()

    def _preflight(self) -> None:
        """What would only fail at the first iteration fails now, at its line in the runbook."""
        if not self.checklist_path.is_file():
            where = self.plan.runbook.where(("checklist", "path"))
            raise FatalError(replace(where, message=f"no checklist at {self.checklist_path}"))
        committing = [
            spec
            for spec in self.plan.runbook.loop_steps
            if spec.kind == "verify"
            and getattr(getattr(spec.task, "verify", None), "committed", True)
        ]
        if committing and not git.is_repo(self.plan.workdir):
            message = f"verify needs a commit, but {self.plan.workdir} is no git repository"
            raise FatalError(replace(committing[0].where, message=message))

    def _resume(self) -> state.State:
        loaded = self.store.load()
        if loaded.status in FRESH_STATUSES:
            loaded.iteration = 0
            loaded.started = time.time()
        else:
            self.output.event(
                "resume", iteration=loaded.iteration, deaths=loaded.deaths, item=loaded.current_item
            )
        loaded.pid, loaded.status = os.getpid(), "running"
        return loaded

    def _loop(self) -> int:
        limit = self.model.loop.max_iterations
        while True:
            text = checklist.read(self.checklist_path)
            item = checklist.next_todo(text)
            if item is None:
                self._summary(text)
                return EXIT_DONE
            if limit and self.state.iteration >= limit:
                self._summary(text, stopped=True)
                return EXIT_MAX_ITERATIONS
            self._iteration(item, text)

    def _iteration(self, item: checklist.Item, text: str) -> None:
        st = self.state
        st.iteration += 1
        st.current_item = item.text
        self._save()
        deaths_before = st.deaths
        self.head_before = git.head(self.plan.workdir)
        variables = self._variables(item, text)
        self.output.event(
            "iteration",
            iteration=st.iteration,
            item=item.text,
            attempts=variables["item"]["attempts"],
            done=variables["checklist"]["done"],
            todo=variables["checklist"]["todo"],
            skipped=variables["checklist"]["skipped"],
            deaths=st.deaths,
            prompt_size=variables["prompt_size"],
        )
        group = tasks.TaskGroup(
            self.plan,
            connection=self.plan.controller(),
            cwd=self.plan.workdir,
            run=self,
            on_output=self._show_output if self.output.verbose else None,
        )
        failure = None
        for spec in self.plan.runbook.loop_steps:
            if failure and spec.kind != "ensure_alive":
                continue  # after a failure only health checks run: a death must still be seen
            result = self._step(spec, group, variables)
            if not result.ok and not spec.task.ignore_errors and not failure:
                failure = f"{spec.name}: {_why(result)}"
        if failure and st.deaths == deaths_before and self.plan.runbook.probes:
            # A dying server may still answer for a moment after failing the agent's call:
            # look again one `interval` later before blaming the item.
            self.stop.wait(self.model.health.interval)
            self._ensure_alive("after-failure")
        self._settle(item, failure, died=st.deaths > deaths_before)

    def _step(self, spec, group: tasks.TaskGroup, variables: dict) -> TaskResult:
        self.state.phase = spec.name
        self._save(status_only=True)  # the phase is for people watching; the state has not moved
        self.output.event("step", step=spec.name, action=spec.kind)
        started = time.monotonic()
        watch_every = self.model.health.watch if self.plan.runbook.probes else 0
        if spec.kind in UNWATCHED:
            watch_every = 0
        with Watch(self.health, watch_every, self.state.iteration) as watch:
            result = tasks.run(spec, group, variables, watch.cancel)
        self._flush_output()
        self.output.event(
            "step-done",
            step=spec.name,
            ok=result.ok,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            killed=result.cancelled,
            seconds=round(time.monotonic() - started, 3),
        )
        if watch.rounds is not None:
            self.output.event("watch", step=spec.name, killed=True)
            self.service.died("during-step", watch.rounds, self._facts())
        return result

    def _settle(self, item: checklist.Item, failure: str | None, died: bool) -> None:
        st = self.state
        if failure is None:
            st.strikes.pop(item.text, None)
            self.output.event("done", item=item.text)
        elif died:
            self.output.event("retry", item=item.text, reason=failure)
        else:
            strikes = st.strikes.get(item.text, 0) + 1
            st.strikes[item.text] = strikes
            self.output.event(
                "strike",
                item=item.text,
                strikes=strikes,
                of=self.model.checklist.strikes,
                reason=failure,
            )
            if strikes >= self.model.checklist.strikes:
                self._skip(item, strikes)
        st.current_item = None
        self._save()

    def _skip(self, item: checklist.Item, strikes: int) -> None:
        text = checklist.read(self.checklist_path)
        current = checklist.find(text, item.text)  # None: the agent rewrote the item's line
        if current is not None:
            checklist.write(self.checklist_path, checklist.mark(text, current, "!"))
            if git.is_repo(self.plan.workdir):
                message = f"skip: {item.text} ({strikes} failures)"
                git.commit_paths(self.plan.workdir, message, self.checklist_path)
        self.state.strikes.pop(item.text, None)
        self.output.event("skip", item=item.text, strikes=strikes)

    def _show_output(self, text: str) -> None:
        """`-v`: the step's output, a line at a time (it arrives in arbitrary chunks)."""
        *lines, self._partial_line = (self._partial_line + text).split("\n")
        for line in lines:
            self.output.event("output", step=self.state.phase, text=line)

    def _flush_output(self) -> None:
        if self._partial_line:
            self.output.event("output", step=self.state.phase, text=self._partial_line)
            self._partial_line = ""

    # -- what the runbook's actions call ---------------------------------------
    def ensure_alive(self, phase: str, context: dict[str, Any]) -> TaskResult:
        started = time.monotonic()
        self._ensure_alive(phase, context)
        return TaskResult(ok=True, seconds=time.monotonic() - started)

    def _ensure_alive(self, phase: str, context: dict[str, Any] | None = None) -> None:
        self.state.phase = phase
        facts = {**self._facts(), **({"context": context} if context else {})}
        self.service.ensure_alive(phase, facts, self.state.iteration)

    def verify(self, params) -> TaskResult:
        problems = []
        item_text = self.state.current_item or ""
        if params.checked:
            found = checklist.find(checklist.read(self.checklist_path), item_text)
            if found is None or found.mark != "x":
                problems.append("item not ticked")
        if params.committed:
            head, clean = git.head_and_clean(self.plan.workdir)
            if head == self.head_before:
                problems.append("no new commit")
            elif not clean:
                problems.append("uncommitted changes")
        return TaskResult(ok=not problems, output="; ".join(problems) or "verified")

    # -- helpers ---------------------------------------------------------------
    def _variables(self, item: checklist.Item, text: str) -> dict[str, Any]:
        counts = checklist.counts(text)
        item_vars = {
            "text": item.text,
            "line": item.line,
            "index": item.index,
            "attempts": self.state.strikes.get(item.text, 0),
        }
        variables = {
            **self.plan.variables,
            "iteration": self.state.iteration,
            "item": item_vars,
            "checklist": counts.as_dict(),
            "deaths": self.state.deaths,
            "phase": None,
        }
        where = self.plan.runbook.where(("prompt",))
        prompt = self.plan.templar.render(self.model.prompt, variables, where=where)
        variables.update(
            prompt=prompt, prompt_size=len(prompt), prompt_bytes=len(prompt.encode("utf-8"))
        )
        self.iteration_vars = variables
        return variables

    def _facts(self) -> dict[str, Any]:
        variables = self.iteration_vars
        counts = checklist.counts(checklist.read(self.checklist_path))
        return {
            "iteration": self.state.iteration,
            "item": variables.get("item"),
            "prompt_size": variables.get("prompt_size"),
            "prompt_bytes": variables.get("prompt_bytes"),
            "checklist": counts.as_dict(),
            "variables": {**variables, "checklist": counts.as_dict()},
        }

    def _save(self, status_only: bool = False) -> None:
        """Persist state and status; a full disk is reported, and the loop goes on."""
        try:
            if not status_only:
                self.store.save(self.state)
            self.store.write_status(self._status())
        except FatalError as exc:
            self.output.event("warning", message=f"state not saved: {exc}")

    def _warn(self, message: str) -> None:
        self.output.event("warning", message=message)

    def _status(self) -> dict[str, Any]:
        counts = checklist.counts(checklist.read(self.checklist_path))
        st = self.state
        return {
            "status": st.status,
            "pid": st.pid,
            "running": st.status == "running",
            "iteration": st.iteration,
            "item": st.current_item,
            "phase": st.phase,
            **counts.as_dict(),
            "deaths": st.deaths,
            "last_death": st.last_death,
            "updated": time.time(),
            "workdir": str(self.plan.workdir),
        }

    def _summary(self, text: str, stopped: bool = False) -> None:
        counts = checklist.counts(text)
        self.output.event(
            "summary",
            stopped_at_max=stopped,
            iterations=self.state.iteration,
            done=counts.done,
            todo=counts.todo,
            skipped=counts.skipped,
            deaths=self.state.deaths,
            seconds=round(time.monotonic() - self.started, 1),
        )


def _why(result: TaskResult) -> str:
    if result.cancelled:
        return "cancelled (service died)"
    if result.timed_out:
        return "timed out"
    if result.exit_code is not None:
        return f"exit {result.exit_code}" + (
            f": {result.output.strip()[-200:]}" if result.output.strip() else ""
        )
    return result.output.strip()[-200:] or "failed"


class _signals_raise:
    """SIGINT/SIGTERM raise Interrupted in the main thread, so `finally` blocks save state."""

    def __enter__(self) -> None:
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in self.previous:
            signal.signal(signum, self._raise)

    def _raise(self, signum: int, frame: object) -> None:
        for s in self.previous:  # a second signal must not interrupt the clean-up
            signal.signal(s, signal.SIG_IGN)
        execute.kill_all()
        raise Interrupted(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
