"""Prometheus text read as samples: prometheus_client's parser, the one parser of the product.

The progress probe reads vLLM's /metrics every watch round, and the flight recorder every few
seconds; that page is mostly histogram buckets (hundreds of lines; megabytes on a big server),
and prometheus_client's parser is pure Python, line by line. So the lines of the wanted names
are found first (`str.find`, in C), and only they are parsed: on vLLM's page the whole parse
took 27-31x as long as this (`python -m bench.prometheus_parse`). Each line is parsed on its own,
so that a malformed one costs its own sample only: what a caller does with a page that lacks
its numbers is its own decision (the probe: a "body" failure).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["Sample", "samples"]


def samples(text: str, names: Iterable[str]) -> list[Sample]:
    """The samples of `text` named exactly one of `names`, in the page's order. A name is a
    sample's own: a counter's `vllm:x_total`, a histogram's `vllm:y_count`; `vllm:x` finds
    no `vllm:x_total`, `vllm:x_created` or `vllm:xy`. Lines that do not parse are left out."""
    wanted = set(names)
    found: list[Sample] = []
    for line in lines_of(text, wanted):
        try:
            parsed = [s for family in text_string_to_metric_families(line) for s in family.samples]
        except ValueError:  # prometheus_client's word for any malformed line
            continue
        found += [sample for sample in parsed if sample.name in wanted]
    return found


def lines_of(text: str, names: set[str]) -> Iterator[str]:
    """The lines of `text` that start with one of `names` (a comment never does), each once
    (`vllm:x` also finds the lines of `vllm:x_total`: `samples` keeps the exact names)."""
    starts: set[int] = set()
    for name in names:
        start = 0 if text.startswith(name) else text.find("\n" + name)
        while start != -1:
            begin = start + (text[start] == "\n")
            starts.add(begin)
            start = text.find("\n" + name, begin)
    for begin in sorted(starts):
        end = text.find("\n", begin)
        yield text[begin : end if end != -1 else len(text)]


def sample_names(names: Iterable[str]) -> list[str]:
    """The sample names a name stands for: itself, and `_total` (a counter's family name)."""
    return [one for name in names for one in sample_names_of(name)]


def sample_names_of(name: str) -> list[str]:
    return [name] if name.endswith("_total") else [name, f"{name}_total"]


def sums_of(found: list[Sample], names: Iterable[str]) -> dict[str, float | None]:
    """Each name's samples (`sample_names`) summed over their label sets, NaN left out; None
    for a name /metrics lacks (`name_created` and other suffixes are other samples)."""
    values: dict[str, list[float]] = {}
    for sample in found:
        values.setdefault(sample.name, []).append(sample.value)
    sums: dict[str, float | None] = {}
    for name in names:
        mine = [value for one in sample_names_of(name) for value in values.get(one, [])]
        sums[name] = sum(v for v in mine if not math.isnan(v)) if mine else None
    return sums


def metric_sums(text: str, names: Iterable[str]) -> dict[str, float | None]:
    """Each of `names` summed over its label sets in Prometheus text (as `sums_of`)."""
    names = list(names)
    return sums_of(samples(text, sample_names(names)), names)


def metric_sum(text: str, name: str) -> float | None:
    """The sum of `name`'s samples over all label sets in Prometheus text; None when absent."""
    return metric_sums(text, [name])[name]
