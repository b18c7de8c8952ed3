"""Runbook files -> validated models, with `use:` collector sets and `include:` files resolved.

Every task keeps where it was written (file, line, column, key path) so that a template or
runtime error months later still points at the line to fix.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ralph_runner import actions, templating
from ralph_runner.errors import FatalError, Problem
from ralph_runner.runbook import schema, yamlfile
from ralph_runner.runbook.yamlfile import Document


def shipped(folder: str) -> Path:
    """A folder that ships with ralph-run (runbooks/, collectors/): inside the installed
    package (setup.py copies it there), or at the top of a source checkout, where operators
    read it and an editable install leaves it."""
    package = Path(__file__).resolve().parents[1]
    inside = package / folder
    return inside if inside.is_dir() else package.parent / folder


SHIPPED_COLLECTORS = shipped("collectors")
SHIPPED_RUNBOOKS = shipped("runbooks")


@dataclass
class TaskSpec:
    """One task, ready to run: its model, its action kind, where it was written, set vars.

    `where` is the action's key (`shell:`), the place of the template most errors are about;
    `where_of("when")` is the place of another keyword of the task.
    """

    task: schema.TaskKeywords
    kind: str
    where: Problem
    vars: dict[str, object] = field(default_factory=dict)
    document: Document | None = None  # the file it was written in, and its key path there
    key: tuple = ()

    @property
    def name(self) -> str:
        return self.task.name or f"{self.kind}"

    @property
    def params(self) -> Any:
        """The value of the task's action key (`shell:`'s command, `verify:`'s options)."""
        return getattr(self.task, self.kind)

    def where_of(self, keyword: str) -> Problem:
        """The position of one of the task's keys (its `when`, say), for errors in its value."""
        if self.document is None:
            return self.where
        return self.document.problem((*self.key, keyword), "")


@dataclass
class ProbeSpecRaw:
    probe: schema.ProbeKeywords
    kind: str
    where: Problem

    @property
    def name(self) -> str:
        return self.probe.name or self.kind


@dataclass
class LoadedRunbook:
    path: Path
    document: Document
    model: schema.Runbook
    loop_steps: list[TaskSpec]
    collectors: list[TaskSpec]
    recovery_steps: list[TaskSpec]
    probes: list[ProbeSpecRaw]
    # `pause:` and `resume:` (loop/pause.py): tasks as recovery steps are, run at a pause
    pause_steps: list[TaskSpec] = field(default_factory=list)
    resume_steps: list[TaskSpec] = field(default_factory=list)
    # `setup:` and `teardown:` (loop/lifecycle.py): run at the run's start and at its end
    setup_steps: list[TaskSpec] = field(default_factory=list)
    teardown_steps: list[TaskSpec] = field(default_factory=list)
    # `health.rejuvenate.steps` (loop/rejuvenation.py): a restart of a server that rots
    rejuvenate_steps: list[TaskSpec] = field(default_factory=list)

    @property
    def directory(self) -> Path:
        return self.path.parent

    def where(self, key: tuple) -> Problem:
        """The position of `key` in the runbook, for errors about its value."""
        return self.document.problem(key, "")


def load(path: str | Path) -> LoadedRunbook:
    """Load, validate and resolve a runbook; every problem found is reported at once."""
    path = Path(path)
    document = yamlfile.load(path)
    if not isinstance(document.data, dict):
        raise FatalError(document.problem((), "a runbook must be a mapping of keys"))
    model = schema.validate(document, schema.Runbook)
    problems: list[Problem] = []

    def expand(entries: list, key: tuple) -> list[TaskSpec]:
        return _expand(entries, document, key, path.parent, problems, seen=(path.resolve(),))

    loaded = LoadedRunbook(
        path=path,
        document=document,
        model=model,
        loop_steps=expand(model.loop.steps, ("loop", "steps")),
        collectors=expand(model.diagnostics.collect, ("diagnostics", "collect")),
        recovery_steps=expand(model.recovery.steps, ("recovery", "steps")),
        probes=[
            ProbeSpecRaw(probe, kind, document.problem(("health", "probes", i, kind), ""))
            for i, probe in enumerate(model.health.probes)
            for kind in [schema.probe_kind(probe)]
        ],
        pause_steps=expand(model.pause, ("pause",)),
        resume_steps=expand(model.resume, ("resume",)),
        setup_steps=expand(model.setup, ("setup",)),
        teardown_steps=expand(model.teardown, ("teardown",)),
        rejuvenate_steps=expand(
            model.health.rejuvenate.steps if model.health.rejuvenate else [],
            ("health", "rejuvenate", "steps"),
        ),
    )
    problems += _loop_only_outside_the_loop(loaded)
    problems += _idle_timeout_misplaced(loaded)
    problems += _rejuvenate_without_metrics(loaded)
    problems += death_field_problems(loaded.recovery_steps + loaded.rejuvenate_steps)
    if problems:
        raise FatalError(problems)
    return loaded


