"""`progress: {metrics, completion, counters, moving, active, stall}`: is the engine working?

vLLM's `/metrics` keeps answering while its engine hangs, but its numbers stop; and a request
that waits in a busy engine's queue says nothing about liveness. So every check scrapes
`/metrics` (cheap, adds no load) and compares the engine's numbers with the last check's: the
token counters, and gauges that move with every engine step (`moving`: the KV-cache use, which
grows with each chunk of a long prefill while no token counter moves until it ends):
- they moved: ok, however long the queue (a busy engine is never a failure);
- requests are active and nothing moved: ok for as long as the hang bound allows, then
  "stalled". The bound need only outlast one engine step (one prefill chunk), not a whole
  long prompt;
- idle and nothing moved: a 1-token canary must be answered; an error status is "status"
  (vLLM answers 500 once its engine died); no answer and still no token is "stalled", unless
  more requests than our canary are now active (then: busy). An engine that answered a canary
  before gets the hang bound from its first unanswered one;
- `vllm:engine_sleep_state{sleep_state="awake"}` at 0: the engine was put to sleep (sleep
  mode), it serves nothing: "stalled", and the death's class says "sleeping".

The hang bound is learned (docs: hangs, "The hang bound"): `margin` x the slowest engine step
seen in the last LEARN_WINDOW s (the longest time work was seen waiting with nothing moving
before something moved again), within [`floor`, `ceiling`]. A prompt's first step comes before
anything of it can be measured (vLLM's gauges say idle during it): until the engine has stepped
twice since the loop's request was sent (steps counted by the engine, or seen by two checks),
and while requests are queued, B also covers that request's tokens x a pace measured
(plugins/first_token.py: the engine's histograms, the loop's requests, a calibration; none:
the ceiling).
`stall_after: N` is the same rule with floor = ceiling = N (a fixed bound).

Each check notes which server answered: a new `process_start_time_seconds`, or counters that
went back, is a restart (`restarts`), so that the loop can tell a call a restart cut from the
agent's own failure. The memory (`Memory`, in `ctx.state`, owned by the probe's worker) holds
the last numbers, the steps learned, the last bound, and since when work has waited without
progress (None when idle), so a hang at H is timed from H + one check period at the latest. A
failed verdict says what it found (`finding`): work stalled, idle unanswered, or asleep.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator

from ralph_runner import probes
from ralph_runner.plugins import first_token, prometheus_text
from ralph_runner.plugins.fields import Templated
from ralph_runner.plugins.first_token import Calibration, EngineCounts, EngineMeter, Measure
from ralph_runner.probes import Awaiting, ProbeContext, Verdict, excerpt, request
from ralph_runner.probes import completion as completion_probe

KIND = "progress"
COUNTERS = ["vllm:generation_tokens_total", "vllm:prompt_tokens_total"]
# Numbers that change as the engine steps without a token counted: the KV-cache use grows with
# every prefill chunk, a preemption is work too. A server without them is simply not asked.
MOVING = ["vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"]
ACTIVE = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
QUEUED = ["vllm:num_requests_waiting"]  # of those, the ones waiting for a place to run
# The engine's steps, counted (a histogram's count: one observation per engine step)
STEPS = ["vllm:iteration_tokens_total_count"]
STARTED = "process_start_time_seconds"  # which server answered
SLEEP_STATE = "vllm:engine_sleep_state"  # its sample labelled sleep_state="awake" is 0 asleep
RESCRAPE = 1.0  # seconds of the probe's timeout kept for the scrape after an unanswered canary
CONFIRM = 1.0  # s a canary waits once the bound has run out since the first unanswered one
LEARN_WINDOW = 900.0  # s a measured step is remembered: an engine's pace is what it is now
STEPS_KEPT = 256  # measured steps kept at most (the window's, the latest)


class Stall(BaseModel):
    """`stall`: how long work may wait with no engine step before it is "stalled"."""

    model_config = ConfigDict(extra="forbid")

    floor: Templated[PositiveFloat] = 4.0  # s: never less (a fast engine's bound)
    ceiling: Templated[PositiveFloat] = 120.0  # s: never more (a prompt of unmeasured pace)
    margin: Templated[float] = Field(3.0, ge=1.0)  # times the slowest engine step seen

    @model_validator(mode="after")
    def _ordered(self) -> Stall:
        floor, ceiling = self.floor, self.ceiling  # templates are checked once rendered
        if isinstance(floor, float | int) and isinstance(ceiling, float | int) and floor > ceiling:
            raise ValueError(f"floor {self.floor:g} is above ceiling {self.ceiling:g}")
        return self


class Prefill(BaseModel):
    """`prefill`: the engine's sums of prefill time and prompt tokens (and of the requests
    prefilled): seconds per prompt token from every finished request (plugins/first_token.py)."""

    model_config = ConfigDict(extra="forbid")

    seconds: str = "vllm:request_prefill_time_seconds_sum"  # prefill seconds, summed
    tokens: str = "vllm:request_prompt_tokens_sum"  # prompt tokens, summed
    requests: str | None = "vllm:request_prefill_time_seconds_count"  # prompts; null: none


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metrics: str  # vLLM's /metrics, beside /v1
    completion: completion_probe.Params | None = None  # the idle canary; None: idle is not checked
    # token counters, summed over their label sets: when they move, the engine works
    counters: list[str] = Field(default_factory=lambda: list(COUNTERS), min_length=1)
    # gauges whose change is an engine step too (the KV-cache use grows with each prefill chunk)
    moving: list[str] = Field(default_factory=lambda: list(MOVING))
    # gauges of the requests queued (waiting for a place in the engine): when they go down, a
    # request was taken and its first step begins (one of the loop's, maybe)
    queued: list[str] = Field(default_factory=lambda: list(QUEUED))
    # gauges summed into the requests active: work that should make the numbers move
    active: list[str] = Field(default_factory=lambda: list(ACTIVE), min_length=1)
    # the engine's steps counted (a counter, or a histogram's _count): how many ran since the
    # loop's request was sent, however seldom a check sees them
    steps: list[str] = Field(default_factory=lambda: list(STEPS))
    prefill: Prefill | None = None  # the engine's own pace of prompts; unset: vLLM's names
    calibrate: bool = True  # nothing measured a pace at the first idle check: measure one
    stall: Stall | None = None  # the learned hang bound's limits (docs: hangs); unset: the defaults
    stall_after: Templated[PositiveFloat] | None = None  # s: a fixed hang bound instead of `stall`

    @model_validator(mode="after")
    def _one_bound(self) -> Params:
        if self.stall_after is not None and self.stall is not None:
            raise ValueError("give `stall` (a learned hang bound) or `stall_after` (a fixed one)")
        return self

    def limits(self) -> Limits:
        """The bound's floor, ceiling and margin (a fixed `stall_after` is floor and ceiling)."""
        if self.stall_after is None:
            stall = self.stall or Stall()
            return Limits(float(stall.floor), float(stall.ceiling), float(stall.margin))
        return Limits(float(self.stall_after), float(self.stall_after), 1.0)


