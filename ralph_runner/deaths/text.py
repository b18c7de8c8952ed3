"""A night of deaths as text: the tables of `ralph-run deaths`, also used by the HTML report.

Deaths by signature, phase and host, mean time between deaths, recovery p50/p95/max, the death
rate per prompt-size bucket against the iterations in it, then one line per death.
"""

from __future__ import annotations

from datetime import datetime

from ralph_runner.deaths import stats
from ralph_runner.deaths.answers import (
    Answers,
    BetweenDeaths,
    DeathRow,
    DeathsOnHost,
    ItemDeaths,
    PromptSize,
    Recovery,
    RejuvenationRow,
    Throughput,
)
from ralph_runner.output.durations import statistic
from ralph_runner.output.text import columns, plural, shorten

LAST_DEATHS = 30  # deaths listed one per line at the end (the most recent ones)
ITEM_WIDTH = 40


def death_row(death: stats.Death) -> DeathRow:
    recovery = death.recovery or {}
    return {
        "death": death.number,
        "time": death.record.get("time"),
        "host": death.host,
        "phase": death.phase,
        "fault": death.fault,
        "iteration": death.record.get("iteration"),
        "item": (death.record.get("item") or {}).get("text"),
        "prompt_chars": death.prompt_chars,
        "signature": death.signature,
        "recovered": recovery.get("recovered"),
        "recovery_seconds": recovery.get("seconds"),
        "source": death.source,
    }


def recovery_of(row: DeathRow) -> str:
    """A death's recovery in a word or three (a death_row's)."""
    if row["recovered"] is None:
        return "no recovery record"
    if not row["recovered"]:
        return "NOT recovered"
    return f"recovered in {statistic(row['recovery_seconds'])}"


def text(answers: Answers, data: stats.Data) -> list[str]:
    totals = answers["totals"]
    lines = [f"read {files_line(answers['files'])}"]
    if answers["skipped"]["total"]:
        lines.append(data.skipped.text())
    lines += answers["notes"]
    if not totals["deaths"]:
        iterations = totals["iterations"]
        lines.append(f"no deaths recorded ({plural(iterations, 'iteration')} in the history)")
        rejuvenated = rejuvenation_lines(answers["rejuvenations"])
        return [*lines, *rejuvenated, *throughput_lines(answers["throughput"])]
    span = f", {when(totals['from'])} – {when(totals['to'])}" if totals["from"] else ""
    lines += [
        "",
        f"{plural(totals['deaths'], 'death')} over {plural(totals['iterations'], 'iteration')} on "
        f"{plural(len(totals['hosts']), 'host')}{span}: {totals['recovered']} recovered, "
        f"{totals['not_recovered']} not recovered"
        + (
            f", {totals['no_recovery_record']} without a recovery record"
            if totals["no_recovery_record"]
            else ""
        ),
        "",
        "by signature",
        *table(
            ["deaths", "share", "phases", "hosts", "signature"],
            [
                [
                    str(row["deaths"]),
                    f"{row['share']:.0%}",
                    counts(row["phases"]),
                    counts(row["hosts"]),
                    row["signature"],
                ]
                for row in answers["by_signature"]
            ],
        ),
        "",
        f"by phase: {counts(answers['by_phase'])}",
        f"by fault: {counts(answers['by_fault'])}",
        "by host:",
        *table(
            ["host", "deaths", "iterations", "deaths per iteration"],
            [
                [host, str(row["deaths"]), str(row["iterations"]), share(row)]
                for host, row in answers["by_host"].items()
            ],
        ),
        "",
        between_line(answers["between_deaths"]),
        recovery_line(answers["recovery"]),
        "",
        *prompt_lines(answers["prompt_size"]),
        "",
        *item_lines(answers["by_item"]),
        "",
        *rejuvenation_lines(answers["rejuvenations"]),
        *throughput_lines(answers["throughput"]),
        "",
        *each_death(data.deaths),
    ]
    return lines