def _rejuvenate_without_metrics(loaded: LoadedRunbook) -> list[Problem]:
    """`health.rejuvenate` reads its signs from the server's /metrics: where none is known, say
    so at its line when the runbook loads (`--check` too), not when the run starts."""
    rejuvenate = loaded.model.health.rejuvenate
    progress = any(probe.kind == "progress" for probe in loaded.probes)
    if rejuvenate is None or rejuvenate.metrics or progress:
        return []
    message = (
        "health.rejuvenate reads the server's /metrics: add a `progress` probe, or give"
        " health.rejuvenate.metrics"
    )
    return [loaded.document.problem(("health", "rejuvenate"), message)]


def _loop_only_outside_the_loop(loaded: LoadedRunbook) -> list[Problem]:
    """`verify` and `ensure_alive` need the loop: in a capture, a recovery or a pause block
    they are a mistake, reported at their line (an included file's line, if it came from one)."""
    sections = _task_sections(loaded)
    return [
        replace(
            spec.where,
            message=f"{spec.kind!r} is a loop step: it runs only in loop.steps, not in {section}",
        )
        for section, specs in sections.items()
        for spec in specs
        if getattr(actions.KINDS[spec.kind], "LOOP_ONLY", False)
    ]


def _task_sections(loaded: LoadedRunbook) -> dict[str, list[TaskSpec]]:
    """The task lists outside `loop.steps`, by the key path their errors name."""
    return {
        "diagnostics.collect": loaded.collectors,
        "recovery.steps": loaded.recovery_steps,
        "health.rejuvenate.steps": loaded.rejuvenate_steps,
        "pause": loaded.pause_steps,
        "resume": loaded.resume_steps,
        "setup": loaded.setup_steps,
        "teardown": loaded.teardown_steps,
    }


IDLE_KINDS = ("shell", "command")  # the actions that run a command an idle_timeout can watch


def _idle_timeout_misplaced(loaded: LoadedRunbook) -> list[Problem]:
    """`idle_timeout` watches a loop step's command (the agent): on a collector, a recovery
    step or an action that runs no command it would mean nothing, so it is refused at its line."""
    sections = _task_sections(loaded)
    problems = [
        replace(
            spec.where_of("idle_timeout"),
            message=f"`idle_timeout` watches loop steps only, not the tasks of {section}",
        )
        for section, specs in sections.items()
        for spec in specs
        if spec.task.idle_timeout is not None
    ]
    problems += [
        replace(
            spec.where_of("idle_timeout"),
            message=f"`idle_timeout` watches a command ({' or '.join(IDLE_KINDS)}), "
            f"and {spec.kind!r} runs none",
        )
        for spec in loaded.loop_steps
        if spec.task.idle_timeout is not None and spec.kind not in IDLE_KINDS
    ]
    return problems


def death_field_problems(specs: list[TaskSpec]) -> list[Problem]:
    """A recovery step's `when:` may name only the fields a death has (schema.DEATH_FIELDS):
    a typo there would silently skip (or always run) the step when the service dies."""
    problems = []
    for spec in specs:
        if not isinstance(spec.task.when, str):
            continue
        where = spec.where_of("when")
        for name in templating.attributes_of(spec.task.when, "death", where=where):
            if name not in schema.DEATH_FIELDS:
                close = difflib.get_close_matches(name, schema.DEATH_FIELDS, n=1)
                hint = f"did you mean death.{close[0]}? " if close else ""
                fields = ", ".join(schema.DEATH_FIELDS)
                message = f"a death has no field {name!r}; {hint}(it has: {fields})"
                problems.append(replace(where, message=message))
    return problems