@dataclass(frozen=True)
class Limits:
    """The hang bound's limits, rendered."""

    floor: float
    ceiling: float
    margin: float


@dataclass
class Scrape:
    """What one GET of /metrics says."""

    total: float  # the counters, summed
    active: float  # the active gauges, summed
    note: str  # names /metrics lacks, said the first time only
    motion: tuple[float | None, ...] = ()  # the moving gauges
    started: float | None = None  # the server's process start (epoch seconds)
    sleeping: bool = False  # vllm:engine_sleep_state says the engine is not awake
    queued: float | None = None  # the queued gauges, summed (None: /metrics has none)
    engine: EngineCounts = field(default_factory=lambda: EngineCounts(None, None, None, None))


@dataclass
class Pace:
    """The engine steps this probe measured: (when, seconds) of each, the latest kept."""

    steps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))

    def learn(self, seconds: float, now: float) -> None:
        self.steps.append((now, seconds))

    def slowest(self, now: float) -> float:
        return max((s for when, s in self.steps if when >= now - LEARN_WINDOW), default=0.0)


@dataclass(frozen=True)
class Bound:
    """How long work may wait with no engine step now, and why."""

    seconds: float
    why: str


@dataclass
class Memory(probes.Memory):
    """The probe's memory between checks. The loop reads the first four (liveness/health.py):
    the restarts seen and their last evidence, since when work has waited without progress
    (None: idle or moving), the hang bound of the last check; the rest is the probe's own."""

    restarts: int = 0
    restart_evidence: str | None = None
    waiting_since: float | None = None
    bound: Bound | None = None
    total: float | None = None  # the counters at the last check
    motion: tuple[float | None, ...] | None = None  # ... and the moving gauges
    active: float = 0.0  # ... and the requests active
    started: float | None = None  # the server's process start at the last check
    still_at: float | None = None  # the last check that saw the work still waiting
    unanswered_since: float | None = None  # our first unanswered canary, while it lasts
    answered: bool = False  # this server has answered a canary
    pace: Pace = field(default_factory=Pace)
    stepped: deque[float] = field(default_factory=lambda: deque(maxlen=4))  # latest steps seen
    queued: float | None = None  # the queued gauges at the last check
    taken: float | None = None  # the last check that saw the queue go down
    told_missing: set[str] = field(default_factory=set)  # names /metrics lacks, said once
    traffic: Callable[[], Awaiting | None] | None = None  # for `unanswered`: no context there
    meter: EngineMeter = field(default_factory=EngineMeter)  # the engine's own counts
    measures: deque[Measure] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    calibration: Calibration | None = None  # the one this run sent, once sent
    canary_ended: float = 0.0  # when our last canary was answered or given up


