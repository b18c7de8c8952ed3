"""Ansible's YAML inventory, host patterns and variable precedence, read without Ansible.

An operator's existing inventory must work unchanged, so this follows what ansible-core does (the
tests compare it with `ansible-inventory`). It is stricter only where Ansible would skip a mistake
with a warning: unknown keys, malformed groups and patterns that match nothing are errors here.
Values are kept as loaded; templating them is another module's job.
"""

from __future__ import annotations

import difflib
import fnmatch
import ipaddress
import json
import os
import re
import shlex
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ralph_runner.errors import FatalError, Problem
from ralph_runner.runbook import yamlfile

# Names that mean the controller itself even when the inventory does not list them (Ansible's
# "implicit localhost": not in `all`, but it gets `all`'s vars and host_vars/localhost).
LOCALHOST_NAMES = ("localhost", "127.0.0.1", "::1")
_IMPLICIT_LOCALHOST_VARS = {"ansible_connection": "local"}
_GROUP_KEYS = ("hosts", "children", "vars")
_SECTION_SHAPES = {
    "hosts": "`hosts` must be a mapping of host name to its vars (write `web1:`, not `- web1`)",
    "children": "`children` must be a mapping of group name to group (write `web:`, not `- web`)",
    "vars": "`vars` must be a mapping of variable name to value",
}
# Ansible's vars-file lookup: the first of NAME, NAME.yml, NAME.yaml, NAME.json that exists.
_VARS_EXTENSIONS = (".yml", ".yaml", ".json")
_HOST_PORT = re.compile(r"((?:[^:\[\]]|\[[^\]]*\])+):([0-9]+)")
_BRACKETED_HOST_PORT = re.compile(r"\[(.+)\]:([0-9]+)")
_PATTERN_PART = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")
_GLOB_CHARS = (".", "?", "*", "[")
_SHOWN_CHARS = 80  # of an -e value, in its error message


@dataclass
class _Group:
    name: str
    vars: dict[str, object] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)  # direct members, in inventory order
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    priority: int = 1  # ansible_group_priority
    depth: int = 0  # longest path from `all`: deeper groups override shallower ones