def rejuvenation_lines(rows: list[RejuvenationRow]) -> list[str]:
    """Restarts before a death (health.rejuvenate): not deaths; decode before and after."""
    if not rows:
        return []

    def tokens(value: float | None) -> str:
        return "?" if value is None else f"{value:.1f}"

    return [
        f"{plural(len(rows), 'rejuvenation')} (restarts at an item boundary, no death):",
        *table(
            ["#", "time", "signs", "restarted", "decode tokens/s baseline > before > after"],
            [
                [
                    str(row["rejuvenation"] or "?"),
                    str(row["time"] or "?")[:19].replace("T", " "),
                    ", ".join(row["signs"]),
                    "yes" if row["recovered"] else "NO",
                    f"{tokens(row['decode_baseline'])} > {tokens(row['decode_before'])} > "
                    f"{tokens(row['decode_after'])}",
                ]
                for row in rows
            ],
        ),
        "",
    ]


ITEMS_SHOWN = 10  # items in the text's table of tokens per item (the costliest); --json: all


def throughput_line(throughput: Throughput) -> str:
    """Items per hour and tokens per item, in one line (the report's summary has it too)."""
    per_hour = throughput["items_per_hour"]
    line = f"items per hour: {'—' if per_hour is None else f'{per_hour:.1f}'}"
    line += f" ({throughput['items_done']} done in {statistic(throughput['running_seconds'])})"
    if throughput["tokens_per_item"] is None:
        note = throughput["too_little"] or "no item done"
        return f"{line}; tokens per item: — ({note})"
    line += (
        f"; tokens per item: {throughput['tokens_per_item']:,.0f} "
        f"({throughput['prompt_tokens_per_item']:,.0f} prompt, "
        f"{throughput['generated_tokens_per_item']:,.0f} generated; "
        f"{plural(throughput['requests'], 'request')}"
    )
    if throughput["estimated"]:
        line += f"; {throughput['estimated']} iteration(s) without usage: a lower bound"
    return line + ")"


def throughput_lines(throughput: Throughput) -> list[str]:
    lines = [throughput_line(throughput)]
    if not throughput["iterations_with_receipts"]:
        return lines
    rows = sorted(
        throughput["by_item"].items(),
        key=lambda entry: -(entry[1]["prompt_tokens"] + entry[1]["generated_tokens"]),
    )
    lines.append(f"tokens per item (the {min(ITEMS_SHOWN, len(rows))} costliest):")
    lines += table(
        ["prompt", "generated", "requests", "attempts", "outcome", "item"],
        [
            [
                f"{row['prompt_tokens']:,}",
                f"{row['generated_tokens']:,}",
                str(row["requests"]),
                str(row["attempts"]),
                str(row["outcome"]),
                item,
            ]
            for item, row in rows[:ITEMS_SHOWN]
        ],
    )
    return lines


def files_line(files: dict[str, dict[str, int]]) -> str:
    if not files:
        return "no files"
    parts = []
    for path, events in files.items():
        found = ", ".join(plural(n, str(kind)) for kind, n in events.items()) or "nothing"
        parts.append(f"{path} ({found})")
    return "; ".join(parts)


def when(epoch: float | None) -> str:
    if epoch is None:
        return "?"
    return datetime.fromtimestamp(epoch).astimezone().strftime("%Y-%m-%d %H:%M")


def counts(mapping: dict[str, int]) -> str:
    return ", ".join(f"{key} {n}" for key, n in mapping.items())


def share(row: DeathsOnHost) -> str:
    rate = row["deaths_per_iteration"]
    return "no history" if rate is None else f"{rate:.1%}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return columns([header, *rows], indent="  ")