def find_collector_set(name: str, runbook_dir: Path) -> Path | None:
    """collectors/NAME.yaml beside the runbook, in its parent, then the copy shipped with us."""
    for root in _collector_roots(runbook_dir):
        candidate = root / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    return None


def _expand(
    entries: list,
    document: Document,
    key: tuple,
    base: Path,
    problems: list[Problem],
    seen: tuple[Path, ...],
    inherited: dict[str, object] | None = None,
) -> list[TaskSpec]:
    """Flatten tasks, `use:` sets and `include:` files into TaskSpecs, collecting problems."""
    out: list[TaskSpec] = []
    for i, entry in enumerate(entries):
        where = (*key, i)
        scope = {**(inherited or {}), **getattr(entry, "vars", {})}
        if isinstance(entry, schema.Use):
            found = find_collector_set(entry.use, base)
            if found is None:
                problems.append(document.problem((*where, "use"), _missing_set(entry.use, base)))
                continue
            out += _expand_file(found, schema.CollectorSet, "collect", problems, seen, scope)
        elif isinstance(entry, schema.Include):
            target = find_include(entry.include, base)
            if target is None:
                missing = _missing_include(entry.include, base)
                problems.append(document.problem((*where, "include"), missing))
                continue
            out += _expand_file(target, schema.TaskFile, "tasks", problems, seen, scope)
        else:
            kind = schema.task_kind(entry)
            spot = document.problem((*where, kind), "")
            out.append(TaskSpec(entry, kind, spot, scope, document, where))
    return out


def _expand_file(
    path: Path,
    model: type[BaseModel],
    key: str,
    problems: list[Problem],
    seen: tuple[Path, ...],
    scope: dict[str, object],
) -> list[TaskSpec]:
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        problems.append(Problem(f"include cycle: {chain}", str(path)))
        return []
    document = yamlfile.load(path)
    if isinstance(document.data, list):  # a bare list of tasks
        document = Document({key: document.data}, document.file, _nest(document.positions, key))
    try:
        parsed = schema.validate(document, model)
    except FatalError as exc:
        problems.extend(exc.problems)
        return []
    scope = {**getattr(parsed, "vars", {}), **scope}
    entries = getattr(parsed, key)
    return _expand(entries, document, (key,), path.parent, problems, (*seen, path.resolve()), scope)


def _nest(positions: dict, key: str) -> dict:
    return {(key, *path): where for path, where in positions.items()}


def find_include(name: str, runbook_dir: Path) -> Path | None:
    """An included file beside the including one, then the copy shipped with us (a runbook
    copied out of runbooks/ keeps `include: agents/opencode.yaml`, as `use:` keeps its sets)."""
    for root in _include_roots(name, runbook_dir):
        candidate = (root / name).resolve()
        if candidate.is_file():
            return candidate
    return None


def _include_roots(name: str, runbook_dir: Path) -> list[Path]:
    if Path(name).expanduser().is_absolute():
        return [runbook_dir]
    return list(dict.fromkeys([runbook_dir.absolute(), SHIPPED_RUNBOOKS.absolute()]))


def _missing_include(name: str, base: Path) -> str:
    places = ", ".join(str(root.absolute() / name) for root in _include_roots(name, base))
    return f"no such file: {name} (looked for {places})"


def _collector_roots(runbook_dir: Path) -> list[Path]:
    """Where collector sets are looked for, as absolute paths, each once (a runbook in "." has
    "collectors" beside it and in its parent: the same relative name, two different places)."""
    base = runbook_dir.absolute()
    roots = [base / "collectors", base.parent / "collectors", SHIPPED_COLLECTORS.absolute()]
    return list(dict.fromkeys(Path(os.path.normpath(root)) for root in roots))


def _missing_set(name: str, base: Path) -> str:
    places = _collector_roots(base)
    names = sorted({p.stem for root in places if root.is_dir() for p in root.glob("*.yaml")})
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"no collector set {name!r}; {hint}(looked in {', '.join(map(str, places))}); known: "
        + (", ".join(names) or "none")
    )
