"""A night of deaths as numbers: what `ralph-run deaths` prints and `ralph-run report` draws.

`load` reads death records and iteration histories from record files, workdirs and runbooks
(one or many hosts), reading around torn and foreign lines and counting them. `tables` answers
the seed's questions: which kinds of death (signatures), in which phase, on which host; how
often (mean time between deaths); how long recovery takes (p50, p95, max); and whether deaths
come with big prompts (the death rate per prompt-size bucket against the iterations in it). Each
answer says when there is too little data to mean anything.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TypeGuard

from ralph_runner.deaths import signatures
from ralph_runner.deaths.answers import (
    TOKEN_KEYS,
    Answers,
    BetweenDeaths,
    Cluster,
    DeathsOnHost,
    ItemCost,
    ItemDeaths,
    PromptSize,
    Recovery,
    RejuvenationRow,
    SignatureRow,
    Throughput,
    Tokens,
)
from ralph_runner.deaths.log import for_plan as death_log_for
from ralph_runner.deaths.record import DeathRecord, RecoveryRecord, is_death, is_recovery
from ralph_runner.durable import jsonl
from ralph_runner.durable.json_value import JSON, JSONObject
from ralph_runner.errors import FatalError, Problem
from ralph_runner.workspace.state_files import HISTORY_FILE, SOURCES_FILE, STATE_DIR

HISTORY = f"{STATE_DIR}/{HISTORY_FILE}"
SOURCES = f"{STATE_DIR}/{SOURCES_FILE}"
HISTORY_SEARCH_DEPTH = 3  # a records file's directory and its parents searched for a history
MIN_GAPS = 5  # gaps between deaths below which a mean time between deaths is rough
MIN_RECOVERIES = 20  # recoveries below which p95 is no better than the max
MIN_BUCKET = 10  # iterations in a prompt-size bucket below which its rate is not read
MIN_SIDE = 20  # iterations on each side of a split for "deaths cluster above N chars"
MIN_CLUSTER_DEATHS = 3
CLUSTER_RATIO = 2.0  # the rate above a split must be this many times the rate below
MAX_BUCKETS = 10


@dataclass
class Death:
    record: DeathRecord
    source: str
    recovery: RecoveryRecord | None = None

    @property
    def number(self) -> int | None:
        return self.record.get("death")

    @property
    def host(self) -> str:
        return str(self.record.get("host") or "?")

    @property
    def phase(self) -> str:
        return str(self.record.get("phase") or "?")

    @property
    def fault(self) -> str:
        """The fault's class (liveness/faults.py); "?" for records written before classes."""
        return str(self.record.get("fault") or "?")

    @cached_property
    def time(self) -> float | None:
        return epoch(self.record.get("time"))

    @property
    def prompt_chars(self) -> int | None:
        value = self.record.get("prompt_size")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def item(self) -> str | None:
        """The item in hand at the death (None: between items)."""
        entry = self.record.get("item")
        return entry.get("text") if isinstance(entry, dict) else None

    @cached_property
    def signature(self) -> str:
        return signatures.signature(self.record)


@dataclass
class Data:
    deaths: list[Death] = field(default_factory=list)
    iterations: list[JSONObject] = field(default_factory=list)  # the histories' lines
    rejuvenations: list[JSONObject] = field(default_factory=list)  # restarts before a death
    rejuvenated_after: dict[object, object] = field(default_factory=dict)  # number -> baseline
    files: dict[str, Counter[str]] = field(default_factory=dict)  # path -> events read
    skipped: jsonl.Skipped = field(default_factory=jsonl.Skipped)
    notes: list[str] = field(default_factory=list)


