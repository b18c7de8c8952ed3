"""YAML files loaded as plain data, with the line and column of every key and item kept.

Input is untrusted (a typo, a fuzzer, a hostile `-e @file`), so loading is bounded: a file
over MAX_BYTES, nesting deeper than MAX_DEPTH, more than MAX_NODES values once every alias is
expanded (a "billion laughs" bomb) or an alias that contains itself is an error at its line,
found before anything is built. libyaml parses when it is installed (as in Ansible), else PyYAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ralph_runner.errors import FatalError, Problem, key_path

Path_ = tuple[str | int, ...]

MAX_BYTES = 1024 * 1024  # a runbook is a few KiB; a 5,000-host inventory about 300 KiB
MAX_DEPTH = 64  # nested mappings and lists, aliases expanded; real files use under 10
MAX_NODES = 250_000  # values once aliases are expanded; a bomb stops here, before building

_EXPLAIN_BYTES = 256 * 1024  # up to this size a libyaml syntax error is explained by PyYAML
_Fast = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class Document:
    """Parsed YAML plus where each node came from, for error messages."""

    data: Any
    file: str
    positions: dict[Path_, tuple[int, int]] = field(default_factory=dict)

    def problem(self, path: Path_, message: str) -> Problem:
        """A Problem at `path`, or at its nearest ancestor that has a position."""
        probe = tuple(path)
        while probe and probe not in self.positions:
            probe = probe[:-1]
        line, column = self.positions.get(probe, (1, 1))
        return Problem(message, self.file, line, column, key_path(tuple(path)))


if TYPE_CHECKING:  # a mixin of a loader: tools see the loader's methods
    _Loader = yaml.SafeLoader
else:
    _Loader = object


class _Bounded(_Loader):
    """Builds plain data from the node graph, recording each node's mark by key path.

    A mixin: the parser it goes with (libyaml's or PyYAML's) comes after it in the bases.
    """

    file = "<text>"
    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """PyYAML's composer recurses: bound it before Python's stack runs out (libyaml
        bounds its own at 1,000 and never calls this)."""
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _bound_error(self.peek_event().start_mark, too_deep())
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def build(self, node: yaml.Node, path: Path_, positions: dict) -> Any:
        positions.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self.key(key_node, path)
                if key in out:
                    raise FatalError(self.at(key_node, path, f"duplicate key {key!r}"))
                child = (*path, key if isinstance(key, str) else str(key))
                positions[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                out[key] = self.build(value_node, child, positions)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i), positions) for i, item in enumerate(node.value)]
        return self.scalar(node, path)

    def key(self, node: yaml.Node, path: Path_) -> Any:
        """A mapping key: a scalar, checked before it is built (an alias key may be a bomb)."""
        key = self.scalar(node, path) if isinstance(node, yaml.ScalarNode) else []
        if not isinstance(key, str | int | float | bool) and key is not None:
            raise FatalError(self.at(node, path, "a mapping key must be a plain scalar"))
        return key

    def at(self, node: yaml.Node, path: Path_, message: str) -> Problem:
        mark = node.start_mark
        return Problem(message, self.file, mark.line + 1, mark.column + 1, key_path(path))

    def scalar(self, node: yaml.Node, path: Path_) -> Any:
        """A scalar's value; a tag its text does not fit (`!!int abc`) is an error at it."""
        try:
            return self.construct_object(node, deep=True)
        except yaml.MarkedYAMLError:
            raise
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:  # the constructors'
            # answer to a tag its text does not fit; anything else is a bug of ours (exit 70)
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise FatalError(self.at(node, path, f"{tag} {node.value!r}: {exc}")) from None


class _Builder(_Bounded, _Fast):  # type: ignore[misc, valid-type]
    """libyaml's parser (fast), our bounded builder."""


class _Explainer(_Bounded, yaml.SafeLoader):
    """PyYAML's parser: its syntax errors say more than libyaml's ("but found '<stream end>'")."""


def too_deep() -> str:
    return f"nested deeper than {MAX_DEPTH} levels (ralph-run's bound; see README)"


def _bound_error(mark: Any, message: str) -> yaml.MarkedYAMLError:
    return yaml.MarkedYAMLError(problem=message, problem_mark=mark)