def memory_of(ctx: ProbeContext) -> Memory:
    """The probe's memory in `ctx`; a context made without one (the idle watch's look at the
    server, a test) gets a new one."""
    if not isinstance(ctx.state, Memory):
        ctx.state = Memory()
    return ctx.state


def bound(params: Params, memory: Memory, now: float, awaiting: Awaiting | None) -> Bound:
    """margin x (the slowest step seen, or what the loop's awaiting prompt should take),
    within [floor, ceiling]. Kept in `memory.bound` for status and the loop."""
    stall = params.limits()
    # Its first step is over once the engine stepped twice since it was sent, and since a
    # request was last taken from the queue, and none is queued (a queued one starts later).
    since = max(awaiting.latest, memory.taken or 0.0) if awaiting is not None else 0.0
    counted = memory.meter.steps_since(since, settled(memory, awaiting))
    stepped = sum(t > since for t in memory.stepped) >= 2 or counted >= 2
    if awaiting is not None and stepped and not memory.queued:
        awaiting = None  # the steps measured cover the rest
    if params.stall_after is not None:
        found = Bound(stall.floor, f"stall_after {stall.floor:g} s")
    else:
        base = memory.pace.slowest(now)
        why = f"the slowest step seen, {base:.1f} s" if base else "no slow step seen"
        if awaiting is not None:
            measures = [*memory.measures, *awaiting.measures]
            expected = first_token.expected(measures, awaiting.tokens, now)
            size = f"a prompt of this loop (~{awaiting.tokens:.0f} tokens)"
            if expected is None:
                base, why = math.inf, f"{size} awaits its first token, pace unmeasured"
            else:  # both said, whichever is larger: the source of the first step's pace shows
                first = f"{size} to its first token, {expected.seconds:.1f} s by {expected.source}"
                why = f"the larger of {why} and {first}"
                base = max(base, expected.seconds)
        seconds = min(max(stall.margin * base, stall.floor), stall.ceiling)
        limits = f"floor {stall.floor:g}, ceiling {stall.ceiling:g}"
        found = Bound(seconds, f"{stall.margin:g} x {why}; {limits}")
    memory.bound = found
    return found


