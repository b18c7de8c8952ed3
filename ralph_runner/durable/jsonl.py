"""Append-only JSON-lines files that outlive a kill -9, and reading them around torn lines.

The iteration history and the flight recorder's segments are written with one `write(2)` per
batch on an O_APPEND descriptor: once it returns, the kernel holds the bytes, so a kill -9 of
ralph-run loses nothing already written. Only a power loss could drop the last ones (no fsync:
these files are context, not evidence; the death records themselves are fsynced, deaths/log.py).
A write cut short by a kill leaves a torn last line: the next writer starts on a fresh line and
readers skip what does not parse, counting it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import orjson  # 3-4x the standard library's speed: a night's records are tens of MB

from ralph_runner.durable.files import open_own_file
from ralph_runner.durable.json_value import JSONObject


def dumps(entry: Mapping[str, object]) -> str:
    """One compact line (no newline inside: JSON escapes it)."""
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":"), default=str)


class Appender:
    """An open O_APPEND file: `write` appends whole lines; `size` is the file's length."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = open_own_file(path, os.O_RDWR | os.O_APPEND)  # 0600: server logs; no link
        self.size = os.fstat(self.fd).st_size
        # a torn last line (a writer killed mid-write) must not fuse with the next entry
        self._fresh_line = bool(self.size) and os.pread(self.fd, 1, self.size - 1) != b"\n"

    def write(self, lines: Iterable[str]) -> int:
        """Append the lines in one write; the number of bytes written."""
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        if self._fresh_line:
            data, self._fresh_line = b"\n" + data, False
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(data)
        return len(data)

    def close(self) -> None:
        os.close(self.fd)


def append(path: Path, entries: Iterable[Mapping[str, object]]) -> None:
    """Open, append `entries` as lines in one write, close (for infrequent writers)."""
    appender = Appender(path)
    try:
        appender.write(dumps(entry) for entry in entries)
    finally:
        appender.close()


class SkippedCounts(TypedDict):
    """What a reader skipped, in a JSON answer (`ralph-run deaths --json`'s "skipped")."""

    total: int
    torn: int
    foreign: int
    at: list[str]


@dataclass
class Skipped:
    """Lines that were read around: torn or not JSON, and JSON that is not what was expected."""

    torn: int = 0
    foreign: int = 0
    where: list[str] = field(default_factory=list)  # the first few, as path:line
    # told of every line skipped, as it is: (path:line, why), for readers that warn at once
    warn: Callable[[str, str], None] | None = None

    KEEP = 5

    @property
    def total(self) -> int:
        return self.torn + self.foreign

    def add(self, kind: str, path: Path | str, number: int, why: str = "") -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.where) < self.KEEP:
            self.where.append(f"{path}:{number} ({kind})")
        if self.warn is not None:
            self.warn(f"{path}:{number}", why)

    def text(self) -> str:
        """'skipped 3 lines (2 torn, 1 foreign: ...)' or '' when none was."""
        if not self.total:
            return ""
        parts = [f"{n} {kind}" for kind, n in (("torn", self.torn), ("foreign", self.foreign)) if n]
        return f"skipped {self.total} line{'s' * (self.total != 1)} ({', '.join(parts)}): " + (
            ", ".join(self.where) + (", ..." if self.total > len(self.where) else "")
        )

    def as_dict(self) -> SkippedCounts:
        return {"total": self.total, "torn": self.torn, "foreign": self.foreign, "at": self.where}


def read(path: Path, skipped: Skipped) -> Iterator[tuple[int, JSONObject]]:
    """(line number, object) for every line that is a JSON object; the rest counted as torn."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            entry = orjson.loads(raw)
        except ValueError as err:  # orjson.JSONDecodeError, invalid UTF-8 included
            skipped.add("torn", path, number, str(err))
            continue
        if isinstance(entry, dict):
            yield number, entry
        else:
            skipped.add("foreign", path, number, str(entry))
