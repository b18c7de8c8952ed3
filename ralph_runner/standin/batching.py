"""How a GPU's decode step lengthens as the batch grows: the stand-in's batching mode.

By default every running sequence gets `--tokens-per-second` whatever the batch, so the server's
total grows without bound with concurrency. A GPU does not: decode at batch 1 reads every weight
from memory for one token, so a few more sequences ride along almost free, until the step becomes
compute-bound and lengthens with each sequence; the total rises, then flattens. `--batch-curve`
makes the stand-in's engine step last `step(batch) / step(1)` times its batch-1 length, so
`--tokens-per-second` stays the speed of one sequence alone and the total follows the curve.

The shipped curve, `h100-llama8b`: vLLM 0.21.0 serving Llama-3.1-8B-Instruct (fp16) on one
H100-80GB-HBM3, median time per output token at concurrency 1, 4, 16, 64: 6.48, 6.59, 10.94,
46.91 ms (InferenceBench's concurrency-sweep recipe, captured 2026-05-16,
https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/). Its total, batch / step: 154,
607, 1,463, 1,364 tokens/s. Interpolated at 8: 6.45x batch 1's total, which an independent sweep
agrees with (vLLM 0.23.0, the same model on an A100 40GB: "a 6.6x gain with almost no latency
cost" at concurrency 8, https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass

# (batch, decode step in ms), measured: see the module's docstring
CURVES: dict[str, tuple[tuple[int, float], ...]] = {
    "h100-llama8b": ((1, 6.48), (4, 6.59), (16, 10.94), (64, 46.91)),
}
DEFAULT_CURVE = "h100-llama8b"
POINT = re.compile(r"^\s*(\d+)\s*:\s*(\d+(?:\.\d*)?)\s*$")


@dataclass(frozen=True)
class BatchCurve:
    """Decode step time by batch size: measured points, linear between them; past the last,
    the last segment's slope goes on (compute-bound: each sequence adds its share), so the total
    flattens; below the first, the first point's step."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        batches = [b for b, _ in self.points]
        if not self.points or batches != sorted(set(batches)) or batches[0] < 1:
            raise ValueError(f"batch sizes must rise from 1 or more: {batches}")
        if any(ms <= 0 for _, ms in self.points):
            raise ValueError("step times must be positive")

    def step(self, batch: int) -> float:
        """The step time at `batch` running sequences, in the points' unit."""
        points = self.points
        if batch <= points[0][0] or len(points) == 1:
            return points[0][1]
        index = min(bisect_right([b for b, _ in points], batch), len(points) - 1)
        (b0, s0), (b1, s1) = points[index - 1], points[index]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    def stretch(self, batch: int) -> float:
        """How many times longer a step of `batch` sequences lasts than one of a single one."""
        return self.step(max(batch, 1)) / self.step(1)

    def total(self, batch: int) -> float:
        """The server's total tokens/s at `batch`, as a multiple of one sequence alone."""
        return batch / self.stretch(batch)


def parse_curve(text: str) -> BatchCurve:
    """A shipped curve's name (CURVES) or `BATCH:MS,BATCH:MS,...`; ValueError says what is wrong."""
    if text in CURVES:
        return BatchCurve(CURVES[text])
    points = []
    for part in text.split(","):
        match = POINT.match(part)
        if not match:
            known = ", ".join(CURVES)
            raise ValueError(f"batch curve {text!r}: not {known} nor BATCH:MS,... ({part!r})")
        points.append((int(match[1]), float(match[2])))
    return BatchCurve(tuple(points))