def metered(memory: Memory, seen: Scrape, now: float) -> None:
    """The engine's own numbers of a scrape: its steps counted, its pace of prompts."""
    measured = memory.meter.read(seen.engine, now, idle=not seen.active and not seen.queued)
    if measured is not None:
        memory.measures.append(measured)


def settled(memory: Memory, awaiting: Awaiting | None) -> float:
    """When the last request of the loop's or the probe's own (canary, calibration) ended:
    the engine's steps before then may be theirs."""
    calibration = memory.calibration
    ended = calibration.ended if calibration is not None and calibration.ended else 0.0
    return max(awaiting.settled if awaiting else 0.0, memory.canary_ended, ended)


def learn(memory: Memory, now: float) -> None:
    """Something moved: the engine was seen without a step from the start of the wait to the
    last check that saw it still (a lower bound of the step: a fast engine measures 0)."""
    memory.stepped.append(now)
    start = memory.unanswered_since or memory.waiting_since
    still, memory.still_at = memory.still_at, None
    if start is not None and still is not None and still > start:
        memory.pace.learn(still - start, now)


def awaiting_of(ctx: ProbeContext, memory: Memory) -> Awaiting | None:
    memory.traffic = ctx.traffic  # for `unanswered`, which gets no context
    return awaited(memory)


def awaited(memory: Memory) -> Awaiting | None:
    """The loop's requests awaiting their first token (its proxy's), with the probe's own
    calibration while it awaits its answer: work whose first step nothing has measured."""
    awaiting = memory.traffic() if memory.traffic is not None else None
    calibration = memory.calibration
    if calibration is None or calibration.measure is not None or calibration.error is not None:
        return awaiting
    if calibration.done.is_set():
        return awaiting
    if awaiting is None:
        sent = calibration.sent  # our canary's steps came just before it: no idle reference
        return Awaiting(1, sent, sent, calibration.tokens, settled=sent)
    return replace(
        awaiting,
        count=awaiting.count + 1,
        since=min(awaiting.since, calibration.sent),
        latest=max(awaiting.latest, calibration.sent),
        tokens=max(awaiting.tokens, calibration.tokens),
        settled=max(awaiting.settled, calibration.sent),
    )


def check(params: Params, ctx: ProbeContext) -> Verdict:
    deadline = time.monotonic() + ctx.timeout
    memory = memory_of(ctx)
    seen = scrape(params, ctx)
    if not isinstance(seen, Scrape):
        return seen
    now = time.monotonic()
    metered(memory, seen, now)
    absorb(memory)  # a calibration answered since the last check
    awaiting = awaiting_of(ctx, memory)
    # The loop's own request awaiting its first token is work the gauges may not show yet.
    active = seen.active or (awaiting.count if awaiting is not None else 0)
    last, last_motion = memory.total, memory.motion
    memory.total, memory.motion, memory.active = seen.total, seen.motion, active
    queued, memory.queued = memory.queued, seen.queued
    if queued is not None and seen.queued is not None and seen.queued < queued:
        memory.taken = now  # a queued request was taken: its first step begins
    if restarted(memory, seen, last):
        memory.waiting_since = memory.still_at = None
        memory.answered = False  # a new server: it has answered nothing yet
    if seen.sleeping:
        detail = f'the engine is asleep ({SLEEP_STATE}{{sleep_state="awake"}} 0)'
        return Verdict(False, "stalled", detail, "asleep")
    if last is not None and seen.total > last:
        learn(memory, now)
        memory.waiting_since = now if active > 0 else None
        memory.unanswered_since = None
        gained = seen.total - last
        return Verdict(True, None, f"progress: +{gained:g} tokens, {active:g} active{seen.note}")
    if last is None or seen.total < last:  # first look, or a new server: its counters restart
        memory.waiting_since = None
    elif active > 0 and last_motion is not None and seen.motion != last_motion:
        learn(memory, now)
        memory.waiting_since = now  # a prefill chunk, a cache step: no token yet, but work
        memory.unanswered_since = None
        steps = moved(params, last_motion, seen)
        return Verdict(True, None, f"progress: the engine steps ({steps})")
    if active > 0:
        if memory.waiting_since is None and awaiting is not None and not seen.active:
            memory.waiting_since = awaiting.since  # the engine has had it since it was sent
        memory.unanswered_since = None  # work shows: its own stall clock runs
        return without_tokens(params, memory, active, seen.note, awaiting)
    memory.waiting_since = None
    if params.completion is None:
        return Verdict(True, None, f"idle: no request active{seen.note}")
    return canary(params, ctx, deadline, seen)


