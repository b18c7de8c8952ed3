"""One row per case: the samples of each peer, their medians and ratios, as a markdown table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PEERS = ("ours", "seed", "ansible")
HEADER = (
    "| case | ralph-run | seed bash | Ansible | ralph-run / seed | ralph-run / Ansible "
    "| runs | target | met |"
)


@dataclass
class Row:
    """A case's samples: seconds (or MiB when `unit` is "MiB"), lower is better.

    `seed_floor`: the seed's samples are lower bounds (it was killed at a cap, still running).
    """

    case: str
    ours: list[float]
    seed: list[float] = field(default_factory=list)
    ansible: list[float] = field(default_factory=list)
    unit: str = "s"
    seed_floor: bool = False
    target: str = ""
    met: bool | None = None
    notes: list[str] = field(default_factory=list)

    def median(self, peer: str) -> float | None:
        samples = getattr(self, peer)
        return statistics.median(samples) if samples else None

    def ratio(self, peer: str) -> str:
        ours, theirs = self.median("ours"), self.median(peer)
        if ours is None or not theirs:
            return "—"
        ratio = ours / theirs
        bound = "≤ " if peer == "seed" and self.seed_floor else ""
        if self.unit == "MiB":
            return f"{bound}{ratio:.2f}"
        if ratio < 1:
            at_least = "≥ " if bound else ""
            return f"{bound}{ratio:.2g} ({at_least}{factor(1 / ratio)} faster)"
        return f"{ratio:.2f} ({factor(ratio)} slower)"

    def cell(self, peer: str) -> str:
        value = self.median(peer)
        if value is None:
            return "—"
        text = f"{value:.1f} MiB" if self.unit == "MiB" else duration(value)
        return f"≥ {text} (killed)" if peer == "seed" and self.seed_floor else text

    def markdown(self) -> str:
        runs = " / ".join(
            str(len(getattr(self, peer))) if getattr(self, peer) else "—" for peer in PEERS
        )
        met = {True: "yes", False: "**no**", None: "—"}[self.met]
        cells = [self.case, *(self.cell(p) for p in PEERS)]
        cells += [self.ratio("seed"), self.ratio("ansible"), runs, self.target or "—", met]
        return "| " + " | ".join(cells) + " |"


def factor(times: float) -> str:
    """2.7x, 12x, 1440x: as many digits as a reader needs."""
    return f"{times:.2g}x" if times < 10 else f"{times:.0f}x"


def duration(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1000:.2f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def render(title: str, machine: str, rows: list[Row]) -> str:
    """The whole report: title, machine, table, then each row's notes as footnotes."""
    lines = [f"## {title}", "", machine, "", HEADER, "|" + "---|" * 9]
    lines += [row.markdown() for row in rows]
    notes = [(row.case, note) for row in rows for note in row.notes]
    if notes:
        lines.append("")
        lines += [f"- *{case}*: {note}" for case, note in notes]
    return "\n".join(lines)
