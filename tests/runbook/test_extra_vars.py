"""`-e` extra variables as ansible-playbook takes them: `key=value` words, JSON and YAML
objects, `@file`; and what a malformed one says."""

from __future__ import annotations

from pathlib import Path

import pytest

from ralph_runner.errors import FatalError, Problem
from ralph_runner.runbook import inventory


def test_extra_vars_forms(tmp_path):
    yaml_file = tmp_path / "vars.yaml"
    yaml_file.write_text("model: qwen\nlimits: {tokens: 4096}\n")
    json_file = tmp_path / "vars.json"
    json_file.write_text('{\n\t"model": "llama",\n\t"port": 8001\n}\n')
    assert inventory.parse_extra_vars(
        [
            "a=1 b='two words' c=x=y",
            f"@{yaml_file}",
            '{"a": 10, "list": [1, 2]}',
            "{flow: yaml, a: 11}",
            f"@{json_file}",
            "",
            "empty=",
        ]
    ) == {
        "a": 11,
        "b": "two words",
        "c": "x=y",
        "model": "llama",
        "limits": {"tokens": 4096},
        "list": [1, 2],
        "flow": "yaml",
        "port": 8001,
        "empty": "",
    }
    assert inventory.parse_extra_vars([]) == {}


MALFORMED_EXTRA_VARS = {
    "no equals sign": (
        "foo",
        "-e 'foo': 'foo' is not KEY=VALUE;"
        " expected KEY=VALUE, @FILE (YAML or JSON) or a JSON/YAML mapping",
    ),
    "a word without value among pairs": (
        "cmd=echo $HOME",
        "-e 'cmd=echo $HOME': '$HOME' is not KEY=VALUE; expected KEY=VALUE, @FILE (YAML or JSON)"
        " or a JSON/YAML mapping; quote a value with spaces: -e 'key=\"a b\"'",
    ),
    "bad JSON": (
        '{"model": "qwen",',
        '-e \'{"model": "qwen",\': invalid YAML: expected the node content, but found'
        " '<stream end>'"
        " at column 18; expected a JSON or YAML mapping",
    ),
    "a list instead of a mapping": (
        "[1, 2]",
        "-e '[1, 2]': expected a mapping of variables, found a list",
    ),
    "a file without @": (
        "./vars.yaml",
        "-e './vars.yaml': a file of variables needs a leading '@': -e '@./vars.yaml'",
    ),
    "not a variable name": ("1x=2", "-e '1x=2': '1x' is not a valid variable name"),
    "unbalanced quote": ("a='open", '-e "a=\'open": No closing quotation; expected KEY=VALUE'),
}


@pytest.mark.parametrize(
    ("value", "message"), MALFORMED_EXTRA_VARS.values(), ids=MALFORMED_EXTRA_VARS.keys()
)
def test_malformed_extra_vars(value, message):
    with pytest.raises(FatalError) as caught:
        inventory.parse_extra_vars(["ok=1", value])
    assert caught.value.problems == [Problem(message)]


def test_extra_vars_file_missing_or_not_a_mapping(tmp_path, monkeypatch):
    # Relative names: the message shortens a long argument (as a pytest-xdist worker's tmp_path).
    monkeypatch.chdir(tmp_path)
    missing = Path("missing.yaml")
    with pytest.raises(FatalError) as caught:
        inventory.parse_extra_vars([f"@{missing}"])
    assert caught.value.problems == [Problem(f"-e '@{missing}': file not found", str(missing))]

    listed = Path("list.yaml")
    listed.write_text("---\n- model: qwen\n")
    with pytest.raises(FatalError) as caught:
        inventory.parse_extra_vars([f"@{listed}"])
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column, problem.path) == (str(listed), 2, 1, "")
    assert problem.message == (
        f"-e '@{listed}': the file must hold a mapping of variable names to values, found a list"
    )