def restarted(memory: Memory, seen: Scrape, last_total: float | None) -> bool:
    """Another server answers than at the last check: count it in `restarts`, say why."""
    before, memory.started = memory.started, seen.started
    if before is not None and seen.started is not None and seen.started != before:
        why = f"{STARTED} {before:.0f} -> {seen.started:.0f}"
    elif last_total is not None and seen.total < last_total:
        why = f"the counters went back ({last_total:g} -> {seen.total:g})"
    else:
        return False
    memory.restarts += 1
    memory.restart_evidence = why
    return True


def moved(params: Params, before: tuple[float | None, ...], seen: Scrape) -> str:
    pairs = zip(params.moving, before, seen.motion, strict=False)
    return ", ".join(
        f"{name} {a:g} -> {b:g}" for name, a, b in pairs if a != b and None not in (a, b)
    )


def without_tokens(
    params: Params,
    memory: Memory,
    active: float,
    note: str = "",
    awaiting: Awaiting | None = None,
) -> Verdict:
    """Requests active and no engine step: busy within the hang bound from when the work was
    first seen waiting (or the last step), then stalled."""
    now = time.monotonic()
    if memory.waiting_since is None:
        memory.waiting_since = now
    memory.still_at = now
    quiet = now - memory.waiting_since
    limit = bound(params, memory, now, awaiting)
    if quiet < limit.seconds:
        allowed = f" (bound {limit.seconds:.1f} s)"
        return Verdict(
            True, None, f"busy: {active:g} active, no token for {quiet:.1f} s{allowed}{note}"
        )
    return Verdict(
        False,
        "stalled",
        f"no token for {quiet:.1f} s while {active:g} request{'' if active == 1 else 's'} active"
        f" (bound {limit.seconds:.1f} s: {limit.why})",
        "work-stalled",
    )


def unanswered(params: Params, state: probes.Memory) -> Verdict | None:
    """/metrics did not answer in time. With work active at its last answer, the server may be
    starved rather than hung (a CPU engine generating on two cores kept its API server from
    answering /metrics for over 10 s, measured): busy within the hang bound without progress,
    then stalled, as when it answers with numbers that stand still. The loop's own request
    awaiting its first token is such work too, though the last answer said idle: a server that
    answers /metrics from its engine's loop (llama.cpp's does, between tasks) may not while the
    first batch of that prompt runs. Else an ordinary timeout."""
    if not isinstance(state, Memory):
        return None
    awaiting = awaited(state)
    active = state.active or (awaiting.count if awaiting is not None else 0)
    if not active:
        return None
    if not state.active and state.waiting_since is None and awaiting is not None:
        state.waiting_since = awaiting.since  # the engine has had it since it was sent
    return without_tokens(params, state, active, awaiting=awaiting)


