"""JSON read back as the TypedDict that declares it: the checks behind status_file.read and
loop/state.py's State.from_dict.

A file of `.ralph/` may come from an older ralph-run (a key it did not have yet), from a newer
one (keys this one does not know) or from a hand. `fits` says whether a value is of a declared
type; `conformed` makes a record of a declared shape from what was read: a missing or ill-typed
key gets its default (what a loop that never ran would show: 0, False, None, "", []), nested
records are conformed the same way, and unknown keys are kept as they are.
"""

# No `from __future__ import annotations`: the checks read the TypedDicts' annotations at run
# time, and Python 3.11 sees NotRequired only in annotations that are evaluated.

import functools
import types
import typing
from typing import Literal, Protocol, TypeVar, Union

from ralph_runner.durable.json_value import JSON

Record = TypeVar("Record")  # a TypedDict


class _TypedDictClass(Protocol):
    """What a TypedDict class has that `type` does not say."""

    __required_keys__: frozenset[str]


def conformed(shape: type[Record], data: dict[str, JSON]) -> Record:
    """`data` as `shape` (a TypedDict) declares it (see the module's text); an optional key
    that is ill-typed is dropped."""
    return typing.cast(Record, _record(shape, data))  # checked key by key


def _record(shape: type, data: dict[str, JSON]) -> dict[str, JSON]:
    required = typing.cast(_TypedDictClass, shape).__required_keys__
    record = dict(data)
    for key, hint in hints(shape).items():
        value = data.get(key)
        nested = record_in(hint)
        if nested is not None and isinstance(value, dict):
            record[key] = _record(nested, value)
        elif key in data and fits(hint, value):
            continue
        elif key in required:
            record[key] = default(hint)
        else:
            record.pop(key, None)
    return record


@functools.cache  # evaluated once per shape: `top` reads every loop's status several times a second
def hints(shape: type) -> dict[str, object]:
    """A TypedDict's (or dataclass's) keys and their types, evaluated (not to be changed)."""
    found: dict[str, object] = typing.get_type_hints(shape)
    return found


def record_in(hint: object) -> type | None:
    """The TypedDict a type names (alone or with None), if any."""
    for option in _options(hint):
        if typing.is_typeddict(option):
            return typing.cast(type, option)
    return None


def fits(hint: object, value: object) -> bool:
    """The value is of the declared type (an int is a float; a bool is no number); a record
    fits when it is an object (conformed, it gets the keys it lacks)."""
    for option in _options(hint):
        origin = _origin(option)
        if option is type(None) and value is None:
            return True
        if origin is Literal and value in _args(option):
            return True
        if origin is list and isinstance(value, list):
            (item,) = _args(option)
            if all(fits(item, v) for v in value):
                return True
        if origin is dict and isinstance(value, dict):
            _, item = _args(option)
            if all(fits(item, v) for v in value.values()):
                return True
        if typing.is_typeddict(option) and isinstance(value, dict):
            return True
        if option is bool and isinstance(value, bool):
            return True
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if option is str and isinstance(value, str):
            return True
    return False


def default(hint: object) -> JSON:
    """What a loop that never ran would show for a key of this type."""
    options = _options(hint)
    if type(None) in options:
        return None
    first = options[0]
    origin = _origin(first)
    if origin is Literal:
        return typing.cast(JSON, _args(first)[0])
    if origin is list:
        return []
    if origin is dict:
        return {}
    if typing.is_typeddict(first):
        return _record(typing.cast(type, first), {})
    defaults: dict[object, JSON] = {bool: False, int: 0, float: 0.0, str: ""}
    return defaults[first]


def _options(hint: object) -> tuple[object, ...]:
    if _origin(hint) in (Union, types.UnionType):
        return _args(hint)
    return (hint,)


def _origin(hint: object) -> object:
    """list for list[str], Literal for Literal["a"], ... (typing.get_origin, typed)."""
    origin: object = typing.get_origin(hint)
    return origin


def _args(hint: object) -> tuple[object, ...]:
    """(str,) for list[str], ("a",) for Literal["a"], ... (typing.get_args, typed)."""
    args: tuple[object, ...] = typing.get_args(hint)
    return args
