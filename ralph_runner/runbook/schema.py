"""The whole runbook language, declared as data in one place (like pre-commit's clientlib).

Action kinds and probe kinds come from their packages, so adding one touches one file.
`validate` turns pydantic's errors into Problems with file, line, column and key path;
`json_schema` exports the same models for editors.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypedDict, cast, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Tag,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_core import ErrorDetails

from ralph_runner import actions, probes
from ralph_runner.durable.json_value import JSON
from ralph_runner.errors import ExitCode, FatalError
from ralph_runner.runbook.yamlfile import Document


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _exactly_one(kinds: Mapping[str, ModuleType], what: str) -> Any:
    """A before-validator: the mapping must hold exactly one key out of `kinds`."""

    def check(cls: type[BaseModel], data: Any) -> Any:
        if isinstance(data, dict):
            found = [key for key in data if key in kinds]
            keywords = {field.alias or name for name, field in cls.model_fields.items()}
            if not found and any(key not in keywords for key in data):
                return data  # an unknown key (a typo of an action?) gets its own did-you-mean
            if len(found) != 1:
                names = ", ".join(sorted(kinds))
                got = " and ".join(found) if found else "none"
                raise ValueError(f"a {what} needs exactly one of: {names} (found {got})")
            if data[found[0]] is None:  # `shell:` with nothing after it
                return {**data, found[0]: _empty_value(found[0], kinds[found[0]].Params)}
        return data

    return model_validator(mode="before")(cast(Any, classmethod(check)))


def _empty_value(key: str, params: Any) -> Any:
    """What a kind's key left empty means: its defaults (a model), or an error naming it."""
    if isinstance(params, type) and issubclass(params, BaseModel):
        return {}
    try:
        TypeAdapter(params).validate_python(None)
    except ValidationError:
        raise ValueError(f"{key!r} needs a value") from None
    return None


class TaskKeywords(Model):
    """What every task may say besides its action (Ansible's task keywords): the static part
    of `Task`, which adds one optional field per action kind."""

    name: str | None = None  # shown on the console and in reports; default: the action's key
    when: str | bool | None = None  # a condition (a template or true/false); false skips the task
    register_: str | None = Field(  # `register` is pydantic's
        None,
        alias="register",
        description="keep the task's result in this variable: rc, stdout, stdout_lines, ok, "
        "failed, timed_out, stalled, truncated, seconds, and what the action adds",
    )
    timeout: PositiveFloat | None = None  # seconds; the task's whole process tree is killed past it
    # loop steps that run a command: killed as stalled after this many seconds of no output,
    # no CPU, no change in the workdir and no request on the server (loop/idle.py)
    idle_timeout: PositiveFloat | None = None
    retries: NonNegativeInt | None = None  # runs again until `until` is true (3 with `until`)
    delay: NonNegativeFloat = 1.0  # seconds between the retries
    until: str | None = None  # a condition: the task is retried until it is true
    ignore_errors: bool = False  # a failure of this task does not fail its list of tasks
    env: dict[str, str | int | float | bool] = {}  # more environment (ralph-run's is inherited)
    vars: dict[str, object] = {}  # variables for this task only
    delegate_to: str | None = None  # run on this inventory host instead, e.g. localhost


def _with_kinds(
    name: str, base: type[Model], kinds: Mapping[str, ModuleType], what: str
) -> type[Model]:
    """`base` plus one optional field per kind (`shell`, `http`, ...), exactly one of them set."""
    # Any: create_model's keyword arguments are checked against its own options too
    fields: dict[str, Any] = {key: (module.Params | None, None) for key, module in kinds.items()}
    return create_model(
        name,
        __base__=base,
        __validators__={"one_kind": _exactly_one(kinds, what)},
        **fields,
    )


if TYPE_CHECKING:  # tools see the static keywords; the kinds' fields are read by getattr
    Task = TaskKeywords
else:
    Task = _with_kinds("Task", TaskKeywords, actions.KINDS, "task")


def task_kind(task: BaseModel) -> str:
    """The action key a validated task uses."""
    return next(key for key in actions.KINDS if key in task.model_fields_set)