def canary(params: Params, ctx: ProbeContext, deadline: float, before: Scrape) -> Verdict:
    """The idle engine must answer one token; if it does not, /metrics decides: busy or stalled.
    Once the bound has run out since the first unanswered canary, the next one (a confirming
    round's) waits CONFIRM s, not the whole timeout."""
    memory = memory_of(ctx)
    within = max(deadline - time.monotonic() - reserve(ctx), reserve(ctx))
    since = memory.unanswered_since
    if since is not None:
        left = bound(params, memory, time.monotonic(), None).seconds - (time.monotonic() - since)
        within = min(within, max(left, CONFIRM))
    assert params.completion is not None  # check() asks the canary only when there is one
    sent = time.monotonic()
    try:
        answer = completion_probe.check(params.completion, replace(ctx, timeout=within))
    except httpx.TimeoutException:
        return canary_unanswered(params, ctx, deadline, before, (sent, within))
    finally:
        memory.canary_ended = time.monotonic()
    took = time.monotonic() - sent
    if not answer.ok:
        return answer
    after = scrape(params, replace(ctx, timeout=max(deadline - time.monotonic(), reserve(ctx))))
    if not isinstance(after, Scrape):
        return after
    memory.total = after.total  # our canary's own tokens are no progress of the engine
    metered(memory, after, time.monotonic())  # its steps counted: a reference past them
    memory.motion = after.motion
    memory.answered = True
    if since is not None:  # it waited behind a step the gauges did not show: learn that step
        memory.still_at = sent
        learn(memory, time.monotonic())
    memory.unanswered_since = None
    memory.pace.learn(took, time.monotonic())
    said = calibrate(params, ctx, deadline)
    return Verdict(
        True, None, f"idle: a 1-token request answered in {took:.2f} s{said}{before.note}"
    )


def calibrate(params: Params, ctx: ProbeContext, deadline: float) -> str:
    """At the first idle check that finds no pace measured (the loop's prompts would get the
    ceiling), one request of known size measures it (plugins/first_token.py): awaited for the
    rest of this check's time, then on its own thread, as work of unmeasured pace. Only for a
    loop (its proxy's traffic to cover), once a run. What it says, for the check's detail."""
    memory = memory_of(ctx)
    if memory.calibration is not None:
        return absorb(memory)
    now = time.monotonic()
    if ctx.traffic is None or not params.calibrate or params.completion is None:
        return ""
    if first_token.knows_pace(memory.measures, now):
        return ""
    completion = params.completion
    ceiling = params.limits().ceiling
    memory.calibration = Calibration(
        ctx.client, completion.url, completion.model, completion.headers, ceiling
    )
    memory.calibration.wait(deadline - time.monotonic() - reserve(ctx))
    return absorb(memory)


def absorb(memory: Memory) -> str:
    """The calibration's answer, once it came: its measure joins the engine's."""
    calibration = memory.calibration
    if calibration is None or not calibration.done.is_set():
        return "; calibrating" if calibration is not None else ""
    if calibration.measure is not None and calibration.measure not in memory.measures:
        memory.measures.append(calibration.measure)
        m = calibration.measure
        return f"; calibrated: {m.tokens:.0f} prompt tokens to a first token in {m.seconds:.2f} s"
    if calibration.error is not None and not calibration.told:
        calibration.told = True
        return f"; calibration failed ({calibration.error}): a prompt's pace stays unmeasured"
    return ""