def between_line(between: BetweenDeaths) -> str:
    line = "mean time between deaths: "
    if between["mean_seconds"] is None:
        line += "—"
    else:
        line += (
            f"{statistic(between['mean_seconds'])} (median {statistic(between['median_seconds'])},"
            f" {between['gaps']} gap(s))"
        )
    if between["running_seconds_per_death"] is not None:
        line += (
            f"; 1 death per {statistic(between['running_seconds_per_death'])} of loop time "
            f"({statistic(between['running_seconds'])} in the history)"
        )
    return line + (f" — too little data: {between['too_little']}" if between["too_little"] else "")


def recovery_line(recovery: Recovery) -> str:
    if recovery["p50"] is None:
        line = "recovery: none recovered"
    else:
        line = (
            f"recovery: p50 {statistic(recovery['p50'])}, p95 {statistic(recovery['p95'])}, "
            f"max {statistic(recovery['max'])} ({recovery['recovered']} recovered)"
        )
    if recovery["not_recovered"]:
        line += f"; {recovery['not_recovered']} not recovered: {counts(recovery['reasons'])}"
    return line + (
        f" — too little data: {recovery['too_little']}" if recovery["too_little"] else ""
    )


def prompt_lines(prompt: PromptSize) -> list[str]:
    if not prompt["buckets"]:
        return [f"death rate by prompt size: {prompt['too_little']}"]
    rows = []
    for bucket in prompt["buckets"]:
        if bucket["iterations"] is None:
            rate = "—"
        elif bucket["rate"] is None:
            rate = "no iterations"
        else:
            rate = f"{bucket['rate']:.1%}" + (" (few iterations)" if bucket["few"] else "")
        rows.append(
            [
                f"{bucket['from']:,} – {bucket['to'] - 1:,}",
                "—" if bucket["iterations"] is None else str(bucket["iterations"]),
                str(bucket["deaths"]),
                rate,
            ]
        )
    lines = [
        "death rate by prompt size (chars)",
        *table(["prompt size", "iterations", "deaths", "rate"], rows),
    ]
    found = prompt["cluster"]
    if found:
        lines.append(
            f"deaths cluster above {found['above_chars']:,} chars: "
            f"{plural(found['deaths_above'], 'death')} in "
            f"{plural(found['iterations_above'], 'iteration')} above "
            f"({found['rate_above']:.1%}), {found['deaths_below']} in "
            f"{found['iterations_below']} below ({found['rate_below']:.1%})"
        )
    if prompt["no_cluster"]:
        lines.append(prompt["no_cluster"])
    if prompt["too_little"]:
        lines.append(f"too little data: {prompt['too_little']}")
    return lines


def item_lines(rows: list[ItemDeaths]) -> list[str]:
    """The items the server died with, most deaths first (ITEMS_SHOWN of them)."""
    if not rows:
        return ["by item: no death had an item in hand"]
    shown = [
        [
            str(row["deaths"]),
            str(row["alone"]),
            str(row["attempts"]),
            "?" if row["largest_prompt"] is None else f"{row['largest_prompt']:,}",
            "set aside" if row["set_aside"] else "",
            shorten(row["item"], 60),
        ]
        for row in rows[:ITEMS_SHOWN]
    ]
    header = ["deaths", "alone", "attempts", "prompt", "", "item"]
    return ["deaths by item (alone: the only item in flight)", *table(header, shown)]


def each_death(deaths: list[stats.Death]) -> list[str]:
    shown = deaths[-LAST_DEATHS:]
    title = "each death" if len(shown) == len(deaths) else f"the last {len(shown)} deaths"
    rows = []
    for death in shown:
        row = death_row(death)
        rows.append(
            [
                f"#{row['death']}",
                str(row["time"] or "?")[:19].replace("T", " "),
                row["host"],
                f"iter {row['iteration']}",
                row["phase"],
                f"{row['prompt_chars']} chars" if row["prompt_chars"] is not None else "—",
                recovery_of(row),
                row["signature"],
                shorten(row["item"] or "(no item)", ITEM_WIDTH),
            ]
        )
    header = ["death", "time", "host", "iteration", "phase", "prompt", "recovery", "signature"]
    header.append("item")
    return [title, *table(header, rows)]