@dataclass
class Inventory:
    """Hosts, groups and their variables as Ansible sees them."""

    file: str | None
    _groups: dict[str, _Group] = field(default_factory=dict, repr=False)
    _inline_host_vars: dict[str, dict[str, object]] = field(default_factory=dict, repr=False)
    _group_files: dict[str, dict[str, object]] = field(default_factory=dict, repr=False)
    _host_files: dict[str, dict[str, object]] = field(default_factory=dict, repr=False)

    def hosts(self) -> list[str]:
        """Every host, in the order `ansible all --list-hosts` gives."""
        return self._members("all")

    def groups(self) -> dict[str, list[str]]:
        """Each group's hosts, members of child groups included; `all` and `ungrouped` too."""
        return {name: self._members(name) for name in self._groups}

    def select(self, pattern: str, *, where: Problem | None = None) -> list[str]:
        """The hosts an Ansible host pattern names, in inventory order.

        A part that matches nothing is an error rather than Ansible's warning: a typo in `!web`
        would otherwise widen the selection. `where` locates the pattern (its message is
        ignored), so the error can name the runbook line or say `--limit`.
        """
        parts = _split_pattern(pattern)
        if not parts:
            raise FatalError(_located(where, f"empty host pattern {pattern!r}"))
        regular = [p for p in parts if p[0] not in "&!"] or ["all"]
        ordered = [*regular, *(p for p in parts if p[0] == "&"), *(p for p in parts if p[0] == "!")]
        selected: list[str] = []
        for part in ordered:
            operator, name = (part[0], part[1:]) if part[0] in "&!" else ("", part)
            if not name:
                message = f"host pattern {pattern!r}: {part!r} names nothing"
                raise FatalError(_located(where, message))
            matched = self._match(name, pattern, where)
            if operator == "!":
                selected = [host for host in selected if host not in matched]
            elif operator == "&":
                selected = [host for host in selected if host in matched]
            else:
                selected += [host for host in matched if host not in selected]
        return selected

    def host_vars(self, host: str) -> dict[str, object]:
        """The host's inventory variables merged as Ansible does, plus its magic variables."""
        return {**self._inventory_vars(host), **self._magic_vars(host)}

    def _match(self, name: str, pattern: str, where: Problem | None) -> list[str]:
        """One part of a pattern: a host, a group, a glob or a `~regex`, as Ansible matches it."""
        if name in self._inline_host_vars:
            return [name]
        try:
            matcher = re.compile(name[1:] if name[0] == "~" else fnmatch.translate(name))
        except re.error as exc:
            message = f"host pattern {pattern!r}: {name!r} is not a valid regular expression: {exc}"
            raise FatalError(_located(where, message)) from None
        groups = [group for group in self._groups if matcher.match(group)]
        hosts = [host for group in groups for host in self._members(group)]
        if not groups or name[0] == "~" or any(char in name for char in _GLOB_CHARS):
            hosts += [host for host in self._inline_host_vars if matcher.match(host)]
        if not hosts and name in LOCALHOST_NAMES:
            listed = [host for host in self._inline_host_vars if host in LOCALHOST_NAMES]
            return listed[:1] or [name]  # 127.0.0.1 means the listed localhost, if any
        if not hosts and not groups and name != "all":
            message = f"host pattern {pattern!r}: {name!r} matches no host or group"
            known = [*self._groups, *self._inline_host_vars]
            message += _did_you_mean(name, known) + self._listing()
            raise FatalError(_located(where, message))
        return list(dict.fromkeys(hosts))

    def _members(self, group: str) -> list[str]:
        """The group's own hosts, then its descendants' hosts, breadth first, like Ansible."""
        order, frontier = [group], [group]
        while frontier:
            next_level: list[str] = []
            for parent in frontier:
                for child in self._groups[parent].children:
                    if child not in order:
                        order.append(child)
                        next_level.append(child)
            frontier = next_level
        return list(dict.fromkeys(host for name in order for host in self._groups[name].hosts))

    def _groups_of(self, host: str) -> list[_Group]:
        return [group for group in self._groups.values() if host in self._members(group.name)]

    def _inventory_vars(self, host: str) -> dict[str, object]:
        """Ansible's order: `all` < other groups (inventory file), then the same for group_vars/
        files, then the host's own vars (inventory file, then host_vars/)."""
        self._require_host(host)
        groups = sorted(
            (group for group in self._groups_of(host) if group.name != "all"),
            key=lambda group: (group.depth, group.priority, group.name),
        )
        merged = dict(self._groups["all"].vars)
        for group in groups:
            merged.update(group.vars)
        merged.update(self._group_files.get("all", {}))
        for group in groups:
            merged.update(self._group_files.get(group.name, {}))
        merged.update(self._inline_host_vars.get(host, _IMPLICIT_LOCALHOST_VARS))
        merged.update(self._host_files.get(host, {}))
        return merged

    def _magic_vars(self, host: str) -> dict[str, object]:
        """What Ansible sets for every host and nothing may override (not even -e)."""
        try:
            short = str(ipaddress.ip_address(host))
        except ValueError:
            short = host.split(".")[0]
        return {
            "inventory_hostname": host,
            "inventory_hostname_short": short,
            "group_names": sorted(g.name for g in self._groups_of(host) if g.name != "all"),
        }

    def _require_host(self, host: str) -> None:
        if host not in self._inline_host_vars and host not in LOCALHOST_NAMES:
            message = f"unknown host {host!r}"
            message += _did_you_mean(host, list(self._inline_host_vars)) + self._listing()
            raise FatalError(Problem(message, self.file))

    def _listing(self) -> str:
        return f" (groups: {_names(self._groups)}; hosts: {_names(self._inline_host_vars)})"


