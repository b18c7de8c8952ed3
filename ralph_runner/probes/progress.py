"""`progress: {metrics, completion, counters, moving, active, stall_after}`: is the engine working?

vLLM's `/metrics` keeps answering while its engine hangs, but its numbers stop; and a request
that waits in a busy engine's queue says nothing about liveness. So every check scrapes
`/metrics` (cheap, adds no load) and compares the engine's numbers with the last check's: the
token counters, and gauges that move with every engine step (`moving`: the KV-cache use, which
grows with each chunk of a long prefill while no token counter moves until it ends):
- they moved: ok, however long the queue (a busy engine is never a failure);
- requests are active and nothing moved: ok until `stall_after` seconds, then "stalled". The
  window need only outlast one engine step (one prefill chunk), not a whole long prompt;
- idle and nothing moved: a 1-token canary must be answered within the probe's timeout; an
  error status is "status" (vLLM answers 500 once its engine died); no answer and still no
  token is "stalled", unless more requests than our canary are now active (then: busy). An
  engine that answered a canary before gets `stall_after` s from its first unanswered one: the
  gauges say "idle" until an engine step ends, so the first chunk of a long prompt that just
  came looks like an idle engine that does not answer (on a CPU build, a long prompt's first
  2,048-token step took 12.7 s, longer than the canary's 5 s). A server that never answered
  one gets no such grace.
- `vllm:engine_sleep_state{sleep_state="awake"}` at 0: the engine was put to sleep (sleep
  mode), it serves nothing: "stalled", and the death's class says "sleeping".

Each check also notes which server answered: a new `process_start_time_seconds`, or counters
that went back, mean the server was restarted since the last check (by another loop, a restart
policy, systemd, a person). `restarts` in the probe's memory counts them, so that the loop can
tell a failed agent call that a restart cut from a failure of the agent's own.

The probe's memory lives in `ctx.state` (owned by the probe's worker, one check at a time):
the last numbers, and since when work has waited without progress (None when idle): the
later of the last progress seen and the first check that saw the work (or our unanswered
canary sent). A hang at time H is thus timed from H + one check period at the latest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import httpx
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from ralph_runner.plugins.fields import Templated
from ralph_runner.probes import ProbeContext, excerpt, request
from ralph_runner.probes import completion as completion_probe

KIND = "progress"
COUNTERS = ["vllm:generation_tokens_total", "vllm:prompt_tokens_total"]
# Numbers that change as the engine steps without a token counted: the KV-cache use grows with
# every prefill chunk, a preemption is work too. A server without them is simply not asked.
MOVING = ["vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"]
ACTIVE = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
STARTED = "process_start_time_seconds"  # which server answered
AWAKE = "vllm:engine_sleep_state{"  # its sample labelled sleep_state="awake" is 0 when asleep
RESCRAPE = 1.0  # seconds of the probe's timeout kept for the scrape after an unanswered canary

Verdict = tuple[bool, str | None, str]


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metrics: str  # vLLM's /metrics, beside /v1
    completion: completion_probe.Params | None = None  # the idle canary; None: idle is not checked
    counters: list[str] = Field(default_factory=lambda: list(COUNTERS), min_length=1)
    moving: list[str] = Field(default_factory=lambda: list(MOVING))
    active: list[str] = Field(default_factory=lambda: list(ACTIVE), min_length=1)
    stall_after: Templated[PositiveFloat] = 15.0


@dataclass
class Scrape:
    """What one GET of /metrics says."""

    total: float  # the counters, summed
    active: float  # the active gauges, summed
    note: str  # names /metrics lacks, said the first time only
    motion: tuple[float | None, ...] = ()  # the moving gauges
    started: float | None = None  # the server's process start (epoch seconds)
    sleeping: bool = False  # vllm:engine_sleep_state says the engine is not awake


def check(params: Params, ctx: ProbeContext) -> Verdict:
    deadline = time.monotonic() + ctx.timeout
    seen = scrape(params, ctx)
    if not isinstance(seen, Scrape):
        return seen
    state, now = ctx.state, time.monotonic()
    last, last_motion = state.get("total"), state.get("motion")
    state["total"], state["motion"], state["active"] = seen.total, seen.motion, seen.active
    if restarted(state, seen, last):
        state["waiting_since"] = None
        state.pop("answered", None)  # a new server: it has answered nothing yet
    if seen.sleeping:
        return (
            False,
            "stalled",
            'the engine is asleep (vllm:engine_sleep_state{sleep_state="awake"} 0)',
        )
    if last is not None and seen.total > last:
        state["waiting_since"] = now if seen.active > 0 else None
        state.pop("unanswered_since", None)
        gained = seen.total - last
        return True, None, f"progress: +{gained:g} tokens, {seen.active:g} active{seen.note}"
    if last is None or seen.total < last:  # first look, or a new server: its counters restart
        state["waiting_since"] = None
    elif seen.active > 0 and last_motion is not None and seen.motion != last_motion:
        state["waiting_since"] = now  # a prefill chunk, a cache step: no token yet, but work
        state.pop("unanswered_since", None)
        return True, None, f"progress: the engine steps ({moved(params, last_motion, seen)})"
    if seen.active > 0:
        state.pop("unanswered_since", None)  # work shows: its own stall clock runs
        return without_tokens(params, state, seen.active, seen.note)
    state["waiting_since"] = None
    if params.completion is None:
        return True, None, f"idle: no request active{seen.note}"
    return canary(params, ctx, deadline, seen)


def restarted(state: dict, seen: Scrape, last_total: float | None) -> bool:
    """Another server answers than at the last check: count it in `restarts`, say why."""
    before, state["started"] = state.get("started"), seen.started
    if before is not None and seen.started is not None and seen.started != before:
        why = f"{STARTED} {before:.0f} -> {seen.started:.0f}"
    elif last_total is not None and seen.total < last_total:
        why = f"the counters went back ({last_total:g} -> {seen.total:g})"
    else:
        return False
    state["restarts"] = state.get("restarts", 0) + 1
    state["restart_evidence"] = why
    return True


def moved(params: Params, before: tuple[float | None, ...], seen: Scrape) -> str:
    pairs = zip(params.moving, before, seen.motion, strict=False)
    return ", ".join(
        f"{name} {a:g} -> {b:g}" for name, a, b in pairs if a != b and None not in (a, b)
    )


def without_tokens(params: Params, state: dict, active: float, note: str = "") -> Verdict:
    """Requests active and no token: busy until `stall_after` s after the work was first seen
    waiting (or the last token), then stalled."""
    now = time.monotonic()
    if state.get("waiting_since") is None:
        state["waiting_since"] = now
    quiet = now - state["waiting_since"]
    if quiet < params.stall_after:
        return True, None, f"busy: {active:g} active, no token for {quiet:.1f} s{note}"
    return False, "stalled", f"no token for {quiet:.1f} s while {active:g} requests active"


def unanswered(params: Params, state: dict) -> Verdict | None:
    """/metrics did not answer in time. With work active at its last answer, the server may be
    starved rather than hung (a CPU engine generating on two cores kept its API server from
    answering /metrics for over 10 s, measured): busy until `stall_after` s without progress,
    then stalled, as when it answers with numbers that stand still. Else an ordinary timeout."""
    if not state.get("active"):
        return None
    return without_tokens(params, state, state["active"])


def canary(params: Params, ctx: ProbeContext, deadline: float, before: Scrape) -> Verdict:
    """The idle engine must answer one token; if it does not, /metrics decides: busy or stalled."""
    within = max(deadline - time.monotonic() - reserve(ctx), reserve(ctx))
    assert params.completion is not None  # check() asks the canary only when there is one
    sent = time.monotonic()
    try:
        ok, reason, detail = completion_probe.check(params.completion, replace(ctx, timeout=within))
    except httpx.TimeoutException:
        return canary_unanswered(params, ctx, deadline, before, (sent, within))
    took = time.monotonic() - sent
    if not ok:
        return False, reason, detail
    after = scrape(params, replace(ctx, timeout=max(deadline - time.monotonic(), reserve(ctx))))
    if not isinstance(after, Scrape):
        return after
    ctx.state["total"] = after.total  # our canary's own tokens are no progress of the engine
    ctx.state["motion"] = after.motion
    ctx.state["answered"] = True
    ctx.state.pop("unanswered_since", None)
    return True, None, f"idle: a 1-token request answered in {took:.2f} s{before.note}"


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
    state = ctx.state
    state["total"], state["active"] = again.total, again.active
    if again.total > before.total:  # our canary waits behind that work, so work is active
        state["waiting_since"] = time.monotonic()
        state.pop("unanswered_since", None)
        gained = again.total - before.total
        return True, None, f"busy: +{gained:g} tokens while our 1-token request waited"
    state["waiting_since"] = sent
    if again.active > 1:  # our canary is at most one of them
        return without_tokens(params, state, again.active)
    unanswered = "idle engine did not answer a 1-token request within"
    if not state.get("answered"):
        return False, "stalled", f"{unanswered} {within:.1f} s"
    quiet = time.monotonic() - state.setdefault("unanswered_since", sent)
    if quiet < params.stall_after:  # an engine step under way that the gauges do not show yet?
        return True, None, f"busy?: no answer to a 1-token request for {quiet:.1f} s, gauges idle"
    return False, "stalled", f"{unanswered} {quiet:.1f} s"


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
        return False, "status", f"{params.metrics}: HTTP {response.status_code}: {excerpt(text)}"
    counters = {name: metric_sum(text, name) for name in params.counters}
    active = {name: metric_sum(text, name) for name in params.active}
    for what, found in (("counters", counters), ("active gauges", active)):
        if all(value is None for value in found.values()):
            names = ", ".join(found)
            return False, "body", f"{params.metrics} lacks all {what} {names}: {excerpt(text)}"
    missing = [name for name, value in {**counters, **active}.items() if value is None]
    told = ctx.state.setdefault("told_missing", set())
    new = [name for name in missing if name not in told]
    told.update(new)
    note = f" (/metrics lacks {', '.join(new)}: left out)" if new else ""
    return Scrape(
        sum(v or 0.0 for v in counters.values()),
        sum(v or 0.0 for v in active.values()),
        note,
        motion=tuple(metric_sum(text, name) for name in params.moving),
        started=metric_sum(text, STARTED),
        sleeping=asleep(text),
    )


def asleep(text: str) -> bool:
    """vLLM's sleep gauge: one sample per state; the one labelled "awake" is 0 while asleep."""
    for line in text.splitlines() if AWAKE in text else ():
        if line.startswith(AWAKE) and 'sleep_state="awake"' in line:
            return sample_value(line, AWAKE[:-1]) == 0.0
    return False