class Use(Model):
    """`- use: NAME`: a collector set from collectors/NAME.yaml."""

    # the set's NAME: collectors/NAME.yaml beside the runbook, in its directory's parent, or
    # the one shipped with ralph-run
    use: str
    vars: dict[str, object] = {}  # the set's variables


class Include(Model):
    """`- include: FILE`: a task file, relative to the runbook."""

    include: str  # the file (a plain list of tasks), relative to the runbook
    vars: dict[str, object] = {}  # variables for the file's tasks


def _entry_tag(value: Any) -> str:
    if isinstance(value, dict) and "use" in value:
        return "use"
    if isinstance(value, dict) and "include" in value:
        return "include"
    return "task"


TaskEntry = Annotated[
    Annotated[Task, Tag("task")] | Annotated[Use, Tag("use")] | Annotated[Include, Tag("include")],
    Discriminator(_entry_tag),
]


class ProbeKeywords(Model):
    """What every probe may say besides its kind: the static part of `Probe`."""

    name: str | None = None  # shown in reports, status and death records; default: its kind
    timeout: PositiveFloat = 5.0  # seconds a check may take; past it the probe fails (timeout)
    # run at most every N iterations (in every check of an iteration where it is due);
    # confirmation and recovery rounds run every probe
    every: PositiveInt = 1


if TYPE_CHECKING:
    Probe = ProbeKeywords
else:
    Probe = _with_kinds("Probe", ProbeKeywords, probes.KINDS, "probe")


def probe_kind(probe: BaseModel) -> str:
    return next(kind for kind in probes.KINDS if kind in probe.model_fields_set)


class Checklist(Model):
    path: str = "CHECKLIST.md"  # the Markdown task list (`- [ ]` items), relative to the workdir
    # failed attempts (with no death) after which an item is marked `[!]` and skipped
    strikes: PositiveInt = 3
    # deaths in a row with the item alone in flight after which it is the cause: set aside
    # (`[!]`) and the run goes on (docs: deaths); 0: a death never sets an item aside
    set_aside_after: NonNegativeInt = 2


class Rejuvenate(Model):
    """`health.rejuvenate`: restart a server that rots before it dies, at an item boundary
    (docs: rejuvenation). Each sign is off unless given; it must hold for `sustained_for` s."""

    metrics: str | None = None  # the server's /metrics; default: the `progress` probe's
    every: PositiveFloat = 10.0  # seconds between two looks at it
    decode_drop: float | None = Field(None, gt=0.0, lt=1.0)  # decode this far below baseline
    first_token_rise: PositiveFloat | None = None  # time to first token this far above it (1: 2x)
    preemptions_per_minute: PositiveFloat | None = None  # more preemptions a minute than this
    memory_limit_mb: PositiveFloat | None = None  # the resident memory the server must not reach
    memory_horizon: PositiveFloat = 7200.0  # s: its slope reaches the limit within this
    sustained_for: NonNegativeFloat = 600.0  # s a sign must hold before a restart is due
    warmup: NonNegativeFloat = 120.0  # s after a (re)start before anything is measured
    baseline: PositiveFloat = 300.0  # s after the warmup over which the baseline is measured
    window: PositiveFloat = 120.0  # s of scrapes the numbers now are measured over
    min_tokens: PositiveInt = 200  # decode tokens a window needs to say anything
    min_age: NonNegativeFloat = 1800.0  # s: a server younger than this is never restarted
    at_most_every: NonNegativeFloat = 3600.0  # s: never again within this of the last restart
    # the server's process, for its resident memory when its /metrics lacks it (a pid file)
    pid_file: str | None = None
    inter_token: str = "vllm:inter_token_latency_seconds"  # older vLLM: ...time_per_output_token
    first_token: str = "vllm:time_to_first_token_seconds"  # the time to first token histogram
    preemptions: str = "vllm:num_preemptions_total"  # the preemptions counter
    resident: str = "process_resident_memory_bytes"  # resident memory (pid_file: its tree's)
    steps: list[TaskEntry] = []  # the restart; default: the recovery steps


