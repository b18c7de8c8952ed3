"""Strict plugin discovery: helpers skipped, a missing attribute or a shared key refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ralph_runner import actions, probes
from ralph_runner.plugins import discovery

GOOD = 'KEY = "{key}"\nParams = str\n\ndef run(p, c):\n    pass\n\ndef describe(p, c):\n    pass\n'


def _package(tmp_path: Path, name: str, modules: dict[str, str]) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "__init__.py").write_text("")
    for module, text in modules.items():
        (directory / f"{module}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    return directory


@pytest.fixture(autouse=True)
def _clean_path():
    before = list(sys.path)
    yield
    sys.path[:] = before


def _discover(directory: Path) -> dict:
    return discovery.discover(
        directory.name, directory, "KEY", required=("Params", "run", "describe")
    )


def test_helpers_are_skipped_and_kinds_found_by_key(tmp_path: Path) -> None:
    directory = _package(
        tmp_path, "kinds_ok", {"one": GOOD.format(key="first"), "_shared": "HELPER = 1\n"}
    )
    found = _discover(directory)
    assert list(found) == ["first"] and found["first"].__name__ == "kinds_ok.one"


def test_two_modules_with_one_key_are_refused(tmp_path: Path) -> None:
    text = GOOD.format(key="same")
    directory = _package(tmp_path, "kinds_twice", {"a": text, "b": text})
    with pytest.raises(
        discovery.PluginError, match=r"kinds_twice\.b and kinds_twice\.a both define"
    ):
        _discover(directory)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Params = str\n", "lacks KEY, run, describe"),
        (GOOD.format(key="x").replace("def run", "def rnu"), "lacks run"),
        (GOOD.format(key="x") + "run = 3\n", "run must be a function"),
        (GOOD.format(key="not a name"), "KEY must be a name"),
    ],
)
def test_a_kind_missing_its_interface_is_refused_at_discovery(
    tmp_path: Path, text: str, message: str
) -> None:
    directory = _package(tmp_path, f"kinds_bad_{abs(hash(text))}", {"broken": text})
    with pytest.raises(discovery.PluginError, match=message):
        _discover(directory)


def test_the_shipped_kinds_pass_the_strict_discovery() -> None:
    assert {"shell", "command", "http", "verify", "ensure_alive", "wait"} <= set(actions.KINDS)
    assert {"http", "tcp", "command", "process"} <= set(probes.KINDS)