def metric_sum(text: str, name: str) -> float | None:
    """The sum of `name`'s samples over all label sets in Prometheus text; None when absent.

    A search for each sample line's start instead of a parse of every line: /metrics is mostly
    histogram buckets, and it may be megabytes. `name` also matches `name_total` (a counter's
    family name); `name_created` and other suffixes are other samples and never match.
    """
    names = [name] if name.endswith("_total") else [name, f"{name}_total"]
    values = [value for one in names for value in samples(text, one)]
    if not values:
        return None
    return sum(value for value in values if not math.isnan(value))


def samples(text: str, name: str) -> list[float]:
    """The values of every sample line of `name` (comments and other metrics skipped)."""
    found = []
    start = 0 if text.startswith(name) else text.find("\n" + name)
    while start != -1:
        begin = start + (text[start] == "\n")
        end = text.find("\n", begin)
        value = sample_value(text[begin : end if end != -1 else len(text)], name)
        if value is not None:
            found.append(value)
        start = text.find("\n" + name, begin)
    return found


def sample_value(line: str, name: str) -> float | None:
    """The value of one sample line, `name{labels} value [timestamp]`; None for another name."""
    rest = line[len(name) :]
    if rest.startswith("{"):
        close = labels_end(rest)
        if close == -1:
            return None
        rest = rest[close + 1 :]
    elif not rest[:1].isspace():
        return None  # another metric whose name starts with this one
    fields = rest.split()
    try:
        return float(fields[0]) if fields else None
    except ValueError:
        return None


def labels_end(rest: str) -> int:
    """The index of the `}` closing a label set, honouring quoted values and escapes."""
    quoted = escaped = False
    for index, char in enumerate(rest):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return index
    return -1
