"""Deaths an item causes: which item, if any, a death is the item's (docs: deaths).

A death is the server's fault, never the item's: the item is retried with no strike. That is
right for a server that dies on its own, and wrong for an item whose prompt kills the server
every time it is sent (the seed's KV-cache assertion on a prompt over ~12,000 characters). The
rule that tells them apart:

- An item is *in flight* at a death when its attempt had sent its prompt: its first process
  step (the agent) had started, and the attempt had not ended.
- A death with exactly one item in flight counts against it. At `checklist.set_aside_after`
  deaths in a row (default 2) it is the cause: set aside (`- [!]`), and the run goes on.
- A death with no item in flight (at the run's start, at a pause's resume, between attempts,
  before an agent step began) is the server's own: every count starts again. So does a death
  while the item was not in flight: its deaths are no longer *in a row*.
- A death with several items in flight (`loop.workers` > 1) blames none of them alone: each
  becomes a *suspect*, and suspects run one at a time, nothing else beside them, until each has
  either ended with no death (cleared) or been set aside. The culprit is found in at most
  `set_aside_after` further deaths, not by killing every worker again.
- An attempt that ends with no death clears its item (count and suspicion).

Hangs and exits count alike (a prompt can wedge an engine as well as kill it); the signature
is not compared: the same prompt can end an engine in more than one way. What this cannot see:
a death that needs two items together (each alone survives), and a prompt that kills only a
server already weakened (its deaths come with other items too, so its count starts again).
"""

from __future__ import annotations

from dataclasses import dataclass

from ralph_runner.deaths.record import Blame as Blamed


@dataclass
class Blame:
    """The counts and suspects of one workdir (kept in the run's state across runs) and the
    rule above. `after`: `checklist.set_aside_after` (0: never set anything aside)."""

    after: int
    counts: dict[str, int]  # item text -> deaths in a row with it alone in flight
    suspects: list[str]  # items in flight together at a death, each to run alone
    this_run: int = 0  # items this run set aside (the summary's)

    def death(self, in_flight: list[str]) -> Blamed | None:
        """A death, with the items in flight; what its record says of them (None: no item)."""
        for item in [i for i in self.counts if i not in in_flight]:
            del self.counts[item]  # a death without it: its deaths are not in a row any more
        if not in_flight:
            return None
        if len(in_flight) > 1:
            self.suspects.extend(i for i in in_flight if i not in self.suspects)
            return {"in_flight": list(in_flight), "item": None, "deaths": 0, "set_aside": False}
        (item,) = in_flight
        deaths = self.counts[item] = self.counts.get(item, 0) + 1
        guilty = bool(self.after) and deaths >= self.after
        return {"in_flight": [item], "item": item, "deaths": deaths, "set_aside": guilty}

    def guilty(self, item: str) -> bool:
        """Is `item` the cause of its deaths (set it aside now)?"""
        return bool(self.after) and self.counts.get(item, 0) >= self.after

    def deaths_of(self, item: str) -> int:
        """The deaths in a row `item` was in flight alone at: its templates' `item.deaths`."""
        return self.counts.get(item, 0)

    def set_aside(self, item: str) -> None:
        """It was set aside: counted for the summary, and no longer counted or suspected."""
        self.this_run += 1
        self.cleared(item)

    def cleared(self, item: str) -> None:
        """Its attempt ended with no death, or it was set aside: no count, no suspicion."""
        self.counts.pop(item, None)
        if item in self.suspects:
            self.suspects.remove(item)