class Health(Model):
    probes: list[Probe] = []  # the checks; the service is healthy when every one passes
    failures_before_dead: PositiveInt = 2  # consecutive failed rounds before it counts as dead
    interval: NonNegativeFloat = 1.0  # seconds between those rounds while confirming
    watch: NonNegativeFloat = 0.0  # also probe every this many seconds while a step runs; 0: off
    # the users besides the run's own and root whose server on a probe's loopback port is
    # trusted (names or uids: a service account such as `vllm`); another user's is a death
    trusted_users: list[str | int] = []
    rejuvenate: Rejuvenate | None = None  # a restart at an item boundary before the death


class Diagnostics(Model):
    log: str = "logs/deaths.log"  # the death reports, appended; relative to the workdir
    # the death records (JSON lines); default: the log's path with the suffix `.jsonl`
    records: str | None = None
    # a Jinja template for the report, relative to the runbook; "default": the built-in one
    template: str = "default"
    timeout: PositiveFloat = 15.0  # seconds a collector may run, unless it has its own timeout
    max_output: PositiveInt = 64 * 1024  # bytes of each collector's output kept (the last ones)
    # the collectors: tasks run at once at each death, their output kept in its report
    collect: list[TaskEntry] = []


class CrashLoop(Model):
    deaths: PositiveInt = 5  # more deaths than this within `within` seconds: give up
    within: PositiveFloat = 600.0  # seconds: the window in which `deaths` are counted


# What recovery steps (and their `when:`) see as `death`: built by service.py, checked by the
# loader (a `when:` naming another field is refused at its line).
DEATH_FIELDS = ("number", "phase", "time", "probes", "reasons", "hung", "fault")


class Recovery(Model):
    # the tasks of one attempt, in order (a failing one ends the attempt); they see `death`
    steps: list[TaskEntry] = []
    attempts: PositiveInt = 1  # runs of the steps before the loop gives up
    delay: NonNegativeFloat = 0.0  # seconds waited after a failed attempt before the next
    backoff: PositiveFloat = 1.0  # `delay` is multiplied by this for each further attempt
    # seconds after the steps within which every probe must pass, else the attempt failed
    healthy_within: NonNegativeFloat = 60.0
    # the exit status of a run that gave up: the service not brought back, or a crash loop
    exit_code: int = Field(int(ExitCode.GAVE_UP), ge=1, le=255)
    crash_loop: CrashLoop = CrashLoop()  # give up when deaths come too often: a person should look
    # Loops on one host whose `lock` is the same recover their service once (default: the
    # URLs of the health probes, so loops on one base URL share it); "" turns sharing off.
    lock: str | None = None


class Recorder(Model):
    """The flight recorder (README "Deaths as data"): what led up to a death, kept on disk."""

    url: str | None = None  # the server's Prometheus /metrics
    metrics: list[str] = []  # the metric names sampled from it
    period: PositiveFloat = 5.0  # seconds between samples
    gpu: bool = True  # GPU memory through NVML, when this machine has a driver
    follow: str | None = None  # a command that prints the server log as it grows
    file: str | None = None  # or a log file (relative to the workdir), read as it grows
    window: PositiveFloat = 600.0  # seconds of samples and log lines put into a death record
    max_lines: PositiveInt = 2000  # log lines of the window kept in a record (the last ones)
    max_mb: float = Field(16.0, ge=0.5)  # bound of .ralph/recorder/ on disk

    @model_validator(mode="after")
    def _one_log_source(self) -> Recorder:
        if self.follow is not None and self.file is not None:
            raise ValueError("a recorder follows one log: give `follow` or `file`, not both")
        if self.metrics and self.url is None:
            raise ValueError("`metrics` needs the `url` of the server's /metrics")
        return self