def load(path: str | os.PathLike | None) -> Inventory:
    """Read an inventory and the group_vars/ and host_vars/ beside it.

    None gives the inventory of no `-i`: only `localhost`, with `ansible_connection: local`.
    """
    if path is None:
        implicit = {"all": {"hosts": {"localhost": dict(_IMPLICIT_LOCALHOST_VARS)}}}
        parser = _Parser(yamlfile.Document(implicit, "<implicit localhost>"))
        return Inventory(None, parser.groups, parser.host_vars)
    path = Path(path)
    if path.is_dir():
        raise FatalError(Problem("is a directory; -i takes an inventory file", str(path)))
    try:
        doc = yamlfile.load(path)
    except FatalError:
        _reject_ini(path)
        raise
    if not isinstance(doc.data, dict | None):
        _reject_ini(path)
    parser = _Parser(doc)
    hosts = [*parser.host_vars, *(n for n in LOCALHOST_NAMES if n not in parser.host_vars)]
    return Inventory(
        str(path),
        parser.groups,
        parser.host_vars,
        _group_files=_read_vars_dir(path.parent / "group_vars", parser.groups),
        _host_files=_read_vars_dir(path.parent / "host_vars", hosts),
    )


def parse_extra_vars(values: Iterable[str]) -> dict[str, object]:
    """Merge `-e` values in order (later ones win), each KEY=VALUE..., @FILE or a mapping."""
    merged: dict[str, object] = {}
    for value in values:
        merged.update(_extra_vars(value))
    return merged


def resolve_vars(
    runbook_vars: Mapping[str, Any], inventory: Inventory, host: str, extra_vars: Mapping[str, Any]
) -> dict[str, object]:
    """Runbook vars (like role defaults) < inventory vars < -e < magic vars, as in Ansible."""
    return {
        **runbook_vars,
        **inventory._inventory_vars(host),
        **extra_vars,
        **inventory._magic_vars(host),
    }


