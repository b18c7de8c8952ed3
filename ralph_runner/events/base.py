"""The base of the run's events: `Event`, its --json fields, and `Unknown`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from ralph_runner.durable.json_value import JSON

OMITTED = "omitted"  # a field's metadata: the value for which --json leaves the field out
IF_NONE = {OMITTED: None}  # field(default=None, metadata=IF_NONE): left out while None
IF_FALSE = {OMITTED: False}  # ... a flag said only when it is set
IF_TRUE = {OMITTED: True}  # ... a flag said only when it is not


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing that happened; `kind` is its --json name."""

    NAME: ClassVar[str] = ""
    # the host whose loop said it (a fleet run's); None: this one
    host: str | None = field(default=None, metadata=IF_NONE)

    @property
    def kind(self) -> str:
        return self.NAME

    def json_fields(self) -> dict[str, object]:
        """The fields of its --json line (beside `event` and `time`), in order."""
        found: dict[str, object] = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.name == "host" or (
                OMITTED in spec.metadata and value is spec.metadata[OMITTED]
            ):
                continue
            found[spec.name] = value
        if self.host is not None:
            found["host"] = self.host
        return found


@dataclass(frozen=True, kw_only=True)
class Unknown(Event):
    """An event of a kind this ralph-run does not know (a newer remote's), passed on as is."""

    name: str
    fields: dict[str, JSON]

    @property
    def kind(self) -> str:
        return self.name

    def json_fields(self) -> dict[str, object]:
        return {**self.fields, **({"host": self.host} if self.host is not None else {})}