def _check_graph(root: yaml.Node) -> None:
    """Refuse, before building, a graph whose expanded form is too deep or too big, or cyclic.

    Anchors come before their aliases, so a walk in document order meets each node first as
    itself (sizes are memoised) and the recursion is as deep as the text's own nesting.
    """
    sizes: dict[int, tuple[int, int]] = {}  # id -> (expanded size, expanded height)
    active: set[int] = set()

    def walk(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if depth > MAX_DEPTH:
            raise _bound_error(node.start_mark, too_deep())
        if key in active:
            raise _bound_error(node.start_mark, "recursive alias: this node contains itself")
        if key not in sizes:
            active.add(key)
            children: list[yaml.Node] = []
            if isinstance(node, yaml.MappingNode):
                children = [part for pair in node.value for part in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            size, height = 1, 0
            for child in children:
                child_size, child_height = walk(child, depth + 1)
                size, height = size + child_size, max(height, child_height + 1)
                if size > MAX_NODES:
                    break
            active.discard(key)
            sizes[key] = (size, height)
        size, height = sizes[key]
        if depth + height > MAX_DEPTH:
            raise _bound_error(node.start_mark, too_deep() + ", aliases expanded")
        if size > MAX_NODES:
            message = (
                f"more than {MAX_NODES:,} values once aliases are expanded"
                " (an alias bomb?; ralph-run's bound, see README)"
            )
            raise _bound_error(node.start_mark, message)
        return sizes[key]

    walk(root, 1)


def check_depth(data: Any, file: str) -> None:
    """Hold data parsed some other way (JSON) to the same MAX_DEPTH, without recursing."""
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise FatalError(Problem(f"invalid data: {too_deep()}", file))
        if isinstance(value, dict):
            pending += [(child, depth + 1) for child in value.values()]
        elif isinstance(value, list):
            pending += [(child, depth + 1) for child in value]


def _position(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of a character index."""
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def parse(text: str, file: str) -> Document:
    """Parse YAML text; syntax errors become a FatalError naming file, line and column."""
    if len(text) > MAX_BYTES:
        raise FatalError(Problem(_too_big(len(text)), file))
    builder = None
    try:
        builder = _Builder(text)
        builder.file = file
        try:
            node = builder.get_single_node()
        except yaml.MarkedYAMLError as exc:
            if "maximum nesting depth" in str(exc.problem):  # libyaml's bound, 1,000 levels
                raise _bound_error(exc.problem_mark, too_deep()) from None
            _explain(text, file)  # raises PyYAML's (better) message, if it has one
            raise
        positions: dict[Path_, tuple[int, int]] = {}
        if node is not None:
            _check_graph(node)
        data = None if node is None else builder.build(node, (), positions)
    except yaml.MarkedYAMLError as exc:
        raise FatalError(_syntax_problem(exc, file)) from None
    except yaml.reader.ReaderError as exc:
        line, column = _position(text, exc.position)
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else "a byte"
        message = f"invalid YAML: character {character} is not allowed: {exc.reason}"
        raise FatalError(Problem(message, file, line, column)) from None
    except yaml.YAMLError as exc:
        raise FatalError(Problem(f"invalid YAML: {exc}", file)) from None
    except UnicodeEncodeError as exc:  # a lone surrogate from the command line
        raise FatalError(Problem(f"invalid text: {exc.reason}", file)) from None
    finally:
        if builder is not None:
            builder.dispose()
    return Document(data, file, positions)


def _syntax_problem(exc: yaml.MarkedYAMLError, file: str) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    reason = exc.problem or exc.context or "invalid YAML"
    line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
    began = exc.context_mark.line + 1 if exc.context_mark else None
    return Problem(f"invalid YAML: {_plain_reason(reason, began)}", file, line, column)


def _plain_reason(reason: str, began: int | None) -> str:
    """PyYAML's words for the common mistakes (an indentation, a tab, a missing colon) as a
    sentence that says what to fix; any other reason as PyYAML gives it."""
    block = f" (the block that began at line {began})" if began else ""
    if reason.startswith("expected <block end>"):
        return (
            f"this line is indented differently from the lines before it{block}: keys and"
            " `- ` items of one block must start in the same column"
        )
    if reason == "mapping values are not allowed here":
        return (
            "a `key:` where no key can start: the line is indented deeper than the key"
            " before it, or a value holds ': ' (quote it)"
        )
    if reason == "could not find expected ':'":
        where = f"line {began}" if began else "a line"
        return f"{where} is text inside a mapping, with no `key:`: add the colon, or quote it"
    if "'\\t'" in reason or "\\t" in reason:
        return "a tab in the indentation: YAML indents with spaces only"
    return reason


def _explain(text: str, file: str) -> None:
    """Raise PyYAML's error for text that libyaml refused, when the text is small enough."""
    if _Fast is yaml.SafeLoader or len(text) > _EXPLAIN_BYTES:
        return
    explainer = None
    try:
        explainer = _Explainer(text)
        explainer.get_single_node()
    except yaml.MarkedYAMLError as exc:
        raise FatalError(_syntax_problem(exc, file)) from None
    except yaml.YAMLError:
        return
    finally:
        if explainer is not None:
            explainer.dispose()


def _too_big(size: int) -> str:
    return f"{size:,} bytes is over the {MAX_BYTES:,}-byte bound for a YAML file (see README)"


def read_text(path: str | Path) -> str:
    """A text file read whole, at most MAX_BYTES (`-e @/dev/zero` must not eat the memory)."""
    try:
        with open(path, "rb") as stream:
            raw = stream.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise FatalError(Problem("file not found", str(path))) from None
    except OSError as exc:
        raise FatalError(Problem(f"cannot read: {exc.strerror or exc}", str(path))) from None
    if len(raw) > MAX_BYTES:
        raise FatalError(Problem(_too_big(len(raw)), str(path)))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start].decode("utf-8", "replace")
        line, column = _position(before, len(before))
        message = f"cannot read: not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise FatalError(Problem(message, str(path), line, column)) from None


def load(path: str | Path) -> Document:
    """Read and parse a YAML file; a missing or unreadable file is a FatalError."""
    return parse(read_text(path), str(path))
