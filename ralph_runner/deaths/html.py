"""`ralph-run report`: a night of deaths as one self-contained HTML page a person looks at.

Charts are Bokeh's, with BokehJS inlined (core component only: 1.3 MB, no widgets, no CDN), so
the file opens offline. Tables are plain HTML (the same answers as `ralph-run deaths`), so they
read without JavaScript and the browser test can find every death and its signature in the DOM.
Bounded for big nights: every iteration and death is drawn (10,000 iterations cost ~0.3 MB as
binary columns), but the recorder's metrics before a death are overlaid for the last
MAX_OVERLAY deaths only, and log excerpts are shown for the last MAX_EXCERPTS deaths.
"""

from __future__ import annotations

import math
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import jinja2
from markupsafe import Markup

from ralph_runner.deaths import stats
from ralph_runner.deaths import text as deaths_text
from ralph_runner.deaths.answers import Answers, PromptSize, SignatureRow
from ralph_runner.durable.files import replace_own_file
from ralph_runner.durable.json_value import JSON, JSONObject
from ralph_runner.output import durations
from ralph_runner.output.text import shorten

if TYPE_CHECKING:  # Bokeh is imported where a chart is drawn: 0.5 s, not for `deaths`
    from bokeh.model import Model
    from bokeh.models import Column
    from bokeh.plotting import figure

MAX_OVERLAY = 50  # deaths whose recorder samples are overlaid
MAX_EXCERPTS = 20  # deaths whose last log lines are shown
EXCERPT_LINES = 30
MAX_SIGNATURES = 15  # bars in the by-signature chart; the table lists them all
OUTCOME_COLOURS = {
    "done": "#2ca02c",
    "strike": "#ff7f0e",
    "skipped": "#d62728",
    "death": "#6a3d9a",
    "limited": "#e6ab02",  # a usage limit waited out: no strike
    "conflict": "#1f77b4",  # workers: its landing conflicted, retried on the new head
    "deferred": "#aec7e8",  # workers: failed while an earlier item was unsettled, no strike
    "paused": "#66c2a5",  # `pause --now` ended the iteration: no outcome counted
    "gave-up": "#000000",
    "interrupted": "#7f7f7f",
    "failed": "#7f7f7f",
    "unknown": "#bbbbbb",
}
PALETTE = [
    *("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"),
    *("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"),
]
WIDTH = 1100
ITEM_CHARS = 60  # of an item's text in the timeline's hover
LEGEND_CHARS = 70  # of a signature in a chart's legend


class Excerpt(TypedDict):
    """The last log lines the recorder had at a death (the page's excerpts)."""

    death: int | None
    signature: str
    source: JSON  # the followed log's name
    lines: list[str]
    notes: list[str]  # the recorder's notes (a log it could not follow, ...)


class Overlay(TypedDict):
    """One death's samples of one metric: seconds before the death, and the values."""

    death: stats.Death
    xs: list[float]
    ys: list[float]


def write(data: stats.Data, output: Path) -> Answers:
    """Write the report; the answers it shows (for the caller's summary line)."""
    answers = stats.tables(data)
    page = render(data, answers)
    output.parent.mkdir(parents=True, exist_ok=True)
    replace_own_file(output, page.encode("utf-8"))  # never through a link a repository planted
    return answers


def render(data: stats.Data, answers: Answers) -> str:
    from bokeh.embed import components
    from bokeh.resources import Resources

    signature_colour = signature_colours(answers)
    drawn: dict[str, Model | None] = {
        "timeline": timeline(data, signature_colour),
        "signatures": signatures_chart(answers["by_signature"], signature_colour),
        "prompt": prompt_chart(answers["prompt_size"]),
        **{
            f"metric {n}": fig for n, fig in enumerate(metric_charts(data.deaths, signature_colour))
        },
    }
    charts = {name: chart for name, chart in drawn.items() if chart is not None}
    script, made = components(charts) if charts else ("", {})
    # a chart with nothing to show is not made (no deaths: no signatures chart); the page then
    # leaves its place empty, as StrictUndefined would not let it test a missing name
    divs = {"timeline": "", "signatures": "", "prompt": "", **made}
    bokeh_js = Resources(mode="inline", components=["bokeh"]).render_js() if charts else ""
    template = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template.filters.update(when=deaths_text.when, duration=durations.statistic, pct=_pct)
    source = resources.files("ralph_runner").joinpath("templates/report.html.j2")
    return template.from_string(source.read_text("utf-8")).render(
        answers=answers,
        skipped=data.skipped.text(),
        files=deaths_text.files_line(answers["files"]),
        summary=summary_lines(answers),
        divs=divs,
        metric_divs=[divs[name] for name in divs if name.startswith("metric ")],
        bokeh_js=Markup(bokeh_js),
        bokeh_script=Markup(script),
        deaths=[deaths_text.death_row(d) for d in data.deaths],
        colour=signature_colour,
        excerpts=excerpts(data.deaths),
        generated=datetime.now().astimezone().isoformat(timespec="seconds"),
    )


