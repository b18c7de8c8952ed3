"""Field types shared by the parameter models of actions and probes."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Annotated, Any, TypeAlias, TypeVar

from pydantic import AfterValidator, StringConstraints, TypeAdapter, ValidationError

from ralph_runner.errors import FatalError, Problem

# A value known only at run time, e.g. `port: "{{ port }}"`: accepted when the runbook is
# loaded, then rendered and validated as the real type before the probe or action runs.
TemplateText = Annotated[str, StringConstraints(pattern=r"\{\{.*\}\}")]


_T = TypeVar("_T")
# `Templated[int]`: an int, or a template that renders to one (an alias tools can follow).
Templated: TypeAlias = _T | TemplateText


def _compiles(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    return pattern


Regex = Annotated[str, AfterValidator(_compiles)]


def validate_rendered(params_type: Any, data: Any, where: Problem) -> Any:
    """Rendered params checked against their type again: `port: "{{ port }}"` may have rendered
    to a word. FatalError at the task's (or probe's) line, not a pydantic traceback."""
    try:
        return TypeAdapter(params_type).validate_python(data)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise FatalError(replace(where, message=f"once rendered: {errors}")) from None