class LimitPattern(Model):
    """A usage-limit message of the runbook's own, besides the known ones (docs/agents.md)."""

    regex: str  # a Python regex searched in each line of the agent step's output
    # how its group `reset` reads: epoch, duration ("3 hours 12 minutes", "20s"), retry-after
    # (seconds or an HTTP date), clock ("3:04 PM", "Sep 5th, 2025 3:04 PM") or none
    reset: Literal["epoch", "duration", "retry-after", "clock", "none"] = "none"
    source: str = "runbook"  # the name its `limited` events give

    @model_validator(mode="after")
    def _compiles(self) -> LimitPattern:
        try:
            compiled = re.compile(self.regex)
        except re.error as exc:
            raise ValueError(f"`regex` does not compile: {exc}") from None
        if self.reset != "none" and "reset" not in compiled.groupindex:
            raise ValueError(f"reset: {self.reset} needs a group (?P<reset>...) in `regex`")
        return self


class Limits(Model):
    """Usage limits (an agent's provider said "limit, try again at ..."): no strike and no
    broken agent; the loop waits for the reset and retries the item, or stops."""

    # seconds: a reset further away (from the first limited attempt in a row) stops the run
    max_wait: NonNegativeFloat = 4 * 3600.0
    default_wait: PositiveFloat = 900.0  # seconds waited when the message gives no reset time
    margin: NonNegativeFloat = 10.0  # seconds waited past the reset before the item's retry
    exit_code: int = Field(
        int(ExitCode.LIMITED), ge=1, le=255
    )  # the exit of a run stopped by a limit
    patterns: list[LimitPattern] = []  # limit messages of your own, tried before the known ones


class LoopProxy(Model):
    """`loop.proxy`: the agent's requests go through a loopback proxy that counts this loop's
    own tokens (loop/proxy.py); `{{ agent_base_url }}` is its URL."""

    upstream: str | None = None  # where it forwards; default: the variable `base_url`


class Governor(Model):
    """`loop.governor`: what `workers: auto` reads of the server (loop/governor.py); the
    names default to vLLM's, give llama.cpp's (docs: workers) for llama-server."""

    metrics: str | None = None  # the server's /metrics; default: the `progress` probe's
    every: PositiveFloat = 2.0  # seconds between two looks (one decision each at most)
    settle: PositiveFloat = 4.0  # seconds of headroom at a level before another is admitted
    kv_cache_max: float = Field(0.9, gt=0.0, le=1.0)  # KV-cache use at which one is shed
    waiting: str = "vllm:num_requests_waiting"  # requests queued for a slot
    kv_cache: str | None = "vllm:kv_cache_usage_perc"  # KV-cache use, 0-1; null: not read
    preemptions: str | None = "vllm:num_preemptions_total"  # null: the server has none


class Loop(Model):
    max_iterations: NonNegativeInt = 0  # iterations at most; 0: until no item is left to do
    # true (or {upstream: URL}): a per-loop proxy for the agent's receipts; default off
    proxy: bool | LoopProxy = False
    # checklist items worked on at once, each in its own git worktree (docs: workers); 1: one;
    # auto: as many as the server has headroom for, up to max_workers (the governor)
    workers: PositiveInt | Literal["auto"] = 1
    max_workers: PositiveInt = 8  # workers: auto admits this many at most
    governor: Governor = Governor()  # what workers: auto reads of the server
    steps: list[TaskEntry]  # the tasks of one iteration, e.g. run the agent, verify, ensure_alive


class Metrics(Model):
    """A Prometheus node_exporter textfile, rewritten atomically at each change and at exit."""

    textfile: str  # e.g. /var/lib/node_exporter/textfile/ralph-{{ inventory_hostname }}.prom


NOTIFY_EVENTS = (
    "death",
    "recovered",
    "gave-up",
    "agent-broken",
    "finished",
    "stopped",
    "paused",
    "resumed",
    "limited",
)


class NotifyTarget(Model):
    url: str  # an Apprise URL: ntfy://, slack://, discord://, mailto://, tgram://, json://...
    # the events sent to it
    events: list[Literal[NOTIFY_EVENTS]] = ["gave-up", "agent-broken", "finished"]  # type: ignore[valid-type]


