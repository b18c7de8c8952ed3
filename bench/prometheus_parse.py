"""`python -m bench.prometheus_parse`: what reading /metrics costs the progress probe, per scrape.

Three ways to take the probe's numbers from a vLLM-sized page (`ralph_runner/plugins/
prometheus_text.py` says why the product takes the second):

- `hand scan`: the hand-written scan the probe had before issue 30 (kept here, for the
  comparison only): `str.find` of each name, the value cut out of the line by hand;
- `filtered`: the product's: the wanted names' lines found with `str.find`, each parsed by
  prometheus_client;
- `whole page`: every line of the page through prometheus_client's parser.

The page: vLLM 0.32's engine series (gauges, counters with `_created`, its histograms with their
buckets) written by prometheus_client itself, for 1 and 8 engines, and the tests' 12 MB page
(tests/liveness/test_progress.py: 200,000 bucket lines).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ralph_runner.plugins import prometheus_text
from ralph_runner.probes import progress

LABELS = ["model_name", "engine"]
SECONDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
SECONDS += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
HISTOGRAMS = {  # vLLM 0.32's histograms and their bucket layouts (22 or 16 buckets each)
    "vllm:time_to_first_token_seconds": SECONDS,
    "vllm:inter_token_latency_seconds": SECONDS,
    "vllm:e2e_request_latency_seconds": SECONDS,
    "vllm:request_queue_time_seconds": SECONDS,
    "vllm:request_inference_time_seconds": SECONDS,
    "vllm:request_prefill_time_seconds": SECONDS,
    "vllm:request_decode_time_seconds": SECONDS,
    "vllm:request_time_per_output_token_seconds": SECONDS,
    "vllm:request_prompt_tokens": TOKENS,
    "vllm:request_generation_tokens": TOKENS,
    "vllm:iteration_tokens_total": TOKENS,
    "vllm:request_max_num_generation_tokens": TOKENS,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_params_max_tokens": TOKENS,
}
NAMES = [*progress.COUNTERS, *progress.ACTIVE, *progress.MOVING, progress.STARTED]


def vllm_page(engines: int) -> str:
    registry = CollectorRegistry()
    gauges = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
    counters = ["num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries"]
    made: list[Gauge | Counter | Histogram] = []
    made += [Gauge(f"vllm:{name}", name, LABELS, registry=registry) for name in gauges]
    made += [Counter(f"vllm:{name}", name, LABELS, registry=registry) for name in counters]
    made += [
        Histogram(name, name, LABELS, buckets=buckets, registry=registry)
        for name, buckets in HISTOGRAMS.items()
    ]
    start = Gauge("process_start_time_seconds", "start", registry=registry)
    start.set(time.time())
    for engine in range(engines):
        for metric in made:
            child = metric.labels(model_name="m", engine=str(engine))
            if isinstance(child, Histogram):
                child.observe(1.5)
            elif isinstance(child, Counter):
                child.inc(1234)
            else:
                child.set(2)
    return generate_latest(registry).decode()


def padded_page() -> str:
    """tests/liveness/engine_helpers.py's /metrics with 200,000 bucket lines (about 12 MB)."""
    head = vllm_page(1)
    buckets = [
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{i / 1000}"}} {i}'
        for i in range(200_000)
    ]
    return head + "\n".join(buckets) + "\n"


def hand_scan(text: str) -> dict[str, float | None]:
    """The probe's scan before issue 30, in short: each name's lines found with str.find, the
    value after the label set (its quotes honoured) or the name."""

    def value_of(line: str, name: str) -> float | None:
        rest = line[len(name) :]
        if rest.startswith("{"):
            quoted = escaped = False
            for index, char in enumerate(rest):
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    quoted = not quoted
                elif char == "}" and not quoted:
                    rest = rest[index + 1 :]
                    break
            else:
                return None
        elif not rest[:1].isspace():
            return None
        fields = rest.split()
        try:
            return float(fields[0]) if fields else None
        except ValueError:
            return None

    def metric_sum(name: str) -> float | None:
        found = []
        for one in [name] if name.endswith("_total") else [name, f"{name}_total"]:
            start = 0 if text.startswith(one) else text.find("\n" + one)
            while start != -1:
                begin = start + (text[start] == "\n")
                end = text.find("\n", begin)
                value = value_of(text[begin : end if end != -1 else len(text)], one)
                if value is not None:
                    found.append(value)
                start = text.find("\n" + one, begin)
        return sum(v for v in found if not math.isnan(v)) if found else None

    return {name: metric_sum(name) for name in NAMES}


def filtered(text: str) -> dict[str, float | None]:
    return prometheus_text.metric_sums(text, NAMES)


def whole_page(text: str) -> dict[str, float | None]:
    sums: dict[str, float | None] = dict.fromkeys(NAMES)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums and not math.isnan(sample.value):
                sums[sample.name] = (sums[sample.name] or 0.0) + sample.value
    return sums


WAYS: dict[str, Callable[[str], dict[str, float | None]]] = {
    "hand scan": hand_scan,
    "filtered": filtered,
    "whole page": whole_page,
}


def median_ms(read: Callable[[str], object], text: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        read(text)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=50, help="reads per way and page")
    args = parser.parse_args()
    pages = {"vLLM, 1 engine": vllm_page(1), "vLLM, 8 engines": vllm_page(8)}
    pages["tests' 12 MB page"] = padded_page()
    print(f"| page | size | {' | '.join(WAYS)} |")
    print(f"|---|---|{'---|' * len(WAYS)}")
    for title, text in pages.items():
        answers = {way: read(text) for way, read in WAYS.items()}
        assert answers["hand scan"] == answers["filtered"], answers  # the same numbers
        runs = max(3, args.runs // 10) if len(text) > 1_000_000 else args.runs
        cells = [f"{median_ms(read, text, runs):.2f} ms" for read in WAYS.values()]
        print(f"| {title} | {len(text) / 1024:,.0f} KiB | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
