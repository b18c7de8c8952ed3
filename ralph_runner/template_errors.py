"""A template's mistakes in words that say how to mend them: the did-you-mean of a variable, a
filter or a test that does not exist. templating.py reports them at their runbook line; this
module only words them (it knows no Jinja, so it sits below templating)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

_NO_SUCH = re.compile(r"No (filter|test) named '([^']+)'")
_UNDEFINED = re.compile(r"undefined variable '([^']+)'")


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name a typo most likely meant; None when none is close."""
    found = difflib.get_close_matches(name, sorted(set(known)), n=1)
    return found[0] if found else None


def worded(
    message: str,
    *,
    variables: Iterable[str] = (),
    filters: Iterable[str] = (),
    tests: Iterable[str] = (),
) -> str:
    """Jinja's message for an unknown filter or test, or an undefined variable, with the name
    it most likely meant; any other message as it is."""
    unknown = _NO_SUCH.search(message)
    if unknown:
        kind, name = unknown.groups()
        close = closest(name, filters if kind == "filter" else tests)
        return f"no {kind} named {name!r}" + (f"; did you mean {close!r}?" if close else "")
    undefined = _UNDEFINED.search(message)
    if undefined and "did you mean" not in message:
        close = closest(undefined.group(1), variables)
        if close:
            return f"{message}; did you mean {close!r}?"
    return message


def from_template(exc: BaseException) -> bool:
    """Did the template's own code raise it (`{{ 1 / 0 }}`, a filter given a bad value)?"""
    traceback = exc.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            return True
        traceback = traceback.tb_next
    return False


def template_line(exc: BaseException, text: str) -> str:
    """Where a multi-line template failed, from the traceback Jinja rewrites to template lines."""
    if "\n" not in text.rstrip("\n"):
        return ""
    line = None
    traceback = exc.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return "" if line is None else f" (line {line} of the template)"