class Notify(Model):
    """Notifications (Apprise) and a dead man's switch; sent in the background, never blocking."""

    to: list[NotifyTarget] = []  # where notifications go: Apprise URLs, each with its events
    deadman: str | None = None  # healthchecks.io-style URL: /start, pinged each iteration, /<code>
    # seconds between the switch's pings while the loop waits (paused, a usage limit): a night
    # of pause is no dead loop; set it below your check's period
    deadman_every: PositiveFloat = 60.0
    timeout: PositiveFloat = 10.0  # seconds per attempt
    retries: NonNegativeInt = 2  # more attempts after a failed one


class Needs(Model):
    """What the host must have for the run to get far: `--check` warns of each one missing
    (a warning, not an error: it may appear before the run needs it)."""

    files: list[str] = []  # files that must exist: a model, a script (templates)
    commands: list[str] = []  # programs that must be found: a path, or a name on PATH (templates)


class Runbook(Model):
    name: str | None = None  # the service's name in death records (a `service_name` var wins)
    hosts: str = "localhost"  # the inventory hosts it runs for: a pattern (Ansible syntax)
    vars: dict[str, object] = {}  # variables: defaults, which the inventory and -e override
    secrets: list[str] = []  # variables whose values are masked (`****`) everywhere
    # the agent's git repository, where loop steps run and work files are; relative to the
    # current directory
    workdir: str = "."
    checklist: Checklist = Checklist()  # the task list the loop works through
    prompt: str = ""  # the agent's prompt: a template, rendered once per iteration
    health: Health = Health()  # how to tell the service is alive: probes, and when it is dead
    diagnostics: Diagnostics = Diagnostics()  # what a death records: collectors, report, record
    recovery: Recovery = Recovery()  # how the service is brought back after a death
    metrics: Metrics | None = None  # a Prometheus textfile of the loop's state; default: none
    notify: Notify = Notify()  # notifications and a dead man's switch
    recorder: Recorder | None = None  # the flight recorder; default: off
    limits: Limits = Limits()  # what an agent's usage limit ("try again at ...") does
    needs: Needs = Needs()  # files and programs the host must have: `--check` warns of each
    loop: Loop  # the loop: its steps, run for each checklist item
    # tasks run once when a `ralph-run pause` takes effect (e.g. stop the server to free the
    # GPU); a failing one leaves the loop paused, with the failure in status (no death)
    pause: list[TaskEntry] = []
    # tasks run once at `ralph-run resume`, before the next iteration (e.g. start it again);
    # then the service is checked: one the pause block stopped is started if down, no death
    resume: list[TaskEntry] = []
    # tasks run once when the run starts, before the first health check (e.g. acquire the GPU
    # from a scheduler); a failing one ends the run with recovery.exit_code
    setup: list[TaskEntry] = []
    # tasks run once when the run ends, whatever the end: finished, gave up, a signal, an error
    # (e.g. release the GPU); a run killed before it is reported by the next run
    teardown: list[TaskEntry] = []


class CollectorSet(Model):
    """collectors/NAME.yaml: a shareable list of diagnostic tasks."""

    description: str | None = None
    vars: dict[str, object] = {}
    collect: list[TaskEntry]


class TaskFile(Model):
    """An `include`d file: a plain list of tasks."""

    tasks: list[TaskEntry]


_LANGUAGE: tuple[type[BaseModel], ...] = (Runbook, CollectorSet, TaskFile)
"""The files of the runbook language, whose misplaced keys are told where they belong."""


def _known_keys() -> dict[str, list[str]]:
    """Every key of the language, with where it belongs (for "it is a key of X, not here")."""
    owners = {
        "a task": (Task, Use, Include),
        "a probe": (Probe,),
        "checklist": (Checklist,),
        "health": (Health,),
        "diagnostics": (Diagnostics,),
        "recovery.crash_loop": (CrashLoop,),
        "recovery": (Recovery,),
        "metrics": (Metrics,),
        "notify": (Notify,),
        "notify.to": (NotifyTarget,),
        "recorder": (Recorder,),
        "limits": (Limits,),
        "limits.patterns": (LimitPattern,),
        "loop.proxy": (LoopProxy,),
        "loop": (Loop,),
        "the runbook's top level": (Runbook,),
        "a collector set": (CollectorSet,),
    }
    keys: dict[str, list[str]] = {}
    for owner, models in owners.items():
        for model in models:
            for name in model.model_fields:
                keys.setdefault(name, []).append(owner)
    for kind, module in (*actions.KINDS.items(), *probes.KINDS.items()):
        if isinstance(module.Params, type) and issubclass(module.Params, BaseModel):
            for name, f in module.Params.model_fields.items():
                keys.setdefault(f.alias or name, []).append(f"`{kind}:`")
    return {key: list(dict.fromkeys(owners)) for key, owners in keys.items()}