def epoch(value: object) -> float | None:
    """Seconds since the epoch of a record's ISO time (or of a number already)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


# -- reading ------------------------------------------------------------------------------------


def load(
    targets: list[str], inventory: str | None = None, extra_vars: list[str] | None = None
) -> Data:
    """Read every file the targets name (records, histories), once each."""
    data = Data()
    paths: list[Path] = []
    for target in targets:
        for path in files_of(target, inventory, extra_vars, data.notes):
            if path.resolve() not in {p.resolve() for p in paths}:
                paths.append(path)
    for path in paths:
        read_file(path, data)
    return data


def files_of(
    target: str, inventory: str | None, extra_vars: list[str] | None, notes: list[str]
) -> list[Path]:
    """The files a target stands for: a .jsonl as given (with the history of its workdir), a
    directory's records and history, a runbook's records and history on each of its hosts."""
    path = Path(target)
    if path.is_dir():
        return workdir_files(path, notes)
    if not path.is_file():
        raise FatalError(Problem("no such file or directory", target))
    if path.suffix == ".jsonl":
        return [path, *nearby_history(path)]
    from ralph_runner.runbook import plan  # a runbook: the whole loader, only when needed

    found = []
    for selected in plan.build(path, inventory, None, extra_vars):
        records = death_log_for(selected).records_path
        history = selected.workdir / HISTORY
        found += [p for p in (records, history) if p.is_file()]
        if not records.is_file():
            notes.append(f"{selected.host}: no death records yet at {records}")
    return found


def workdir_files(workdir: Path, notes: list[str]) -> list[Path]:
    state = workdir / STATE_DIR
    if not state.is_dir():
        raise FatalError(Problem(f"no {STATE_DIR}/ here: not a ralph-run workdir", str(workdir)))
    found = []
    try:
        records = Path(json.loads((workdir / SOURCES).read_text())["records"])
    except (OSError, ValueError, KeyError, TypeError):
        notes.append(f"{workdir}: no {SOURCES} (run before ralph-run kept it): name the records")
    else:
        if records.is_file():
            found.append(records)
    if (workdir / HISTORY).is_file():
        found.append(workdir / HISTORY)
    return found


def nearby_history(records: Path) -> list[Path]:
    """The iteration history of the workdir a records file lies in (logs/x.jsonl: ../.ralph)."""
    directory = records.resolve().parent
    for _ in range(HISTORY_SEARCH_DEPTH):
        candidate = directory / HISTORY
        if candidate.is_file():
            return [candidate]
        directory = directory.parent
    return []


def read_file(path: Path, data: Data) -> None:
    counts: Counter[str] = Counter()
    latest: dict[int | None, Death] = {}  # death number -> the latest of that number, this file
    for number, entry in jsonl.read(path, data.skipped):
        event = str(entry.get("event"))
        if is_death(entry):
            death = Death(entry, str(path))
            latest[entry.get("death")] = death
            data.deaths.append(death)
        elif is_recovery(entry) and entry.get("death") in latest:
            latest[entry.get("death")].recovery = entry
        elif event == "iteration":
            data.iterations.append(entry)
        elif event == "start":
            pass  # the service was not running at a run's first check: counted, no death
        elif event == "rejuvenation":
            data.rejuvenations.append(entry)  # a restart at a boundary: no death
        elif event == "rejuvenation-after":
            data.rejuvenated_after[entry.get("rejuvenation")] = entry.get("after")
        else:
            data.skipped.add("foreign", path, number)
            continue
        counts[event] += 1
    data.files[str(path)] = counts


# -- the tables ---------------------------------------------------------------------------------


def tables(data: Data) -> Answers:
    """Every answer, as plain data (the --json output; the text view and the report draw it)."""
    deaths = data.deaths
    recovered = [d for d in deaths if d.recovery and d.recovery.get("recovered")]
    failed = [d for d in deaths if d.recovery and not d.recovery.get("recovered")]
    times = [t for t in (d.time for d in deaths) if t is not None]
    times += [t for t in (epoch(i.get("started")) for i in data.iterations) if t is not None]
    hosts = sorted({d.host for d in deaths} | {str(i.get("host") or "?") for i in data.iterations})
    return {
        "files": {path: dict(counts) for path, counts in data.files.items()},
        "skipped": data.skipped.as_dict(),
        "notes": data.notes,
        "totals": {
            "deaths": len(deaths),
            "iterations": len(data.iterations),
            "recovered": len(recovered),
            "not_recovered": len(failed),
            "no_recovery_record": len(deaths) - len(recovered) - len(failed),
            "hosts": hosts,
            "from": min(times) if times else None,
            "to": max(times) if times else None,
        },
        "by_signature": by_signature(deaths),
        "by_phase": dict(Counter(d.phase for d in deaths).most_common()),
        "by_fault": dict(Counter(d.fault for d in deaths).most_common()),
        "by_host": by_host(deaths, data.iterations, hosts),
        "between_deaths": between_deaths(deaths, data.iterations),
        "recovery": recovery(recovered, failed),
        "prompt_size": prompt_buckets(deaths, data.iterations),
        "by_item": by_item(deaths, data.iterations),
        "throughput": throughput(data.iterations),
        "rejuvenations": rejuvenations(data),
    }


def rejuvenations(data: Data) -> list[RejuvenationRow]:
    """Each restart before a death, with the new server's baseline once it was measured."""
    rows: list[RejuvenationRow] = []
    for entry in data.rejuvenations:
        before, baseline = _numbers(entry.get("before")), _numbers(entry.get("baseline"))
        after = _numbers(data.rejuvenated_after.get(entry.get("rejuvenation")))
        number, seconds = entry.get("rejuvenation"), entry.get("seconds")
        signs = entry.get("signs")
        rows.append({
            "rejuvenation": number if isinstance(number, int) else None,
            "time": str(entry["time"]) if "time" in entry else None,
            "host": str(entry.get("host") or "?"),
            "signs": [str(s) for s in signs] if isinstance(signs, list) else [],
            "found": str(entry.get("found") or ""),
            "recovered": entry.get("recovered") is True,
            "seconds": float(seconds) if isinstance(seconds, int | float) else None,
            "decode_baseline": baseline.get("decode"),
            "decode_before": before.get("decode"),
            "decode_after": after.get("decode"),
            "resident_mb_before": before.get("resident_mb"),
        })  # fmt: skip
    return rows


