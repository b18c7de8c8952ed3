"""The one Jinja environment of ralph-run: sandboxed, strict, and shell-aware.

Every template in a runbook goes through a `Templar`, so one set of rules holds everywhere:

- Jinja's sandbox (the immutable one): `{{ ''.__class__ }}` and friends are errors, and a template
  cannot modify the runbook's data (`{{ item.update(...) }}`).
- A missing variable is an error naming it, never an empty string (as in Ansible). Missing values
  chain, so `{{ result.stdout | default('') }}` works while `result` is still undefined.
- Shell mode, for `shell` strings: each `{{ expression }}` becomes exactly one shell word,
  `shlex.quote(str(value))`. A checklist item `$(rm -rf ~)` stays text; numbers and plain words come
  out unchanged (`--port {{ port }}` gives `--port 8000`). Never wrap `{{ }}` in your own quotes.
  `{{ expr | safe }}` inserts the value as raw shell; `{{ expr | quote }}` is already a shell word
  and is not quoted twice. Only `safe` and `quote` opt out: an HTML-safe value (`| e`, `| tojson`)
  is still quoted, because HTML escaping does nothing against `$(...)`.
- None renders as "" in text (as in Ansible) and as `''` in shell mode: still one word, empty.
- Go-template braces (docker's `--format`): either keep Jinja off a stretch of text,
      docker ps --format '{% raw %}{{.Names}} {{.Status}}{% endraw %}'
  or, shorter, let an expression produce the braces, which shell mode also quotes for you:
      docker ps --format {{ '{{.Names}} {{.Status}}' }}
- Ansible's lookups: `lookup('file', 'PLAN.md')` (relative to `base_dir`, trailing whitespace
  stripped), `lookup('env', 'HOME')` ("" when unset, or `default=`), `lookup('pipe', 'git log
  --oneline -5')` (run in `cwd` by bash through process/execute.py; output right-stripped; a
  failing command is an error). Several terms give a comma-joined string; `query(...)` a list.
  With `check=True` (`--check`), pipe lookups are not run and render as a placeholder.
- Ansible's everyday filters (quote, default/d, to_json, to_nice_json, from_json, to_yaml,
  from_yaml, regex_search, regex_replace, regex_findall, basename, dirname, bool, b64encode,
  b64decode, mandatory) and tests (match, search) behave as in Ansible.

Every template error, at render time too, is a FatalError at the template's place in the runbook.
"""

from __future__ import annotations

import base64
import difflib
import json
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from functools import wraps
from pathlib import Path
from typing import Any, cast

import yaml
from jinja2 import (
    ChainableUndefined,
    StrictUndefined,
    Template,
    TemplateError,
    TemplateRuntimeError,
    TemplateSyntaxError,
    Undefined,
    UndefinedError,
    meta,
    nodes,
)
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import missing, object_type_repr

from ralph_runner import template_errors
from ralph_runner.durable import redaction
from ralph_runner.errors import FatalError, Problem, key_path
from ralph_runner.process import execute

# A whole string that is one `{{ expression }}` (whitespace control included); the parser
# confirms it, since "{{ a }} {{ b }}" matches too.
_LONE_EXPRESSION = re.compile(r"\s*\{\{[-+]?(?P<expression>.*?)-?\}\}\s*", re.DOTALL)
# Filters and tests whose use shows the template expects a name may be missing.
_GUARDS = {"default", "d", "mandatory", "defined", "undefined"}
_ERROR_OUTPUT_CHARS = 2000  # of a failed pipe lookup's output, in its error message
_CACHED_TEMPLATES = 512  # compiled templates kept per Templar (a runbook has tens)
MAX_RENDERED = 1024 * 1024  # characters of a rendered template: a prompt is under a model context
_MAX_POWER_BITS = 4096  # `**` beyond this is no port number, only a way to exhaust memory
_MAX_DEPTH = 32  # of lists and dicts searched for a function


class _RawShell(str):
    """Text to insert into a shell string as it is: made only by `safe` and `quote`."""

    __slots__ = ()