def _own_keys(model: type[BaseModel]) -> dict[str, list[str]]:
    """The keys of `model` and of the models its fields hold, for a file outside the language
    (no owners: its keys get a did-you-mean, never "it belongs to")."""
    keys: dict[str, list[str]] = {}
    todo: list[Any] = [model]
    seen: set[Any] = set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            for name, f in current.model_fields.items():
                keys.setdefault(f.alias or name, [])
                todo.append(f.annotation)
        else:
            todo += get_args(current)
    return keys


def _data_path(data: Any, loc: tuple[Any, ...], kind: str) -> tuple[str | int, ...]:
    """Follow pydantic's loc through the data, dropping union/tag names that are not keys."""
    path: list[str | int] = []
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        in_dict = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        if in_dict or in_list:
            path.append(part)
            data = data[part]
        elif last and kind == "missing" and isinstance(data, dict) and isinstance(part, str):
            path.append(part)  # a missing key: point at its parent, name the key
    return tuple(path)


def _message(error: ErrorDetails, path: tuple[str | int, ...], known: dict[str, list[str]]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        key = path[-1]
        if known.get(str(key)):  # a real key, in the wrong place: mostly a line indented wrong
            where = ", ".join(known[str(key)])
            return (
                f"{key!r} is not a key here: it belongs to {where}"
                " (is this line indented as deep as its siblings?)"
            )
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown key {key!r}{hint}"
    if kind == "missing":
        return "required key is missing"
    found = error.get("input")
    text = repr(found)
    text = text if len(text) <= 60 else text[:57] + "..."
    message = error["msg"].removeprefix("Value error, ")
    return f"{message[0].lower()}{message[1:]}; found {text}"


def validate(document: Document, model: type[BaseModel]) -> Any:
    """Validate `document.data` against `model`; every problem names file, line, column, path."""
    try:
        return model.model_validate(document.data)
    except ValidationError as exc:
        # "it belongs to X" only within the runbook language; another file (a Slurm jobs file)
        # gets did-you-mean from its own keys
        known = _known_keys() if model in _LANGUAGE else _own_keys(model)
        by_path: dict[tuple, list[str]] = {}
        for error in exc.errors():
            path = _data_path(document.data, error["loc"], error["type"])
            messages = by_path.setdefault(path, [])
            message = _message(error, path, known)
            if message not in messages:
                messages.append(message)
        problems = [
            document.problem(path, " or ".join(messages)) for path, messages in by_path.items()
        ]
        raise FatalError(sorted(problems, key=lambda p: (p.line or 0, p.column or 0))) from None


SchemaNode = TypedDict(
    "SchemaNode",
    {
        "$schema": str,
        "$defs": dict[str, "SchemaNode"],
        "$ref": str,
        "title": str,
        "description": str,
        "type": str,
        "properties": dict[str, "SchemaNode"],
        "required": list[str],
        "additionalProperties": "bool | SchemaNode",
        "items": "SchemaNode",
        "anyOf": list["SchemaNode"],
        "oneOf": list["SchemaNode"],
        "allOf": list["SchemaNode"],
        "enum": list[JSON],
        "default": JSON,
        "pattern": str,
        "minItems": int,
        "minimum": float,
        "maximum": float,
        "exclusiveMinimum": float,
        "exclusiveMaximum": float,
    },
    total=False,
)
"""A JSON Schema object, as pydantic writes the runbook's: the keywords its readers use."""


def json_schema() -> SchemaNode:
    """The runbook language as JSON Schema (for editors' completion and validation)."""
    schema = cast(SchemaNode, Runbook.model_json_schema())
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ralph-run runbook"
    return schema
