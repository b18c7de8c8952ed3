"""The documentation: the generated reference is current, the site builds offline with strict
link checking, and the README stays short and self-contained."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REGENERATE = ".venv/bin/ralph-run schema --markdown > docs/reference.md"
FORBIDDEN = ("../shared", "/work/shared", "DESIGN.md")
README_LIMIT = 12_000


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _schema_command(*args: str) -> str:
    """What `ralph-run schema ARGS` prints."""
    ralph_run = Path(sys.executable).parent / "ralph-run"
    command = [str(ralph_run)] if ralph_run.exists() else [sys.executable, "-m", "ralph_runner"]
    return subprocess.run(
        [*command, "schema", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def test_reference_is_the_schema_commands_current_output() -> None:
    current = _schema_command("--markdown")
    written = (DOCS / "reference.md").read_text(encoding="utf-8")
    assert written == current, f"docs/reference.md is stale: regenerate it with `{REGENERATE}`"


def _properties(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every key a JSON Schema declares, wherever it is (the root, $defs, anyOf, items...),
    as (where, its schema)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        properties = node.get("properties")
        if isinstance(properties, dict):
            found += [(f"{path}.properties.{key}", prop) for key, prop in properties.items()]
        for key, value in node.items():
            found += _properties(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _properties(value, f"{path}[{index}]")
    return found


def test_every_key_of_the_json_schema_has_a_description() -> None:
    """Editors show a key's description beside it (VS Code's YAML extension reads the file
    `ralph-run schema` writes): every key of the runbook language has one, and so every row of
    the reference has one (issue 31, item 13)."""
    schema = json.loads(_schema_command())
    keys = _properties(schema)
    assert len(keys) > 100, "the walk found too few keys to prove anything"
    missing = [
        where
        for where, prop in keys
        if not (isinstance(prop.get("description"), str) and prop["description"].strip())
    ]
    assert missing == [], f"keys without a description: {missing}"
    rows = [
        line
        for line in (DOCS / "reference.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `")
    ]
    assert rows and [row for row in rows if re.search(r"\|\s*\|$", row)] == []


def test_the_site_builds_strictly_and_offline(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip(f"no {mkdocs}: pip install -e '.[test]' installs mkdocs and mkdocs-material")
    built = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_the_site_fetches_no_fonts() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^\s+font: false", config, re.MULTILINE), "theme.font must be false"
    assert "strict: true" in config


def test_watching_shows_the_capture_top_s_test_wrote() -> None:
    """docs/watching.md's screen of `top` is the one tests/cli/test_top.py last captured."""
    capture = (ROOT / "docs" / "top-screen.txt").read_text(encoding="utf-8")
    assert f"```text\n{capture}```" in (ROOT / "docs" / "watching.md").read_text(encoding="utf-8")


def test_every_page_is_in_the_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*([\w/-]+\.md)\s*$", config, re.MULTILINE))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == listed


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes, more than {README_LIMIT}"


def test_readme_starts_with_the_demo_and_the_tests() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    head = text[:1000]
    demo = "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/ralph-run demo"
    tests = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && tests/run"
    assert demo in head and tests in head
    assert head.index(demo) < head.index(tests)


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_outside_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    for word in FORBIDDEN:
        assert word not in text, f"{path.relative_to(ROOT)} mentions {word!r}"


def test_readme_links_stay_inside_the_repository() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert "://" not in target and not target.startswith(("/", "mailto:")), target
        if not target.startswith("#"):
            assert (ROOT / target.split("#")[0]).exists(), f"README links to missing {target}"


def test_the_readme_docs_command_installs_an_extra_with_mkdocs() -> None:
    """The README's docs command works after the README's first install: it installs an extra
    that brings mkdocs and its theme, pinned as the test extra pins them (issue 31, item 11)."""
    import tomllib

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    (command,) = re.findall(r"`([^`]*mkdocs build[^`]*)`", text)
    install = re.search(r"\.venv/bin/pip install (?:-q )?-e '\.\[([\w,-]+)\]'", command)
    assert install, f"the README's docs command installs no extra: {command!r}"
    assert command.index(install.group(0)) < command.index(".venv/bin/mkdocs build --strict")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    wanted = [req for name in install.group(1).split(",") for req in extras[name]]
    names = {re.split(r"[<>=\[; ]", req, maxsplit=1)[0].lower() for req in wanted}
    assert {"mkdocs", "mkdocs-material"} <= names, wanted
    docs_pins = {req for req in wanted if req.lower().startswith("mkdocs")}
    test_pins = {req for req in extras["test"] if req.lower().startswith("mkdocs")}
    assert docs_pins == test_pins