def signature_colours(answers: Answers) -> dict[str, str]:
    """Each signature's colour, the most frequent first: the signature table's swatches and
    every chart's marks and lines (one colour per signature, never per death)."""
    return {
        row["signature"]: PALETTE[i] if i < len(PALETTE) else "#999999"
        for i, row in enumerate(answers["by_signature"])
    }


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def summary_lines(answers: Answers) -> list[str]:
    prompt = answers["prompt_size"]
    lines = [
        deaths_text.between_line(answers["between_deaths"]),
        deaths_text.recovery_line(answers["recovery"]),
        deaths_text.throughput_line(answers["throughput"]),
    ]
    lines += [line for line in deaths_text.prompt_lines(prompt) if not line.startswith("  ")][1:]
    return lines


def _ms(epoch: float | None) -> float:
    return math.nan if epoch is None else epoch * 1000.0


def timeline(data: stats.Data, colour: dict[str, str]) -> Column | None:
    """Iterations (prompt size and duration over time, by outcome), deaths, recovery spans."""
    import numpy as np
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure
    from bokeh.transform import factor_cmap

    if not data.iterations and not data.deaths:
        return None
    its = data.iterations
    outcome = [_outcome(i.get("outcome")) for i in its]
    iterations = ColumnDataSource(
        {
            "t": np.array([_ms(stats.epoch(i.get("started"))) for i in its], dtype=float),
            "chars": np.array([_num(i.get("prompt_chars")) for i in its], dtype=np.float32),
            "seconds": np.array([_num(i.get("seconds")) for i in its], dtype=np.float32),
            "iteration": np.array([_num(i.get("iteration")) for i in its], dtype=np.float32),
            "outcome": outcome,
            "item": [shorten(str(i.get("item") or ""), ITEM_CHARS) for i in its],
            "host": [str(i.get("host") or "") for i in its],
            "worker": [str(i.get("worker") or "-") for i in its],  # loop.workers > 1: whose
        }
    )
    outcomes = sorted(set(outcome), key=list(OUTCOME_COLOURS).index)
    by_outcome = factor_cmap("outcome", [OUTCOME_COLOURS[o] for o in outcomes], outcomes)
    deaths = [d for d in data.deaths if d.time is not None]
    top = max([_num(i.get("prompt_chars")) for i in its] + [d.prompt_chars or 0 for d in deaths])
    top = top if math.isfinite(top) and top > 0 else 1.0
    rows = [deaths_text.death_row(d) for d in deaths]
    death_source = ColumnDataSource(
        {
            "t": np.array([_ms(d.time) for d in deaths], dtype=float),
            "end": np.array(
                [
                    _ms(d.time) + 1000.0 * float(r["recovery_seconds"] or 0)
                    for d, r in zip(deaths, rows, strict=True)
                ],
                dtype=float,
            ),
            "chars": np.array([d.prompt_chars or 0 for d in deaths], dtype=np.float32),
            "top": np.full(len(deaths), top * 1.05, dtype=np.float32),
            "death": [str(r["death"]) for r in rows],
            "signature": [r["signature"] for r in rows],
            "phase": [r["phase"] for r in rows],
            "host": [r["host"] for r in rows],
            "recovery": [deaths_text.recovery_of(r) for r in rows],
            "colour": [colour.get(r["signature"], "#999999") for r in rows],
            "legend": [f"✕ {shorten(r['signature'], LEGEND_CHARS)}" for r in rows],
        }
    )
    prompt = figure(
        title="Iterations: prompt size over time (deaths ✕, recovery spans shaded)",
        x_axis_type="datetime",
        width=WIDTH,
        height=320,
        y_axis_label="prompt (chars)",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        output_backend="webgl" if len(its) > 5000 else "canvas",
    )
    prompt.quad(
        left="t",
        right="end",
        bottom=0,
        top="top",
        source=death_source,
        fill_color="#d62728",
        fill_alpha=0.12,
        line_alpha=0,
    )
    dots = prompt.scatter(
        "t",
        "chars",
        source=iterations,
        color=by_outcome,
        size=4,
        alpha=0.7,
        legend_field="outcome",
    )
    marks = prompt.scatter(
        "t",
        "chars",
        source=death_source,
        marker="x",
        size=12,
        line_width=2,
        color="colour",
        legend_field="legend",  # the signature's colour, as in the signature table
    )
    prompt.add_tools(
        HoverTool(
            renderers=[dots],
            tooltips=[
                ("iteration", "@iteration{0}"),
                ("item", "@item"),
                ("prompt", "@chars{0,0}"),
                ("seconds", "@seconds{0.0}"),
                ("outcome", "@outcome"),
                ("host", "@host"),
                ("worker", "@worker"),
            ],
        ),
        HoverTool(
            renderers=[marks],
            tooltips=[
                ("death", "#@death"),
                ("signature", "@signature"),
                ("phase", "@phase"),
                ("host", "@host"),
                ("recovery", "@recovery"),
            ],
        ),
    )
    prompt.legend.location = "top_left"
    prompt.legend.click_policy = "hide"
    duration = figure(
        title="Iterations: duration",
        x_axis_type="datetime",
        x_range=prompt.x_range,
        width=WIDTH,
        height=200,
        y_axis_label="seconds",
        tools="xpan,xwheel_zoom,box_zoom,reset",
        output_backend=prompt.output_backend,
    )
    duration.scatter("t", "seconds", source=iterations, color=by_outcome, size=3, alpha=0.7)
    return column(prompt, duration)