def canary_unanswered(
    params: Params, ctx: ProbeContext, deadline: float, before: Scrape, canary: tuple[float, float]
) -> Verdict:
    """No token for our canary. Work that came meanwhile may hold the engine: busy if tokens
    moved or more than our canary is active; else the idle engine is stalled. Either way our
    canary (sent at `sent`, given `within` s) is a request waiting: the stall clock runs from
    when it was sent."""
    sent, within = canary
    again = scrape(params, replace(ctx, timeout=max(deadline - time.monotonic(), reserve(ctx))))
    if not isinstance(again, Scrape):
        return again
    memory = memory_of(ctx)
    memory.total, memory.active = again.total, again.active
    if again.total > before.total:  # our canary waits behind that work, so work is active
        memory.waiting_since = time.monotonic()
        memory.unanswered_since = None
        gained = again.total - before.total
        return Verdict(True, None, f"busy: +{gained:g} tokens while our 1-token request waited")
    memory.waiting_since = sent
    if again.active > 1:  # our canary is at most one of them
        return without_tokens(params, memory, again.active)
    unanswered = "idle engine did not answer a 1-token request within"
    if not memory.answered:
        return Verdict(False, "stalled", f"{unanswered} {within:.1f} s", "idle-unanswered")
    now = time.monotonic()
    if memory.unanswered_since is None:
        memory.unanswered_since = sent
    quiet = now - memory.unanswered_since
    memory.still_at = now
    limit = bound(params, memory, now, None)
    if quiet < limit.seconds:  # an engine step under way that the gauges do not show yet?
        return Verdict(
            True,
            None,
            f"busy?: no answer to a 1-token request for {quiet:.1f} s, gauges idle"
            f" (bound {limit.seconds:.1f} s)",
        )
    return Verdict(
        False,
        "stalled",
        f"{unanswered} {quiet:.1f} s (bound {limit.seconds:.1f} s: {limit.why})",
        "idle-unanswered",
    )


def reserve(ctx: ProbeContext) -> float:
    """The part of the probe's timeout kept for a scrape after the canary."""
    return min(RESCRAPE, ctx.timeout / 4)


def scrape(params: Params, ctx: ProbeContext) -> Scrape | Verdict:
    """GET /metrics: the sums, or a failed verdict when it cannot say (not 200, no metrics).

    A refused or timed-out request raises, and `run_probe` classifies it as for every probe.
    """
    response = request(ctx, "GET", params.metrics)
    text = response.text
    if response.status_code != 200:
        detail = f"{params.metrics}: HTTP {response.status_code}: {excerpt(text)}"
        return Verdict(False, "status", detail)
    prefill = params.prefill or Prefill()
    pace = [prefill.seconds, prefill.tokens, *([prefill.requests] if prefill.requests else [])]
    names = [*params.counters, *params.active, *params.moving, *params.queued, STARTED]
    names += [*params.steps, *pace]
    found = prometheus_text.samples(text, [*prometheus_text.sample_names(names), SLEEP_STATE])
    sums = prometheus_text.sums_of(found, names)
    counters = {name: sums[name] for name in params.counters}
    active = {name: sums[name] for name in params.active}
    for what, values in (("counters", counters), ("active gauges", active)):
        if all(value is None for value in values.values()):
            detail = f"{params.metrics} lacks all {what} {', '.join(values)}: {excerpt(text)}"
            return Verdict(False, "body", detail)
    missing = [name for name, value in {**counters, **active}.items() if value is None]
    told = memory_of(ctx).told_missing
    new = [name for name in missing if name not in told]
    told.update(new)
    note = f" (/metrics lacks {', '.join(new)}: left out)" if new else ""
    return Scrape(
        sum(v or 0.0 for v in counters.values()),
        sum(v or 0.0 for v in active.values()),
        note,
        motion=tuple(sums[name] for name in params.moving),
        queued=total_of(sums, params.queued),
        started=sums[STARTED],
        sleeping=asleep(found),
        engine=EngineCounts(
            sums[prefill.seconds],
            sums[prefill.tokens],
            sums[prefill.requests] if prefill.requests else None,
            total_of(sums, params.steps),
        ),
    )


def total_of(sums: dict[str, float | None], names: list[str]) -> float | None:
    """The sum of `names`' values; None when /metrics has none of them."""
    found = [sums[name] for name in names if sums[name] is not None]
    return sum(v for v in found if v is not None) if found else None


def asleep(found: list[prometheus_text.Sample]) -> bool:
    """vLLM's sleep gauge: one sample per state; the one labelled "awake" is 0 while asleep."""
    for sample in found:
        if sample.name == SLEEP_STATE and sample.labels.get("sleep_state") == "awake":
            return sample.value == 0.0
    return False