class _Parser:
    """Builds groups and hosts from an inventory document in the order Ansible does."""

    def __init__(self, doc: yamlfile.Document) -> None:
        self.doc = doc
        self.groups = {"all": _Group("all", children=["ungrouped"])}
        self.groups["ungrouped"] = _Group("ungrouped", parents=["all"])
        self.host_vars: dict[str, dict[str, object]] = {}
        data = {} if doc.data is None else doc.data
        if not isinstance(data, dict):
            message = f"an inventory is a mapping of groups (`all:`), found {_kind(data)}"
            raise self.error((), message)
        if data.get("plugin"):
            message = "inventory plugin configuration is not supported; give hosts and groups"
            raise self.error(("plugin",), message)
        for name, body in data.items():
            self.group(name, body, (str(name),))
        self.reconcile()

    def error(self, path: tuple[str, ...], message: str) -> FatalError:
        return FatalError(self.doc.problem(path, message))

    def group(self, name: Any, body: Any, path: tuple[str, ...]) -> str:
        if not isinstance(name, str):
            raise self.error(path, f"group name {name!r} must be a string; quote it")
        group = self.groups.setdefault(name, _Group(name))
        if body is None:
            return name
        if not isinstance(body, dict):
            shape = "a mapping with `hosts`, `children` or `vars`"
            raise self.error(path, f"group {name!r} must be {shape}, found {_kind(body)}")
        for key, value in body.items():
            where = (*path, str(key))
            if key not in _GROUP_KEYS:
                message = f"unknown key {key!r} in group {name!r}"
                message += _did_you_mean(str(key), _GROUP_KEYS)
                raise self.error(where, f"{message}; a group has `hosts`, `children` and `vars`")
            if isinstance(value, str) and key != "vars":
                value = {value: None}  # Ansible allows `hosts: web1`
            if value is None:
                continue
            if not isinstance(value, dict):
                raise self.error(where, f"{_SECTION_SHAPES[key]}, found {_kind(value)}")
            if key == "vars":
                self.set_vars(group, value, where)
            elif key == "children":
                for child, child_body in value.items():
                    child_path = (*where, str(child))
                    self.add_child(group, self.group(child, child_body, child_path), child_path)
            else:
                for pattern, variables in value.items():
                    self.add_hosts(group, pattern, variables, (*where, str(pattern)))
        return name

    def set_vars(self, group: _Group, variables: dict, where: tuple[str, ...]) -> None:
        _require_names(variables, self.doc, where)
        for name, value in variables.items():
            if name != "ansible_group_priority":
                group.vars[name] = value
            elif isinstance(value, int | str) and re.fullmatch(r"\s*-?[0-9]+\s*", str(value)):
                group.priority = int(value)
            else:
                message = f"ansible_group_priority must be an integer, found {_kind(value)}"
                raise self.error((*where, name), message)

    def add_child(self, group: _Group, child: str, where: tuple[str, ...]) -> None:
        if child == "all":
            raise self.error(where, "`all` holds every group; it cannot be a child group")
        if child == group.name or child in self.ancestors(group.name):
            loop = f"{child!r} is already {group.name!r} or one of its parents"
            raise self.error(where, f"group {child!r} under {group.name!r} makes a loop: {loop}")
        if child not in group.children:
            group.children.append(child)
            self.groups[child].parents.append(group.name)

    def ancestors(self, name: str) -> set[str]:
        found: set[str] = set()
        pending = list(self.groups[name].parents)
        while pending:
            parent = pending.pop()
            if parent not in found:
                found.add(parent)
                pending += self.groups[parent].parents
        return found

    def add_hosts(
        self, group: _Group, pattern: Any, variables: Any, where: tuple[str, ...]
    ) -> None:
        if not isinstance(pattern, str):
            raise self.error(where, f"host name {pattern!r} must be a string; quote it")
        if variables is not None and not isinstance(variables, dict):
            message = f"the vars of host {pattern!r} must be a mapping (or empty)"
            raise self.error(where, f"{message}, found {_kind(variables)}")
        try:
            names, port = _expand_host_pattern(pattern)
        except ValueError as exc:
            raise self.error(where, f"host range in {pattern!r}: {exc}") from None
        for name in names:
            if port is not None and name in self.host_vars:
                message = f"host {name!r} is already defined; Ansible ignores a port given again"
                raise self.error(where, f"{message}: give `:{port}` where it first appears")
            host_vars = self.host_vars.setdefault(name, {})
            if name not in group.hosts:
                group.hosts.append(name)
            if port is not None:
                host_vars["ansible_port"] = port
            _require_names(variables or {}, self.doc, where)
            host_vars.update(variables or {})

    def reconcile(self) -> None:
        """What Ansible does after parsing: orphan groups go under `all`, hosts in no group
        other than `all` go to `ungrouped`, and each group's depth is fixed."""
        for name, group in self.groups.items():
            if name != "all" and not group.parents:
                group.parents.append("all")
                self.groups["all"].children.append(name)
        ungrouped = self.groups["ungrouped"].hosts
        for host in self.host_vars:
            direct = {group.name for group in self.groups.values() if host in group.hosts}
            if "ungrouped" in direct and direct - {"all", "ungrouped"}:
                ungrouped.remove(host)
            elif direct <= {"all"}:
                ungrouped.append(host)
        depths = {"all": 0}

        def depth(name: str) -> int:
            if name not in depths:
                depths[name] = max(depth(parent) + 1 for parent in self.groups[name].parents)
            return depths[name]

        for group in self.groups.values():
            group.depth = depth(group.name)


def _expand_host_pattern(pattern: str) -> tuple[list[str], int | None]:
    """`web[01:03].lan:2222` -> (['web01.lan', 'web02.lan', 'web03.lan'], 2222), as Ansible."""
    match = _BRACKETED_HOST_PORT.fullmatch(pattern) or _HOST_PORT.fullmatch(pattern)
    host, port = (match.group(1), int(match.group(2))) if match else (pattern, None)
    return _expand_ranges(host), port