def _outcome(value: JSON) -> str:
    return value if isinstance(value, str) and value in OUTCOME_COLOURS else "unknown"


def _num(value: JSON) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    )


def signatures_chart(rows: list[SignatureRow], colour: dict[str, str]) -> figure | None:
    from bokeh.models import ColumnDataSource, DataRange1d, FactorRange
    from bokeh.plotting import figure

    if not rows:
        return None
    shown = rows[:MAX_SIGNATURES][::-1]
    labels = [shorten(r["signature"], 70) for r in shown]
    source = ColumnDataSource(
        {
            "label": labels,
            "deaths": [r["deaths"] for r in shown],
            "colour": [colour[r["signature"]] for r in shown],
            "signature": [r["signature"] for r in shown],
        }
    )
    chart = figure(
        title="Deaths by signature",
        y_range=FactorRange(factors=labels),  # what figure() makes of a list of labels
        width=WIDTH,
        height=60 + 28 * len(shown),
        tools="save",
        tooltips=[("signature", "@signature"), ("deaths", "@deaths")],
    )
    chart.hbar(y="label", right="deaths", height=0.7, color="colour", source=source)
    x_range = chart.x_range
    assert isinstance(x_range, DataRange1d)  # figure()'s default
    x_range.start = 0
    return chart


def prompt_chart(prompt: PromptSize) -> figure | None:
    from bokeh.models import ColumnDataSource, DataRange1d
    from bokeh.plotting import figure

    buckets, width = prompt["buckets"], prompt["width"]
    if not buckets or width is None:  # the width comes with the buckets
        return None
    rated = buckets[0]["iterations"] is not None
    source = ColumnDataSource(
        {
            "x": [(b["from"] + b["to"]) / 2 for b in buckets],
            "y": [(b["rate"] or 0.0) if rated else b["deaths"] for b in buckets],
            "range": [f"{b['from']:,} – {b['to'] - 1:,}" for b in buckets],
            "iterations": [b["iterations"] if rated else 0 for b in buckets],
            "deaths": [b["deaths"] for b in buckets],
            "colour": ["#cccccc" if b["few"] else "#d62728" for b in buckets],
        }
    )
    chart = figure(
        title="Death rate by prompt size (grey: fewer than "
        f"{stats.MIN_BUCKET} iterations in the bucket)"
        if rated
        else "Deaths by prompt size (no iteration history: no rate)",
        width=WIDTH,
        height=260,
        x_axis_label="prompt (chars)",
        y_axis_label="deaths per iteration" if rated else "deaths",
        tools="save",
        tooltips=[
            ("prompt", "@range"),
            ("iterations", "@iterations"),
            ("deaths", "@deaths"),
            ("rate" if rated else "deaths", "@y{0.0%}" if rated else "@y"),
        ],
    )
    chart.vbar(x="x", top="y", width=width * 0.9, color="colour", source=source)
    y_range = chart.y_range
    assert isinstance(y_range, DataRange1d)  # figure()'s default
    y_range.start = 0
    return chart


