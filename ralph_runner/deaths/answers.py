"""The answers of `ralph-run deaths` and `ralph-run report`, their shape declared once.

deaths/stats.py builds them (`tables`); `deaths --json` prints them as they are, and the text
(deaths/text.py), the report's charts (deaths/html.py) and its page (templates/report.html.j2)
read their keys. The keys and their order are the --json format, so they stay plain dicts:
TypedDicts, two of them in the functional form because their keys are `from` and `to`.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from ralph_runner.durable.jsonl import SkippedCounts

Totals = TypedDict(
    "Totals",
    {
        "deaths": int,
        "iterations": int,
        "recovered": int,
        "not_recovered": int,
        "no_recovery_record": int,
        "hosts": list[str],
        "from": float | None,  # epoch of the first death or iteration
        "to": float | None,  # epoch of the last
    },
)


class SignatureRow(TypedDict):
    """One kind of death (deaths/signatures.py) and how often, where and when it came."""

    signature: str
    deaths: int
    share: float  # of all deaths
    phases: dict[str, int]
    hosts: dict[str, int]
    first: float | None  # epoch
    last: float | None
    example: str | None  # the line the signature was masked from, as the last death had it


class DeathsOnHost(TypedDict):
    deaths: int
    iterations: int
    deaths_per_iteration: float | None  # None: no history from that host


class BetweenDeaths(TypedDict):
    """Mean time between deaths (stats.between_deaths)."""

    gaps: int
    mean_seconds: float | None
    median_seconds: float | None
    running_seconds: float | None  # the loop's time in the history
    running_seconds_per_death: float | None
    too_little: str | None  # why the figure means little, if it does


class Recovery(TypedDict):
    """How long recovery takes, and why it failed when it did."""

    recovered: int
    not_recovered: int
    reasons: dict[str, int]
    p50: float | None
    p95: float | None
    max: float | None
    too_little: str | None


Bucket = TypedDict(
    "Bucket",
    {
        "from": int,  # prompt size in characters, from (inclusive)
        "to": int,  # to (exclusive)
        "iterations": int | None,  # None: no iteration history at all
        "deaths": int,
        "rate": float | None,  # deaths per iteration; None: no iteration in the bucket
        "few": bool,  # fewer than stats.MIN_BUCKET iterations: the rate is not read
    },
)


class Cluster(TypedDict):
    """The prompt size above which the death rate rises the most."""

    above_chars: int
    iterations_above: int
    deaths_above: int
    rate_above: float
    iterations_below: int
    deaths_below: int
    rate_below: float


class PromptSize(TypedDict):
    """Deaths and iterations per prompt-size bucket, and where deaths cluster."""

    width: int | None  # of a bucket, in characters
    buckets: list[Bucket]
    cluster: Cluster | None
    no_cluster: str | None  # data enough, and no cluster: said so
    too_little: str | None


TokenKey = Literal["prompt_tokens", "generated_tokens", "requests"]
TOKEN_KEYS: tuple[TokenKey, ...] = ("prompt_tokens", "generated_tokens", "requests")


class Tokens(TypedDict):
    """What the loop's agent proxy counted (the receipts' sums)."""

    prompt_tokens: int
    generated_tokens: int
    requests: int


class ItemCost(Tokens):
    """One checklist item: every attempt at it, and what they cost."""

    attempts: int
    outcome: str | None  # its last attempt's
    seconds: float
    commits: int
    receipts: int  # attempts with a receipt


class Throughput(Tokens):
    """Items done per hour of loop time, and the tokens each item cost."""

    items_done: int
    running_seconds: float
    items_per_hour: float | None
    iterations_with_receipts: int
    estimated: int  # iterations whose tokens were estimated (no usage in the answers)
    tokens_per_item: float | None
    prompt_tokens_per_item: float | None
    generated_tokens_per_item: float | None
    by_item: dict[str, ItemCost]
    too_little: str | None


class ItemDeaths(TypedDict):
    """The deaths one item was in flight at (its death records' `item`), and its attempts."""

    item: str
    deaths: int
    alone: int  # of them with it alone in flight (the records' `blame`, loop/blame.py)
    attempts: int  # its lines in the history
    set_aside: bool  # a death record says its deaths set it aside
    largest_prompt: int | None  # characters, the largest it was sent with at a death


class RejuvenationRow(TypedDict):
    """A restart before a death (health.rejuvenate): its signs and numbers before and after."""

    rejuvenation: int | None
    time: str | None
    host: str
    signs: list[str]
    found: str
    recovered: bool
    seconds: float | None
    decode_baseline: float | None  # tokens/s: the rotted server's own baseline
    decode_before: float | None  # ... when the restart fell due
    decode_after: float | None  # the new server's baseline
    resident_mb_before: float | None


class Answers(TypedDict):
    """Every answer (`ralph-run deaths --json`, less its `deaths`)."""

    files: dict[str, dict[str, int]]  # path -> events read, by kind
    skipped: SkippedCounts
    notes: list[str]
    totals: Totals
    by_signature: list[SignatureRow]
    by_phase: dict[str, int]
    by_fault: dict[str, int]
    by_host: dict[str, DeathsOnHost]
    between_deaths: BetweenDeaths
    recovery: Recovery
    prompt_size: PromptSize
    by_item: list[ItemDeaths]  # most deaths first
    throughput: Throughput
    rejuvenations: list[RejuvenationRow]  # restarts before a death: no death counted


class DeathRow(TypedDict):
    """One death in a line (the text's last table, the report's table, --json's `deaths`)."""

    death: int | None
    time: str | None
    host: str
    phase: str
    fault: str
    iteration: int | None
    item: str | None
    prompt_chars: int | None
    signature: str
    recovered: bool | None  # None: no recovery record
    recovery_seconds: float | None
    source: str  # the records file


class AnswersWithDeaths(Answers):
    """`ralph-run deaths --json`: the answers and every death's row."""

    deaths: list[DeathRow]
