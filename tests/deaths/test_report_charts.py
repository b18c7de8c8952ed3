"""The report's charts agree with its tables (issue 31, item 5): each death is drawn in its
signature's colour (the signature table's swatch), with a legend; `paused` iterations have a
label of their own; the prompt-size table lists only buckets that hold something."""

from __future__ import annotations

import re
from datetime import datetime
from html import unescape
from typing import Any

import pytest

from ralph_runner.deaths import html, stats
from ralph_runner.output.text import shorten

START = 1_800_000_000.0
HANG = "probe can generate: timeout"
KV = "AssertionError: num_required_blocks <num> < len(req_blocks) <num>"


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def death(number: int, signature: str, at: float, chars: int) -> stats.Death:
    """A death record with recorder samples (the flight recorder's charts draw those)."""
    samples = [
        {"t": at - back, "metrics": {"vllm:num_requests_running": float(number + back)}}
        for back in (30, 20, 10)
    ]
    record = {
        "event": "death",
        "death": number,
        "time": iso(at),
        "host": "gpu-a",
        "phase": "during-step",
        "prompt_size": chars,
        "signature": signature,
        "recorder": {"samples": samples, "log": [], "notes": []},
    }
    return stats.Death(record, "deaths.jsonl")  # type: ignore[arg-type]


def iteration(number: int, outcome: str, chars: int) -> dict:
    return {
        "event": "iteration",
        "started": START + 60 * number,
        "host": "gpu-a",
        "iteration": number,
        "item": f"item {number}",
        "prompt_chars": chars,
        "seconds": 50.0,
        "outcome": outcome,
        "deaths": [],
    }


def night() -> stats.Data:
    """Death #1 is the rarer signature (a hang); the KV assertion kills twice after it. So the
    signature table (most frequent first) gives #1 the second colour, where a colour by death
    index gives it the first."""
    return stats.Data(
        deaths=[
            death(1, HANG, START + 100, 1_000),
            death(2, KV, START + 200, 9_800),
            death(3, KV, START + 300, 9_900),
        ],
        iterations=[
            iteration(1, "done", 1_000),
            iteration(2, "paused", 1_200),
            iteration(3, "death", 9_800),
            iteration(4, "death", 9_900),
        ],
    )


def swatches(page: str) -> dict[str, str]:
    """signature -> its swatch colour, from the page's signature table."""
    table = page.split('<table id="signatures">', 1)[1].split("</table>", 1)[0]
    found = re.findall(
        r'<span class="swatch" style="background: (#[0-9a-f]{6})"></span>'
        r'<code class="signature">([^<]*)</code>',
        table,
    )
    return {unescape(signature): colour for colour, signature in found}


def rendered(data: stats.Data, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """The page `ralph-run report` writes, and the Bokeh charts it embeds (by name)."""
    import bokeh.embed

    embed = bokeh.embed.components
    charts: dict[str, Any] = {}

    def components(models: dict[str, Any]) -> Any:
        charts.update(models)
        return embed(models)

    monkeypatch.setattr(bokeh.embed, "components", components)
    return html.render(data, stats.tables(data)), charts


def test_each_death_has_its_signatures_colour_in_the_charts_with_a_legend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page, charts = rendered(night(), monkeypatch)
    colour = swatches(page)
    assert set(colour) == {HANG, KV} and colour[HANG] != colour[KV]
    each = {"1": colour[HANG], "2": colour[KV], "3": colour[KV]}

    metrics = [chart for name, chart in charts.items() if name.startswith("metric ")]
    assert metrics
    for chart in metrics:
        (lines,) = chart.renderers
        source = lines.data_source.data
        assert dict(zip(source["death"], source["colour"], strict=True)) == each
        (legend,) = chart.legend  # one entry per signature, in its colour
        assert [item.label.field for item in legend.items] == ["legend"]
        assert sorted(set(source["legend"])) == sorted(
            shorten(s, html.LEGEND_CHARS) for s in (HANG, KV)
        )

    prompt, _ = charts["timeline"].children
    (mark,) = [r for r in prompt.renderers if getattr(r.glyph, "marker", None) == "x"]
    marks = mark.data_source.data
    assert dict(zip(marks["death"], marks["colour"], strict=True)) == each
    legend_fields = [getattr(item.label, "field", None) for item in prompt.legend[0].items]
    assert "legend" in legend_fields  # the death marks are in the legend, by signature
    assert {f"✕ {shorten(s, html.LEGEND_CHARS)}" for s in (HANG, KV)} == set(marks["legend"])


def test_a_paused_iteration_is_labelled_paused_not_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, charts = rendered(night(), monkeypatch)
    prompt, _ = charts["timeline"].children
    dots = [r for r in prompt.renderers if "outcome" in r.data_source.data]
    assert list(dots[0].data_source.data["outcome"]) == ["done", "paused", "death", "death"]
    cmap = dots[0].glyph.fill_color.transform
    colours = dict(zip(cmap.factors, cmap.palette, strict=True))
    assert "unknown" not in colours
    assert colours["paused"] not in {colours["done"], colours["death"], "#bbbbbb"}


def test_only_prompt_size_buckets_that_hold_something_are_listed() -> None:
    data = night()  # prompts of about 1,000 and 9,800 chars: buckets of 1,000, eight empty
    answers = stats.tables(data)
    buckets = answers["prompt_size"]["buckets"]
    assert [(b["from"], b["iterations"], b["deaths"]) for b in buckets] == [
        (1_000, 2, 1),
        (9_000, 2, 2),
    ]
    page = html.render(data, answers)
    table = page.split('<table id="prompt-size">', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == 1 + 2  # the header and the two buckets
