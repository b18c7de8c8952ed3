"""The fleet's events: its hosts, their lines, its summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ralph_runner.events.base import Event

# -- the fleet -------------------------------------------------------------------------------------


class HostRow(TypedDict):
    """One host's line at the fleet's end."""

    host: str
    done: int | None
    todo: int | None
    skipped: int | None
    deaths: int
    exit_code: int | None


@dataclass(frozen=True, kw_only=True)
class Fleet(Event):
    NAME = "fleet"
    hosts: list[str]
    forks: int


@dataclass(frozen=True, kw_only=True)
class HostDone(Event):
    NAME = "host-done"
    host: str | None
    exit_code: int | None


@dataclass(frozen=True, kw_only=True)
class HostSays(Event):
    """A host's line that is no event (an error on its stderr)."""

    NAME = "host-says"
    host: str | None
    text: str


@dataclass(frozen=True, kw_only=True)
class FleetSummary(Event):
    NAME = "fleet-summary"
    hosts: list[HostRow]
    exit_code: int
