"""CHECKLIST.md items: parse, pick the next todo, tick or skip -- byte-preserving.

The checklist belongs to the operator and the agent; ralph-run only ever flips one marker
character. Everything else (CRLF line endings, a missing final newline, indentation, Korean text)
comes back byte for byte, so a skip never shows up in `git diff` as more than that one character.
Only "\\n" ends a line (as for grep and `wc -l`); a "\\r" before it belongs to the line ending.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError, Problem

TODO, DONE, SKIPPED = " ", "x", "!"

# The grammar is GitHub's task lists (docs/writing-runbooks.md, "The checklist"): any
# indentation, a bullet ("-", "*", "+") or an ordered marker ("1." or "1)"), a blank, a one-
# character marker in brackets ("[ ]" todo, "[x]"/"[X]" done, our "[!]" skipped), then a blank
# and the item's text, which must not be empty. Nothing inside a fenced code block (``` or ~~~)
# counts. "- [x]foo" is not a task item on GitHub either.
_ITEM = re.compile(
    r"\ufeff?[ \t]*(?:[-*+]|[0-9]{1,9}[.)])[ \t]+\[(?P<mark>[ xX!])\]"
    r"(?P<text>[ \t][ \t\r]*[^ \t\r].*)"
)
# What a reader takes for an item but the grammar does not: a bullet glued to its box ("-[ ]"),
# an unknown marker ("- [?]"), an empty box ("- []"), a box with no text or glued to it, or a
# box with no bullet at all ("[ ] text"). Warned about, never worked on.
_LOOKS_LIKE_ITEM = re.compile(
    r"\ufeff?[ \t]*(?:(?:[-*+]|[0-9]{1,9}[.)])[ \t]*\[[^\]]?\]|\[[ xX!]?\][ \t]).*"
)
# A fence opens with three or more backticks or tildes (a backtick fence's info string has no
# backtick) and closes with a line of at least as many of the same character and nothing else.
_FENCE = re.compile(r"\ufeff?[ \t]*(?P<fence>`{3,}(?=[^`]*$)|~{3,}).*")


@dataclass(frozen=True)
class Item:
    """One checklist item as it stood when the text was parsed."""

    text: str  # the item's text after the marker, stripped
    line: int  # 1-based line number
    index: int  # 0-based index among all items
    mark: str  # TODO, DONE or SKIPPED


@dataclass(frozen=True)
class Counts:
    """The checklist's progress and size, as the seed's death log reported it."""

    done: int
    todo: int
    skipped: int
    chars: int
    lines: int  # newline characters, like `wc -l`

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def parse(text: str) -> list[Item]:
    items: list[Item] = []
    for number, _, match in _item_lines(text):
        items.append(Item(_item_text(match), number, len(items), _normal_mark(match)))
    return items


def counts(text: str) -> Counts:
    marks = [item.mark for item in parse(text)]
    return Counts(
        done=marks.count(DONE),
        todo=marks.count(TODO),
        skipped=marks.count(SKIPPED),
        chars=len(text),
        lines=text.count("\n"),
    )


def next_todo(text: str) -> Item | None:
    """The first unchecked item in file order, or None when the checklist is finished."""
    return next((item for item in parse(text) if item.mark == TODO), None)


def find(text: str, item_text: str) -> Item | None:
    """The first item whose text is `item_text`: where an item is now, after the agent edited."""
    return next((item for item in parse(text) if item.text == item_text), None)


def mark(text: str, item: Item, new_mark: str) -> str:
    """`text` with only `item`'s marker replaced by `new_mark`.

    FatalError if `item.line` no longer holds an item with `item.text` (the file changed since
    it was parsed): re-parse and `find` the item instead of flipping a stranger's marker.
    The marker the item has now is not checked: the caller decides from a fresh parse.
    """
    if new_mark not in (TODO, DONE, SKIPPED):
        raise ValueError(f"not a checklist mark: {new_mark!r}")
    for number, start, match in _item_lines(text):
        if number == item.line and _item_text(match) == item.text:
            at = start + match.start("mark")
            return text[:at] + new_mark + text[at + 1 :]
    raise FatalError(
        Problem(f"line {item.line} no longer holds the item {item.text!r}", line=item.line)
    )


def present(path: Path) -> bool:
    """A checklist file is there; a path the system refuses (a name too long) is not."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def read(path: Path) -> str:
    """The file's text exactly as stored (no newline translation)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FatalError(Problem(f"cannot read the checklist: {e.strerror}", str(path))) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise FatalError(
            Problem("the checklist is not valid UTF-8", str(path), line, column)
        ) from None


def write(path: Path, text: str) -> None:
    """Replace the file atomically with `text`, byte for byte."""
    write_atomic(Path(path), text.encode("utf-8"))


def near_misses(text: str) -> list[int]:
    """1-based numbers of the lines that look like items but are not (see _LOOKS_LIKE_ITEM),
    outside fenced code blocks: the loop warns about them once a run."""
    return [number for number, _, line in _lines(text) if _near_miss(line)]


def near_miss_warning(text: str) -> str | None:
    """The run's one warning about near misses, naming their line numbers; None if none."""
    numbers = near_misses(text)
    if not numbers:
        return None
    shown = ", ".join(str(n) for n in numbers[:20]) + (" ..." if len(numbers) > 20 else "")
    return (
        f"the checklist's line{'s' if len(numbers) > 1 else ''} {shown} look"
        f"{'' if len(numbers) > 1 else 's'} like an item but {'are' if len(numbers) > 1 else 'is'}"
        " not one, so ralph-run will not work on "
        f"{'them' if len(numbers) > 1 else 'it'}: write '- [ ] text' ('- [x]' done, '- [!]'"
        " skipped) with a blank after the bullet and some text"
    )


def _near_miss(line: str) -> bool:
    return _ITEM.fullmatch(line) is None and _LOOKS_LIKE_ITEM.fullmatch(line) is not None


def _item_lines(text: str) -> Iterator[tuple[int, int, re.Match[str]]]:
    """(1-based line number, offset of the line in `text`, match) for each item line."""
    for number, start, line in _lines(text):
        match = _ITEM.fullmatch(line)
        if match:
            yield number, start, match


def _lines(text: str) -> Iterator[tuple[int, int, str]]:
    """(1-based line number, offset, line) for each line outside fenced code blocks."""
    start = 0
    fence = ""  # the open fence's characters, or "" outside a fence
    for number, line in enumerate(text.split("\n"), 1):
        opened = _FENCE.fullmatch(line.rstrip("\r"))
        if fence:
            run = opened["fence"] if opened else ""
            bare = line.rstrip("\r").strip(" \t\ufeff") == run  # nothing after a closing fence
            if bare and run[:1] == fence[0] and len(run) >= len(fence):
                fence = ""
        elif opened:
            fence = opened["fence"]
        else:
            yield number, start, line
        start += len(line) + 1


def _item_text(match: re.Match[str]) -> str:
    return (match["text"] or "").strip()


def _normal_mark(match: re.Match[str]) -> str:
    return match["mark"].lower()