def _expand_ranges(name: str) -> list[str]:
    if "[" not in name:
        return [name]
    head, _, rest = name.partition("[")
    spec, closed, tail = rest.partition("]")
    bounds = spec.split(":")
    if not closed or len(bounds) not in (2, 3) or not bounds[1]:
        raise ValueError(f"[{spec}] is not a range; write [begin:end] or [begin:end:step]")
    begin, end = bounds[0] or "0", bounds[1]
    width = len(begin) if begin.startswith("0") and len(begin) > 1 else 0
    if width and len(end) != width:
        raise ValueError(f"[{spec}]: a zero-padded range needs begin and end of equal length")
    try:
        step = int(bounds[2]) if len(bounds) == 3 else 1
        if len(begin) == len(end) == 1 and begin in string.ascii_letters:
            letters = string.ascii_letters
            items = list(letters[letters.index(begin) : letters.index(end) + 1 : step])
        else:
            items = [str(n).zfill(width) for n in range(int(begin), int(end) + 1, step)]
    except ValueError:
        raise ValueError(f"[{spec}] is neither a numeric nor an alphabetic range") from None
    if not items:
        raise ValueError(f"[{spec}] is empty; begin must not be after end")
    return [expanded for item in items for expanded in _expand_ranges(f"{head}{item}{tail}")]


def _split_pattern(pattern: str) -> list[str]:
    """Ansible's split: on commas if there are any, else on colons outside [x:y] and IPv6."""
    if "," in pattern:
        parts = pattern.split(",")
    elif _is_ipv6(pattern.strip()):
        parts = [pattern]
    else:
        parts = _PATTERN_PART.findall(pattern)
    return [part.strip() for part in parts if part.strip()]


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _read_vars_dir(directory: Path, names: Iterable[str]) -> dict[str, dict[str, object]]:
    """group_vars/ or host_vars/: each name's files merged in order, as Ansible reads them."""
    if not directory.is_dir():
        return {}
    found: dict[str, dict[str, object]] = {}
    for name in names:
        merged: dict[str, object] = {}
        for path in _vars_files(directory, name):
            merged.update(_read_mapping(path, "a vars file"))
        if merged:
            found[name] = merged
    return found


def _vars_files(directory: Path, name: str) -> list[Path]:
    if name.startswith(os.sep):
        return []  # Ansible skips chroot-style host names
    for candidate in (directory / name, *(directory / f"{name}{ext}" for ext in _VARS_EXTENSIONS)):
        if candidate.is_dir():
            return _dir_vars_files(candidate)
        if candidate.exists():
            return [candidate]
    return []


def _dir_vars_files(directory: Path) -> list[Path]:
    """Every vars file under a NAME/ directory, sorted, skipping hidden files and backups~."""
    found: list[Path] = []
    for path in sorted(directory.iterdir(), key=lambda p: p.name):
        if path.name.startswith(".") or path.name.endswith("~"):
            continue
        if path.is_dir() and not path.suffix:
            found += _dir_vars_files(path)
        elif path.is_file() and path.suffix in ("", *_VARS_EXTENSIONS):
            found.append(path)
    return found


def _read_mapping(path: Path, what: str) -> dict[str, object]:
    """A YAML (or JSON) file of variables; empty is fine, anything but a mapping is not."""
    doc = _read_json(path) if path.suffix == ".json" else None
    doc = doc or yamlfile.load(path)
    if doc.data is None:
        return {}
    if not isinstance(doc.data, dict):
        message = f"{what} must hold a mapping of variable names to values, found {_kind(doc.data)}"
        raise FatalError(doc.problem((), message))
    _require_names(doc.data, doc, ())
    return doc.data


def _read_json(path: Path) -> yamlfile.Document | None:
    return _parse_json(yamlfile.read_text(path), str(path))