class _Undefined(ChainableUndefined, StrictUndefined):
    """Strict like Ansible (using a missing value fails), chainable so `default` still works."""

    __slots__ = ()

    @property
    def _undefined_message(self) -> str:
        if self._undefined_hint:
            return self._undefined_hint
        name = self._undefined_name
        if self._undefined_obj is missing:
            return f"undefined variable {name!r} in template"
        owner = self._undefined_obj
        hint = ""
        if isinstance(owner, Mapping):
            close = difflib.get_close_matches(str(name), [str(key) for key in owner], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
        return (
            f"undefined attribute {name!r} in template"
            f" ({object_type_repr(owner)} has no such key{hint})"
        )


def _text(value: Any) -> Any:
    _no_function(value)
    return "" if value is None else value


def _no_function(value: Any, depth: int = 0) -> None:
    """Refuse a function, method or class where a value belongs, in a list or dict too:
    `{{ [range] }}` would put "<function ...>" into a command."""
    if callable(value) and not isinstance(value, str | Undefined):
        raise TemplateError(f"the template gives a function ({value!r:.60}), not a value")
    if depth < _MAX_DEPTH and isinstance(value, list | tuple | set | frozenset | Mapping):
        for inner in value.items() if isinstance(value, Mapping) else value:
            _no_function(inner, depth + 1)


def _no_function_in(function: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that refuses a function among its values (`range | string`, `[range] |
    join`); the context, eval context or environment Jinja passes first is skipped."""
    skip = 1 if hasattr(function, "jinja_pass_arg") else 0

    @wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _no_function((args[skip:], kwargs))
        return function(*args, **kwargs)

    return checked


def _shell_word(value: Any) -> str:
    """One shell word; a leading `~/` stays outside the quotes so the shell expands it."""
    if isinstance(value, _RawShell):
        return value
    text = str(_text(value))
    if text.startswith("~/") and len(text) > 2:
        return "~/" + shlex.quote(text[2:])
    return shlex.quote(text)


def _require_defined(value: Any) -> None:
    if isinstance(value, Undefined):
        value._fail_with_undefined_error()


# ---- Ansible's filters and tests -----------------------------------------------------------


def _safe(value: Any) -> _RawShell:
    return _RawShell(_text(value))


def _quote(value: Any) -> _RawShell:
    return _RawShell(shlex.quote(str(_text(value))))


def _to_json(value: Any, **options: Any) -> str:
    return json.dumps(value, default=str, **options)


def _to_nice_json(value: Any, indent: int = 4, **options: Any) -> str:
    return json.dumps(
        value, default=str, indent=indent, sort_keys=True, separators=(",", ": "), **options
    )


def _to_yaml(value: Any, **options: Any) -> str:
    return yaml.safe_dump(value, allow_unicode=True, default_flow_style=None, **options)


def _flags(ignorecase: bool, multiline: bool) -> int:
    return (re.IGNORECASE if ignorecase else 0) | (re.MULTILINE if multiline else 0)


def _regex_search(
    value: Any, pattern: str, *groups: str, ignorecase: bool = False, multiline: bool = False
) -> str | list[str] | None:
    """The match, or with group references ('\\\\1', '\\\\g<name>') a list of those groups."""
    match = re.search(pattern, str(value), _flags(ignorecase, multiline))
    if match is None:
        return None
    if not groups:
        return match.group()
    return [match.expand(group) for group in groups]


def _regex_replace(
    value: Any,
    pattern: str,
    replacement: str = "",
    ignorecase: bool = False,
    multiline: bool = False,
    count: int = 0,
) -> str:
    return re.sub(
        pattern, replacement, str(value), count=count, flags=_flags(ignorecase, multiline)
    )


def _regex_findall(
    value: Any, pattern: str, multiline: bool = False, ignorecase: bool = False
) -> list[Any]:
    return re.findall(pattern, str(value), _flags(ignorecase, multiline))


def _bool(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    return str(value).strip().lower() in {"yes", "on", "1", "true"}


def _b64encode(value: Any, encoding: str = "utf-8") -> str:
    return base64.b64encode(str(value).encode(encoding)).decode("ascii")


def _b64decode(value: Any, encoding: str = "utf-8") -> str:
    return base64.b64decode(str(value)).decode(encoding)


def _mandatory(value: Any, msg: str | None = None) -> Any:
    if isinstance(value, Undefined):
        raise UndefinedError(msg or f"mandatory variable {value._undefined_name!r} not defined")
    return value


def _match(value: Any, pattern: str, ignorecase: bool = False, multiline: bool = False) -> bool:
    return re.match(pattern, str(value), _flags(ignorecase, multiline)) is not None


def _search(value: Any, pattern: str, ignorecase: bool = False, multiline: bool = False) -> bool:
    return re.search(pattern, str(value), _flags(ignorecase, multiline)) is not None


_FILTERS: dict[str, Callable[..., Any]] = {
    "safe": _safe,
    "quote": _quote,
    "to_json": _to_json,
    "to_nice_json": _to_nice_json,
    "from_json": json.loads,
    "to_yaml": _to_yaml,
    "from_yaml": yaml.safe_load,
    "regex_search": _regex_search,
    "regex_replace": _regex_replace,
    "regex_findall": _regex_findall,
    "basename": os.path.basename,
    "dirname": os.path.dirname,
    "bool": _bool,
    "b64encode": _b64encode,
    "b64decode": _b64decode,
    "mandatory": _mandatory,
}
_TESTS: dict[str, Callable[..., bool]] = {"match": _match, "search": _search}


# ---- the templar ---------------------------------------------------------------------------


class _CodeGenerator(CodeGenerator):
    """`~` checks its pieces (`'a' ~ range`) before it makes them text."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("str_join(environment.no_function((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, bounded: `'a' * 10**10` or `9 ** 9 ** 9` is an error at its
    template, not a machine out of memory (Jinja bounds `range` alone). A function never
    becomes text: not by `~`, `%`, `.format()` or a filter, nor inside a list."""

    intercepted_binops = frozenset({"*", "**", "%"})
    code_generator_class = _CodeGenerator

    @staticmethod
    def no_function(pieces: tuple[Any, ...]) -> tuple[Any, ...]:
        _no_function(pieces)
        return pieces

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        formats = super().wrap_str_format(value)
        return None if formats is None else _no_function_in(formats)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%":
            _no_function(right)
        elif operator == "*":
            for sequence, times in ((left, right), (right, left)):
                sized = isinstance(sequence, str | list | tuple) and isinstance(times, int)
                if sized and len(sequence) * times > MAX_RENDERED:
                    raise TemplateRuntimeError(f"'*' would make {_over(len(sequence) * times)}")
        elif (
            isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and abs(left) > 1
            and right * abs(left).bit_length() > _MAX_POWER_BITS
        ):
            raise TemplateRuntimeError(f"'**' would make a number over {_MAX_POWER_BITS:,} bits")
        return super().call_binop(context, operator, left, right)


def _over(size: int) -> str:
    return f"{size:,} items or characters, over ralph-run's bound of {MAX_RENDERED:,}"


class Templar:
    """Renders runbook templates; one per run, shared by every action.

    base_dir: where `lookup('file')` resolves relative paths (the workdir at runtime).
    cwd: where `lookup('pipe')` commands run; default base_dir.
    check: `--check` mode: pipe lookups are not run (the contract: --check runs no command).
    """

    def __init__(
        self,
        base_dir: Path,
        cwd: Path | None = None,
        pipe_timeout: float = 30.0,
        *,
        check: bool = False,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.cwd = Path(cwd) if cwd is not None else self.base_dir
        self.pipe_timeout = pipe_timeout
        self.check = check
        self._text = self._environment(finalize=_text)
        self._shell = self._environment(finalize=_shell_word)
        self._cache: dict[tuple[bool, str], Template] = {}
        self._lookups: dict[str, Callable[..., str]] = {
            "file": self._file,
            "env": _env,
            "pipe": self._pipe,
        }

    def render(
        self,
        text: str,
        variables: Mapping[str, Any],
        *,
        shell: bool = False,
        where: Problem | None = None,
    ) -> str:
        """Render a whole template (loops, ifs, ...); `shell=True` quotes each `{{ }}` (above).

        where: the template's place in the runbook, for errors (its message is replaced).
        """
        environment = self._shell if shell else self._text
        with _reported(where, text, environment, variables):
            rendered = self._compiled(environment, text).render(variables)
            if len(rendered) > MAX_RENDERED:  # e.g. vars that double each other, in a chain
                raise TemplateRuntimeError(f"the template renders to {_over(len(rendered))}")
            return rendered

    def render_data(
        self, data: Any, variables: Mapping[str, Any], *, where: Problem | None = None
    ) -> Any:
        """Render every string in nested dicts and lists (text mode).

        A string that is exactly one `{{ expression }}` gives the expression's value with its
        type (`port: "{{ 8000 }}"` gives the int), as in Ansible; any other string gives a string.
        """
        if isinstance(data, str):
            expression = self._lone_expression(data)
            if expression is None:
                return self.render(data, variables, where=where)
            value = self.evaluate(expression, variables, where=where)
            with _reported(where, data):
                _text(value)  # a function, class or module is no value: refused at its place
            return str(value) if isinstance(value, str) else value
        if isinstance(data, Mapping):
            return {
                key: self.render_data(value, variables, where=_below(where, key))
                for key, value in data.items()
            }
        if isinstance(data, list | tuple):
            return [
                self.render_data(value, variables, where=_below(where, index))
                for index, value in enumerate(data)
            ]
        return data

    def evaluate(
        self, expression: str | bool, variables: Mapping[str, Any], *, where: Problem | None = None
    ) -> Any:
        """The value of a bare Jinja expression, as in Ansible's `when:` and `until:`.

        Takes "result.rc == 0" or a "{{ }}"-wrapped expression; a YAML bool (any non-string)
        is its own value.
        """
        if not isinstance(expression, str):
            return expression
        source = self._lone_expression(expression) or expression
        with _reported(where, source, self._text, variables):
            value = self._text.compile_expression(source, undefined_to_none=False)(variables)
            _require_defined(value)
            if isinstance(value, str | list | tuple | dict) and len(value) > MAX_RENDERED:
                raise TemplateRuntimeError(f"the expression gives {_over(len(value))}")
            return value

    def undefined_names(
        self, text: str, variables: Mapping[str, Any], *, where: Problem | None = None
    ) -> set[str]:
        """Names the template uses that neither `variables` nor the template define (--check).

        A name guarded somewhere by `default`, `mandatory` or `is defined` is not reported: the
        template expects it may be missing.
        """
        with _reported(where, text, self._text, variables):
            tree = self._text.parse(text)
            used = meta.find_undeclared_variables(tree)  # an unknown filter fails here
        guarded = {
            root.name
            for node in tree.find_all((nodes.Filter, nodes.Test))
            if node.name in _GUARDS and isinstance(root := _root(node.node), nodes.Name)
        }
        return used - guarded - set(variables) - set(self._text.globals)

    # ---- internals ---------------------------------------------------------------------

    def _compiled(self, environment: _Sandbox, text: str) -> Template:
        """The compiled template: a loop renders the same few templates every iteration."""
        key = (environment is self._shell, text)
        template = self._cache.get(key)
        if template is None:
            if len(self._cache) >= _CACHED_TEMPLATES:
                self._cache.clear()
            template = self._cache[key] = environment.from_string(text)
        return template

    def _environment(self, finalize: Callable[[Any], Any]) -> _Sandbox:
        environment = _Sandbox(
            undefined=_Undefined,
            finalize=finalize,
            keep_trailing_newline=True,
            autoescape=False,
        )
        environment.filters.update(_FILTERS)
        for name, function in environment.filters.items():
            environment.filters[name] = _no_function_in(function)
        environment.tests.update(_TESTS)
        environment.globals.update(lookup=self._lookup, query=self._query, q=self._query)
        return environment

    def _lone_expression(self, text: str) -> str | None:
        """The expression inside text that is one `{{ expression }}` and nothing else."""
        match = _LONE_EXPRESSION.fullmatch(text)
        if match is None:
            return None
        try:
            body = self._text.parse(text).body
        except TemplateSyntaxError:
            return None  # rendering reports it, with its line
        lone = (
            len(body) == 1
            and isinstance(body[0], nodes.Output)
            and len(body[0].nodes) == 1
            and not isinstance(body[0].nodes[0], nodes.TemplateData)
        )
        return match["expression"] if lone else None

    def _lookup(self, name: str, *terms: Any, wantlist: bool = False, **options: Any) -> Any:
        plugin = self._lookups.get(name)
        if plugin is None:
            known = ", ".join(sorted(self._lookups))
            raise TemplateRuntimeError(f"unknown lookup {name!r} (known: {known})")
        values = [plugin(str(term), **options) for term in terms]
        return values if wantlist else ",".join(values)

    def _query(self, name: str, *terms: Any, **options: Any) -> list[str]:
        return self._lookup(name, *terms, wantlist=True, **options)

    def _file(self, path: str, *, rstrip: bool = True, lstrip: bool = False) -> str:
        target = self.base_dir / Path(path).expanduser()
        try:
            content = target.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise TemplateRuntimeError(f"lookup('file', {path!r}): {target}: {reason}") from None
        content = content.rstrip() if rstrip else content
        return content.lstrip() if lstrip else content

    def _pipe(self, command: str) -> str:
        if self.check:
            return f"(output of {command!r}, not run in --check)"
        result = execute.shell(command, cwd=self.cwd, timeout=self.pipe_timeout)
        if not result.ok:
            if result.timed_out:
                why = f"timed out after {self.pipe_timeout:g} s"
            else:
                why = "cancelled" if result.cancelled else f"exit code {result.exit_code}"
            output = result.output.strip()[-_ERROR_OUTPUT_CHARS:]
            raise TemplateRuntimeError(f"lookup('pipe', {command!r}) failed, {why}: {output}")
        return result.output.rstrip()


def attributes_of(expression: str, name: str, *, where: Problem | None = None) -> list[str]:
    """The fields a bare expression (a `when:`) takes of variable `name`: `death.hung` and
    `death['phase']` give ["hung", "phase"]. Parsed, never run: for checks of a variable that
    exists only at run time. A syntax error is a FatalError at `where`."""
    match = _LONE_EXPRESSION.fullmatch(expression)
    source = match["expression"] if match else expression
    with _reported(where, source):
        tree = _PARSER.parse(f"{{{{ {source} }}}}")
    found: list[str] = []
    lookups = cast(
        "Iterator[nodes.Getattr | nodes.Getitem]", tree.find_all((nodes.Getattr, nodes.Getitem))
    )
    for node in lookups:
        if not (isinstance(node.node, nodes.Name) and node.node.name == name):
            continue
        if isinstance(node, nodes.Getattr):
            found.append(node.attr)
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            found.append(node.arg.value)
    return found


_PARSER = ImmutableSandboxedEnvironment()  # parses only: rendering is the Templar's


def has_template(text: str) -> bool:
    """Whether text holds any Jinja markup, i.e. rendering could change it."""
    return any(marker in text for marker in ("{{", "{%", "{#"))


def _env(name: str, *, default: str = "") -> str:
    """`lookup('env', NAME)`; a secret's name (`GITHUB_PAT`) masks its value from now on."""
    value = os.environ.get(name, default)
    if name in os.environ and redaction.env_secret_named(name, value):
        redaction.register(value)
    return value


def _root(node: nodes.Node) -> nodes.Node:
    """The variable at the start of `a.b['c']`."""
    while isinstance(node, nodes.Getattr | nodes.Getitem):
        node = node.node
    return node


def _below(where: Problem | None, key: str | int) -> Problem | None:
    """`where` for a value nested under `key` (same line: the caller knows no finer place)."""
    return None if where is None else replace(where, path=key_path((where.path, key)))


@contextmanager
def _reported(
    where: Problem | None,
    text: str,
    environment: _Sandbox | None = None,
    variables: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """Turn whatever a template raises into a FatalError at `where`; a typo of a variable,
    filter or test gets its did-you-mean from `environment` and `variables`."""

    def worded(message: str) -> str:
        return template_errors.worded(
            message,
            variables=[*(variables or {}), *(environment.globals if environment else {})],
            filters=environment.filters if environment else (),
            tests=environment.tests if environment else (),
        )

    try:
        yield
    except TemplateSyntaxError as exc:
        line = f" (line {exc.lineno} of the template)"
        message = worded(exc.message or str(exc))
        raise FatalError(_at(where, f"template syntax error: {message}{line}")) from None
    except SecurityError as exc:
        said = template_errors.template_line(exc, text)
        raise FatalError(_at(where, f"unsafe template: {exc}{said}")) from None
    except TemplateError as exc:
        said = template_errors.template_line(exc, text)
        raise FatalError(_at(where, f"{worded(str(exc))}{said}")) from None
    except Exception as exc:  # a filter's ValueError, a ZeroDivisionError, ...
        if not template_errors.from_template(exc):
            raise  # raised by ralph-run's own code, not by the template: a bug (exit 70)
        said = template_errors.template_line(exc, text)
        message = f"template error: {type(exc).__name__}: {exc}{said}"
        raise FatalError(_at(where, message)) from None


def _at(where: Problem | None, message: str) -> Problem:
    return Problem(message) if where is None else replace(where, message=message)