def _numbers(value: object) -> dict[str, float]:
    """A record's numbers (before, baseline, after): the numeric ones."""
    if not isinstance(value, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in value.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def throughput(iterations: list[JSONObject]) -> Throughput:
    """Items done per hour of loop time, and the tokens each item cost: every attempt at it
    counts (a struck or retried one spent tokens too), from the receipts of the loop's agent
    proxy (`receipt`); iterations without one (loop.proxy off) add no tokens."""
    running = sum(_seconds(i) for i in iterations)
    done = sum(1 for i in iterations if i.get("outcome") == "done")
    items: dict[str, ItemCost] = {}
    totals: Tokens = {"prompt_tokens": 0, "generated_tokens": 0, "requests": 0}
    counted = estimated = 0
    for line in iterations:
        row = items.setdefault(
            str(line.get("item")),
            {
                "attempts": 0,
                "outcome": None,
                "seconds": 0.0,
                "commits": 0,
                "receipts": 0,
                "prompt_tokens": 0,
                "generated_tokens": 0,
                "requests": 0,
            },
        )
        row["attempts"] += 1
        outcome = line.get("outcome")
        row["outcome"] = outcome if isinstance(outcome, str) else None
        row["seconds"] += _seconds(line)
        row["commits"] += 1 if line.get("commit") else 0
        receipt = line.get("receipt")
        if not isinstance(receipt, dict):
            continue
        counted += 1
        estimated += 1 if receipt.get("tokens_estimated") else 0
        row["receipts"] += 1
        for key in TOKEN_KEYS:
            value = receipt.get(key)
            if isinstance(value, int):
                row[key] += value
                totals[key] += value
    tokens = totals["prompt_tokens"] + totals["generated_tokens"]
    return {
        "items_done": done,
        "running_seconds": running,
        "items_per_hour": done * 3600 / running if running > 0 else None,
        **totals,
        "iterations_with_receipts": counted,
        "estimated": estimated,
        "tokens_per_item": tokens / done if done and counted else None,
        "prompt_tokens_per_item": totals["prompt_tokens"] / done if done and counted else None,
        "generated_tokens_per_item": (
            totals["generated_tokens"] / done if done and counted else None
        ),
        "by_item": items,
        "too_little": None if counted else _why_no_tokens(iterations),
    }


def _why_no_tokens(iterations: list[JSONObject]) -> str:
    """Why no iteration has a receipt: none ran yet (the proxy may well be on), or the ones
    that ran had none (loop.proxy off)."""
    if not iterations:
        return "no iterations in the history yet: tokens per item unknown"
    return "no receipts in the history (loop.proxy off): tokens per item unknown"


def _seconds(line: JSONObject) -> float:
    """An iteration's seconds; 0 when its line has none (an int stays an int: the --json)."""
    seconds = line.get("seconds")
    return seconds if isinstance(seconds, int | float) else 0


def by_signature(deaths: list[Death]) -> list[SignatureRow]:
    groups: dict[str, list[Death]] = {}
    for death in deaths:
        groups.setdefault(death.signature, []).append(death)
    rows: list[SignatureRow] = []
    for signature, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        times = [t for t in (d.time for d in members) if t is not None]
        found = members[-1].record.get("signature_from")
        rows.append(
            {
                "signature": signature,
                "deaths": len(members),
                "share": len(members) / len(deaths),
                "phases": dict(Counter(d.phase for d in members).most_common()),
                "hosts": dict(Counter(d.host for d in members).most_common()),
                "first": min(times) if times else None,
                "last": max(times) if times else None,
                "example": found.get("line") if found else None,
            }
        )
    return rows


def by_host(
    deaths: list[Death], iterations: list[JSONObject], hosts: list[str]
) -> dict[str, DeathsOnHost]:
    died = Counter(d.host for d in deaths)
    ran = Counter(str(i.get("host") or "?") for i in iterations)
    return {
        host: {
            "deaths": died[host],
            "iterations": ran[host],
            "deaths_per_iteration": died[host] / ran[host] if ran[host] else None,
        }
        for host in hosts
    }


def between_deaths(deaths: list[Death], iterations: list[JSONObject]) -> BetweenDeaths:
    """Mean time between deaths: the gaps between one host's consecutive deaths, and the loop's
    running time (the history's iteration seconds) per death, which leaves out the hours the
    loop was not running at all."""
    gaps: list[float] = []
    by_host: dict[str, list[float]] = {}
    for death in deaths:
        if death.time is not None:
            by_host.setdefault(death.host, []).append(death.time)
    for times in by_host.values():
        times.sort()
        gaps += [b - a for a, b in itertools.pairwise(times)]
    running = sum(_seconds(i) for i in iterations)
    result: BetweenDeaths = {
        "gaps": len(gaps),
        "mean_seconds": sum(gaps) / len(gaps) if gaps else None,
        "median_seconds": percentile(sorted(gaps), 0.5) if gaps else None,
        "running_seconds": running if iterations else None,
        "running_seconds_per_death": running / len(deaths) if iterations and deaths else None,
        "too_little": None,
    }
    if not gaps:
        result["too_little"] = "needs 2 deaths on one host"
    elif len(gaps) < MIN_GAPS:
        result["too_little"] = f"only {len(gaps)} gap(s) between deaths: a rough figure"
    return result


def percentile(ordered: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted values (p95 of 10 values is the largest)."""
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def recovery(recovered: list[Death], failed: list[Death]) -> Recovery:
    seconds = sorted(
        float(d.recovery["seconds"])
        for d in recovered
        if d.recovery and isinstance(d.recovery.get("seconds"), int | float)
    )
    reasons = Counter(str((d.recovery or {}).get("reason") or "gave up") for d in failed)
    result: Recovery = {
        "recovered": len(recovered),
        "not_recovered": len(failed),
        "reasons": dict(reasons.most_common()),
        "p50": percentile(seconds, 0.5) if seconds else None,
        "p95": percentile(seconds, 0.95) if seconds else None,
        "max": seconds[-1] if seconds else None,
        "too_little": None,
    }
    if not seconds:
        result["too_little"] = "no recovery recorded"
    elif len(seconds) < MIN_RECOVERIES:
        result["too_little"] = f"{len(seconds)} recoveries: p95 needs {MIN_RECOVERIES}"
    return result


def nice_width(largest: int) -> int:
    """A round bucket width (1, 2, 5 x 10^k) giving at most MAX_BUCKETS buckets up to largest."""
    raw = max(1.0, (largest + 1) / MAX_BUCKETS)
    power = 10 ** math.floor(math.log10(raw))
    return int(next(m * power for m in (1, 2, 5, 10) if m * power >= raw))


def prompt_buckets(deaths: list[Death], iterations: list[JSONObject]) -> PromptSize:
    """Deaths and iterations per prompt-size bucket (characters), and where deaths cluster."""
    ran = [c for c in (i.get("prompt_chars") for i in iterations) if _count(c)]
    died = [d.prompt_chars for d in deaths if d.prompt_chars is not None]
    result: PromptSize = {
        "width": None, "buckets": [], "cluster": None, "no_cluster": None, "too_little": None
    }  # fmt: skip
    if not ran and not died:
        result["too_little"] = "no prompt sizes recorded"
        return result
    width = nice_width(max(ran + died))
    count = max(ran + died) // width + 1
    runs, dead = Counter(c // width for c in ran), Counter(c // width for c in died)
    result["width"] = width
    result["buckets"] = [
        {
            "from": k * width,
            "to": (k + 1) * width,
            "iterations": runs[k] if ran else None,
            "deaths": dead[k],
            "rate": dead[k] / runs[k] if runs[k] else None,
            "few": bool(ran) and runs[k] < MIN_BUCKET,
        }
        for k in range(count)
        if runs[k] or dead[k]  # an empty bucket says nothing: not listed
    ]
    if not ran:
        result["too_little"] = "no iteration history: deaths per bucket only, no rate"
        return result
    result["cluster"], enough = cluster(sorted(ran), sorted(died), width, count)
    if result["cluster"] is None and enough:
        result["no_cluster"] = (
            f"deaths do not cluster by prompt size: no split has {CLUSTER_RATIO:g}x the death "
            "rate above it than below"
        )
    elif result["cluster"] is None:
        result["too_little"] = (
            f"no split with {MIN_SIDE}+ iterations on each side and {MIN_CLUSTER_DEATHS}+ "
            "deaths above it: too few to say where deaths cluster"
        )
    return result


def cluster(ran: list[int], died: list[int], width: int, count: int) -> tuple[Cluster | None, bool]:
    """The bucket boundary above which the death rate rises the most (or None), and whether
    any boundary had data enough on both sides to tell."""
    best: Cluster | None = None
    enough = False
    for k in range(1, count):
        edge = k * width
        below_runs = sum(1 for c in ran if c < edge)
        above_runs = len(ran) - below_runs
        below_deaths = sum(1 for c in died if c < edge)
        above_deaths = len(died) - below_deaths
        if min(below_runs, above_runs) < MIN_SIDE or above_deaths < MIN_CLUSTER_DEATHS:
            continue
        enough = True
        above, below = above_deaths / above_runs, below_deaths / below_runs
        if above < CLUSTER_RATIO * below:
            continue
        if best is None or above - below > best["rate_above"] - best["rate_below"]:
            best = {
                "above_chars": edge,
                "iterations_above": above_runs,
                "deaths_above": above_deaths,
                "rate_above": above,
                "iterations_below": below_runs,
                "deaths_below": below_deaths,
                "rate_below": below,
            }
    return best, enough


def by_item(deaths: list[Death], iterations: list[JSONObject]) -> list[ItemDeaths]:
    """Deaths by the item in hand, most first: which items the server died with, how often
    alone, and whether their deaths set them aside (docs: deaths)."""
    attempts = Counter(str(line.get("item")) for line in iterations)
    rows: dict[str, ItemDeaths] = {}
    for death in deaths:
        if death.item is None:
            continue
        row = rows.setdefault(
            death.item,
            {
                "item": death.item,
                "deaths": 0,
                "alone": 0,
                "attempts": attempts[death.item],
                "set_aside": False,
                "largest_prompt": None,
            },
        )
        row["deaths"] += 1
        blame = death.record.get("blame")
        if blame and blame.get("item") == death.item:
            row["alone"] += 1
            row["set_aside"] = row["set_aside"] or bool(blame.get("set_aside"))
        if death.prompt_chars is not None:
            row["largest_prompt"] = max(row["largest_prompt"] or 0, death.prompt_chars)
    return sorted(rows.values(), key=lambda row: -row["deaths"])


def _count(value: JSON) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