def _parse_json(text: str, file: str) -> yamlfile.Document | None:
    """JSON, which Ansible's loader tries before YAML (YAML rejects tab indents); None if not.

    Held to the YAML loader's bounds: JSON has no aliases, so size and depth are all there is.
    """
    if len(text) > yamlfile.MAX_BYTES:
        return None  # the YAML loader says it is too big
    try:
        data = json.loads(text)
    except RecursionError:
        raise FatalError(Problem(f"invalid JSON: {yamlfile.too_deep()}", file)) from None
    except ValueError:
        return None
    yamlfile.check_depth(data, file)
    return yamlfile.Document(data, file, {(): (1, 1)})


def _extra_vars(value: str) -> dict[str, object]:
    """One -e value: @FILE, an inline JSON/YAML mapping, or KEY=VALUE words (values as text)."""
    if not value:
        return {}
    shown = f"-e {value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + '...'!r}"
    if value.startswith("@"):
        try:
            return _read_mapping(Path(value[1:]), "the file")
        except FatalError as exc:
            problems = [replace(p, message=f"{shown}: {p.message}") for p in exc.problems]
            raise FatalError(problems) from None
    if value[0] in "/.":
        raise FatalError(f"{shown}: a file of variables needs a leading '@': -e '@{value}'")
    if value[0] in "[{":
        return _inline_mapping(value, shown)
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise FatalError(f"{shown}: {exc}; expected KEY=VALUE") from None
    pairs: dict[str, object] = {}
    for word in words:
        key, equals, text = word.partition("=")
        if not equals:
            expected = "KEY=VALUE, @FILE (YAML or JSON) or a JSON/YAML mapping"
            hint = "" if word == value else "; quote a value with spaces: -e 'key=\"a b\"'"
            raise FatalError(f"{shown}: {word!r} is not KEY=VALUE; expected {expected}{hint}")
        if not key.isidentifier():
            raise FatalError(f"{shown}: {key!r} is not a valid variable name")
        pairs[key] = text
    return pairs


def _inline_mapping(value: str, shown: str) -> dict[str, object]:
    doc = _parse_json(value, shown)
    if doc is None:
        try:
            doc = yamlfile.parse(value, shown)
        except FatalError as exc:
            problem = exc.problems[0]
            at = f" at column {problem.column}" if problem.column else ""
            message = f"{shown}: {problem.message}{at}; expected a JSON or YAML mapping"
            raise FatalError(message) from None
    if not isinstance(doc.data, dict):
        raise FatalError(f"{shown}: expected a mapping of variables, found {_kind(doc.data)}")
    _require_names(doc.data, doc, ())
    return doc.data


def _require_names(variables: Mapping[Any, Any], doc: yamlfile.Document, where: tuple) -> None:
    """Variable names are strings (YAML makes `1:` a number, `yes:` a boolean)."""
    for name in variables:
        if not isinstance(name, str):
            message = f"variable name {name!r} must be a string; quote it"
            raise FatalError(doc.problem((*where, str(name)), message))


def _reject_ini(path: Path) -> None:
    """An INI inventory is common; say how to convert it rather than report a YAML error."""
    try:
        lines = yamlfile.read_text(path).splitlines()
    except FatalError:
        return
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text[0] in "#;":
            continue
        if re.fullmatch(r"\[[^\]\s]+\]", text):
            message = (
                "this is an INI inventory; ralph-run reads Ansible's YAML inventory format."
                f" Convert it once: ansible-inventory -i {path} --list --yaml > inventory.yaml"
            )
            raise FatalError(Problem(message, str(path), number, 1))
        return


def _located(where: Problem | None, message: str) -> Problem:
    return replace(where, message=message) if where else Problem(message)


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _names(names: Iterable[str], limit: int = 15) -> str:
    names = list(names)
    shown = ", ".join(names[:limit]) or "none"
    return f"{shown}, ... ({len(names) - limit} more)" if len(names) > limit else shown


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {dict: "a mapping", list: "a list", str: "a string", int: "a number", float: "a number"}
    return next((kind for type_, kind in kinds.items() if isinstance(value, type_)), "a value")
