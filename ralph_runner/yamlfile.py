"""YAML files loaded as plain data, with the line and column of every key and item kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ralph_runner.errors import FatalError, Problem, key_path

Path_ = tuple[str | int, ...]


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


class _Builder(yaml.SafeLoader):
    """Builds plain data from the node graph, recording each node's mark by key path."""

    def build(self, node: yaml.Node, path: Path_, positions: dict) -> Any:
        positions.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, str | int | float | bool) and key is not None:
                    raise FatalError(_at(key_node, path, "a mapping key must be a plain scalar"))
                if key in out:
                    raise FatalError(_at(key_node, path, f"duplicate key {key!r}"))
                child = (*path, key if isinstance(key, str) else str(key))
                positions[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                out[key] = self.build(value_node, child, positions)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i), positions) for i, item in enumerate(node.value)]
        return self.construct_object(node, deep=True)


def _at(node: yaml.Node, path: Path_, message: str) -> Problem:
    mark = node.start_mark
    return Problem(message, mark.name, mark.line + 1, mark.column + 1, key_path(path))


def parse(text: str, file: str) -> Document:
    """Parse YAML text; syntax errors become a FatalError naming file, line and column."""
    builder = _Builder(text)
    builder.name = file
    try:
        node = builder.get_single_node()
        positions: dict[Path_, tuple[int, int]] = {}
        data = None if node is None else builder.build(node, (), positions)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = exc.problem or exc.context or "invalid YAML"
        line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise FatalError(Problem(f"invalid YAML: {reason}", file, line, column)) from None
    except yaml.YAMLError as exc:
        raise FatalError(Problem(f"invalid YAML: {exc}", file)) from None
    finally:
        builder.dispose()
    return Document(data, file, positions)


def load(path: str | Path) -> Document:
    """Read and parse a YAML file; a missing or unreadable file is a FatalError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FatalError(Problem("file not found", str(path))) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FatalError(Problem(f"cannot read: {exc}", str(path))) from None
    return parse(text, str(path))