def metric_series(deaths: list[stats.Death]) -> dict[str, list[Overlay]]:
    """metric -> one line per death, for the last MAX_OVERLAY deaths; a sample without the
    metric (the server did not answer) is a gap in the line, not a bridge."""
    series: dict[str, list[Overlay]] = {}
    for death in deaths[-MAX_OVERLAY:]:
        section = death.record.get("recorder")
        if not isinstance(section, dict) or death.time is None:
            continue
        rows = [
            (t - death.time, sample_values(sample))
            for sample in _objects(section.get("samples"))
            if isinstance(t := sample.get("t"), int | float)
        ]
        for name in sorted({name for _, values in rows for name in values}):
            xs = [round(x, 1) for x, _ in rows]
            ys = [values.get(name, math.nan) for _, values in rows]
            series.setdefault(name, []).append({"death": death, "xs": xs, "ys": ys})
    return series


def _objects(value: JSON) -> list[JSONObject]:
    """The objects of a JSON list (a recorder section's samples, a sample's GPUs)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def sample_values(sample: JSONObject) -> dict[str, float]:
    """A recorder sample's metrics and each GPU's memory, by name."""
    metrics = sample.get("metrics")
    values = {
        k: float(v)
        for k, v in (metrics.items() if isinstance(metrics, dict) else [])
        if isinstance(v, int | float)
    }
    for gpu in _objects(sample.get("gpu")):
        if isinstance(used := gpu.get("memory_used_mib"), int | float):
            values[f"GPU {gpu.get('index')} memory used (MiB)"] = float(used)
    return values


def metric_charts(deaths: list[stats.Death], colour: dict[str, str]) -> list[figure]:
    """One chart per recorder metric: each death's samples, 0 = the moment of death, in its
    signature's colour (the signature table's), with a legend of the signatures."""
    import numpy as np
    from bokeh.models import ColumnDataSource
    from bokeh.plotting import figure

    charts = []
    for name, lines in sorted(metric_series(deaths).items()):
        deaths_drawn = [line["death"] for line in lines]
        source = ColumnDataSource(
            {
                "xs": [np.array(line["xs"], dtype=np.float32) for line in lines],
                "ys": [np.array(line["ys"], dtype=np.float32) for line in lines],
                "death": [str(d.number) for d in deaths_drawn],
                "signature": [d.signature for d in deaths_drawn],
                "colour": [colour.get(d.signature, "#999999") for d in deaths_drawn],
                "legend": [shorten(d.signature, LEGEND_CHARS) for d in deaths_drawn],
            }
        )
        chart = figure(
            title=f"{name} in the minutes before each death (0 = the death)",
            width=WIDTH // 2 - 10,
            height=240,
            x_axis_label="seconds before the death",
            tools="pan,wheel_zoom,box_zoom,reset,save",
            tooltips=[("death", "#@death"), ("signature", "@signature"), ("value", "$y")],
        )
        chart.multi_line(
            "xs",
            "ys",
            source=source,
            color="colour",
            line_width=1.5,
            alpha=0.7,
            legend_field="legend",
        )
        chart.legend.location = "top_left"
        chart.legend.label_text_font_size = "9px"
        chart.legend.click_policy = "hide"
        charts.append(chart)
    return charts


def excerpts(deaths: list[stats.Death]) -> list[Excerpt]:
    """The last log lines the recorder had at each of the last deaths."""
    found: list[Excerpt] = []
    for death in deaths[-MAX_EXCERPTS:]:
        section = death.record.get("recorder")
        if not isinstance(section, dict):
            continue
        log = _lists(section.get("log"))
        lines = [str(entry[-1]) for entry in log[-EXCERPT_LINES:]]
        found.append(
            {
                "death": death.number,
                "signature": death.signature,
                "source": section.get("log_source"),
                "lines": lines,
                "notes": [str(n[-1]) for n in _lists(section.get("notes"))],
            }
        )
    return found[::-1]


def _lists(value: JSON) -> list[list[JSON]]:
    """The lists of a JSON list (a recorder section's log lines and notes: [time, text])."""
    return [v for v in value if isinstance(v, list)] if isinstance(value, list) else []
