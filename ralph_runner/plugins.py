"""Find the kinds of a plugin package (actions, probes): every module, keyed by one attribute."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType


def discover(package: str, directory: str | Path, key: str) -> dict[str, ModuleType]:
    """{module.<key>: module} for every module in the package's directory."""
    kinds = {}
    for info in pkgutil.iter_modules([str(directory)]):
        module = importlib.import_module(f"{package}.{info.name}")
        kinds[getattr(module, key)] = module
    return kinds
