"""Find the kinds of a plugin package (actions, probes): every module, keyed by one attribute.

Strict, like pre-commit's typed registry of languages: a module whose name starts with `_` is
a helper, not a kind; a kind that lacks one of its package's required attributes, or two
modules that claim one key, are refused when the package is imported, so the author of a new
kind sees the mistake at once instead of at some runbook's `--check`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType


class PluginError(Exception):
    """A plugin module that breaks its package's interface: a bug in ralph-run, not input."""


def discover(
    package: str, directory: str | Path, key: str, required: Iterable[str] = ()
) -> dict[str, ModuleType]:
    """{module.<key>: module} for every public module in the package's directory.

    required: the other attributes each kind must define; a lowercase one must be callable.
    """
    kinds: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules([str(directory)]), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        name = _check(module, key, tuple(required))
        if name in kinds:
            raise PluginError(
                f"{module.__name__} and {kinds[name].__name__} both define {key} = {name!r}"
            )
        kinds[name] = module
    return kinds


def _check(module: ModuleType, key: str, required: tuple[str, ...]) -> str:
    missing = [name for name in (key, *required) if not hasattr(module, name)]
    if missing:
        raise PluginError(f"{module.__name__} lacks {', '.join(missing)}: every kind defines them")
    name = getattr(module, key)
    if not isinstance(name, str) or not name.isidentifier():
        raise PluginError(f"{module.__name__}: {key} must be a name, found {name!r}")
    for attribute in required:
        if attribute.islower() and not callable(getattr(module, attribute)):
            raise PluginError(f"{module.__name__}: {attribute} must be a function")
    return name
