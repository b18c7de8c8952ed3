"""What kind of fault a death was, in the operator's words, and the evidence for it.

The probes say *how* a check failed (refused, timeout, status, body, error, stalled, foreign);
an operator wants *what happened to the server*: gone, dead, stalled with work waiting, idle and
not answering, asleep, restarted by someone else, its port taken by another user. The class goes
into the death record, the console's death line and `ralph-run deaths`' table by class.
"""

from __future__ import annotations

import re

from ralph_runner.probes import Finding, ProbeResult

NOT_RUNNING = "not running"  # the first check of a run found nothing serving yet: a start
GONE = "server gone"  # refused: nothing listens (the API server exited)
DEAD = "engine dead"  # 500 / 503 (EngineDeadError), the API server still up
STALLED_WORK = "engine stalled with work waiting"  # requests active, no progress
STALLED_IDLE = "idle engine not answering"  # nothing active, our 1-token canary unanswered
ASLEEP = "sleeping"  # vllm:engine_sleep_state: put to sleep, serves nothing
WEDGED = "server not answering"  # a probe timed out: the API server itself is wedged
RESTARTED = "restarted by someone else"  # a new server answered during the attempt
FOREIGN = "port held by another user"  # it answers, but its socket is not ours (port_owner.py)
REJUVENATION = "rejuvenation"  # no fault: restarted at a boundary because it rots (no death)
OTHER = "other"
STALLED: dict[Finding, str] = {  # a stalled probe's finding -> the class
    "work-stalled": STALLED_WORK,
    "idle-unanswered": STALLED_IDLE,
    "asleep": ASLEEP,
}


# llama.cpp's answer to every request while its model loads: {"error": {"code": 503,
# "message": "Loading model", "type": "unavailable_error"}}
LOADING = re.compile(r"\bHTTP 503\b.*\bLoading model\b", re.IGNORECASE | re.DOTALL)


def not_serving_yet(result: ProbeResult) -> bool:
    """A failed check that says the server is not serving *yet*: nothing listens, or it
    answers that it is still loading its model (llama.cpp's 503). At a run's first check,
    that is a server to start (or wait for), not a death."""
    return result.reason == "refused" or (
        result.reason == "status" and LOADING.search(result.detail) is not None
    )


def classify(results: list[ProbeResult]) -> tuple[str, str]:
    """The class of a death from its last failed round, and the evidence (the failing detail)."""
    failing = [r for r in results if not r.ok]
    if not failing:
        return OTHER, "no failing probe"
    by_reason = {r.reason: r for r in failing}
    for reason, cls in (("foreign", FOREIGN), ("refused", GONE), ("status", DEAD)):
        if reason in by_reason:
            return cls, _evidence(by_reason[reason])
    stalled = by_reason.get("stalled")
    if stalled is not None:  # the class from what the probe found (none said: work waiting)
        found = STALLED[stalled.finding] if stalled.finding is not None else STALLED_WORK
        return found, _evidence(stalled)
    if "timeout" in by_reason:
        return WEDGED, _evidence(by_reason["timeout"])
    return OTHER, _evidence(failing[0])


def _evidence(result: ProbeResult) -> str:
    return f"{result.name}: {result.reason}: {result.detail}"
