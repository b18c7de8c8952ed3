"""Field types shared by the parameter models of actions and probes."""

from __future__ import annotations

import re
from typing import Annotated, TypeAlias, TypeVar

from pydantic import AfterValidator, StringConstraints

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
