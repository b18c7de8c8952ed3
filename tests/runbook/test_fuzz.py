"""The fuzz corpus: whatever an attacker or a careless operator types, `ralph-run --check` ends
with exit 0 or 2 (never a traceback, never another code) and within 10 s.

Hypothesis generates runbooks (valid ones with fuzzed subtrees, and raw YAML text with control
characters, tags, anchors, aliases, merge keys and deep nesting), inventories, `-e` values
(KEY=VALUE, @file, JSON) and host patterns, and drives the real entry point, `cli.main`, in this
process. The profile is derandomized and database-less so CI runs the same cases every time;
RALPH_FUZZ_SCALE=10 runs ten times as many (a deeper run before a release).
The named cases at the top are the inputs that once crashed ralph-run (issue 11).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import string
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ralph_runner import cli
from ralph_runner.runbook import yamlfile

CASE_SECONDS = 10.0  # the bound for one input
SCALE = float(os.environ.get("RALPH_FUZZ_SCALE", "1"))

settings.register_profile(
    "fuzz",
    derandomize=True,
    database=None,
    deadline=None,  # each case is timed by the test itself, against CASE_SECONDS
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=False,
)


def examples(count: int) -> settings:
    return settings(settings.get_profile("fuzz"), max_examples=max(1, int(count * SCALE)))


BASE = {
    "name": "fuzz",
    "hosts": "localhost",
    "vars": {"port": 8000, "base_url": "http://127.0.0.1:{{ port }}/v1", "api_key": "k-123456"},
    "secrets": ["api_key"],
    "checklist": {"path": "CHECKLIST.md", "strikes": 3},
    "prompt": "Do this: {{ item.text }}",
    "health": {
        "probes": [{"name": "models", "http": {"url": "{{ base_url }}/models"}, "timeout": 1}],
        "failures_before_dead": 2,
        "interval": 0.5,
    },
    "diagnostics": {
        "log": "logs/deaths.log",
        "collect": [{"use": "git"}, {"name": "tail", "shell": "tail -n 5 log.txt"}],
    },
    "recovery": {"steps": [{"name": "restart", "shell": "echo up {{ port }}"}], "attempts": 2},
    "loop": {
        "max_iterations": 3,
        "steps": [
            {"ensure_alive": {"phase": "start"}},
            {"name": "agent", "shell": "echo {{ item.text }}", "timeout": 5},
            {"verify": {"checked": True, "committed": False}},
        ],
    },
}

# ---- the entry point, in-process -------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    """A directory with a checklist; the fuzzed files are written into it, case after case."""
    path = tmp_path_factory.mktemp("fuzz")
    (path / "CHECKLIST.md").write_text("- [ ] one item\n- [ ] two\n")
    previous = Path.cwd()
    os.chdir(path)
    yield path
    os.chdir(previous)


def check(argv: list[str]) -> tuple[int, str]:
    """`ralph-run ARGV --check`: its exit code and what it printed; fails on anything else."""
    out = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main([*argv, "--check"])
        except SystemExit as exc:
            code = exc.code
        else:
            raise AssertionError("cli.main returned instead of exiting")
    seconds = time.monotonic() - started
    text = out.getvalue()
    assert code in (0, 2), f"exit {code} for {argv}:\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    assert "internal error" not in text, text[-3000:]
    assert seconds < CASE_SECONDS, f"{seconds:.1f} s for {argv}"
    if code == 2:
        assert "ralph-run: error: " in text, text[-3000:]
    return code, text


def check_runbook(workdir: Path, text: str, *args: str) -> tuple[int, str]:
    (workdir / "runbook.yaml").write_text(text, encoding="utf-8", errors="surrogatepass")
    return check(["runbook.yaml", *args])


# ---- the inputs that once crashed (issue 11), by name --------------------------------


def _laughs(levels: int = 9) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for n in range(1, levels):
        lines.append(f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]")
    return "\n".join(lines)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


LOOP = "loop:\n  steps: [{shell: echo hi}]\n"
CRASHES = {
    "control character": ('name: "a\x01b"\n' + LOOP, "character #x0001 is not allowed"),
    "raw control character": ("name: a\x07b\n" + LOOP, "is not allowed"),
    "!!int abc": ("name: !!int abc\n" + LOOP, "!!int 'abc'"),
    "!!float abc": ("vars: {a: !!float abc}\n" + LOOP, "!!float 'abc'"),
    "register without action": ("loop:\n  steps: [{register: x}]\n", "exactly one of"),
    "recursive alias": ("vars: {a: &a [*a]}\n" + LOOP, "recursive alias"),
    "recursive merge": ("vars: &a {<<: *a}\n" + LOOP, "recursive alias"),
    "500-deep nesting": (f"vars: {{a: {_deep(500)}}}\n" + LOOP, "nested deeper than"),
    "1200-deep block nesting": (
        "vars:\n" + "".join(f"{' ' * (i + 1)}k:\n" for i in range(1200)) + LOOP,
        "nested deeper than",
    ),
    "alias bomb in vars": (
        "vars:\n" + "\n".join("  " + line for line in _laughs().splitlines()) + "\n" + LOOP,
        "aliases are expanded",
    ),
    "alias bomb in name": (_laughs() + "\nname: *l8\n" + LOOP, "aliases are expanded"),
    "alias as a key": ("l0: &k [a, b]\n? *k\n: x\n" + LOOP, "a mapping key must be a plain scalar"),
    "deep via aliases": (
        f"a: &a {'[' * 40}x{']' * 40}\nb: {'[' * 40}*a{']' * 40}\n{LOOP}",
        "aliases expanded",
    ),
    "string repetition bomb": ("vars: {x: \"{{ 'a' * 10**10 }}\"}\n" + LOOP, "'*' would make"),
    "list repetition bomb": ('vars: {x: "{{ [1] * 10**9 }}"}\n' + LOOP, "'*' would make"),
    "power bomb": ('vars: {x: "{{ 10 ** 100000000 }}"}\n' + LOOP, "'**' would make"),
    "vars doubling each other": (
        "vars:\n  a00: aaaaaaaaaaaaaaaa\n"
        + "".join(f'  a{i:02d}: "{{{{ a{i - 1:02d} ~ a{i - 1:02d} }}}}"\n' for i in range(1, 40))
        + LOOP,
        "over ralph-run's bound",
    ),
    "var renders to a function": (  # refused at its place (issue 29, finding 15)
        'vars: {f: "{{ range }}"}\n' + LOOP,
        "vars.f: the template gives a function",
    ),
    "unknown tag": ("name: !python/object x\n" + LOOP, "could not determine a constructor"),
    "binary and timestamp values": ("vars: {b: !!binary aGk=, t: 2001-01-01}\n" + LOOP, None),
    "checklist name too long": (  # no such checklist (the run refuses it too), no traceback
        f"checklist: {{path: {'C' * 300}.md}}\n" + LOOP,
        "checklist.path: no checklist at",
    ),
    "metrics directory name too long": (
        f"metrics: {{textfile: {'d' * 300}/x.prom}}\n" + LOOP,
        "no such directory for the metrics textfile",
    ),
}


@pytest.mark.parametrize("case", CRASHES, ids=list(CRASHES))
def test_inputs_that_once_crashed(workdir: Path, case: str) -> None:
    text, message = CRASHES[case]
    code, output = check_runbook(workdir, text)
    if message is None:
        assert code == 0, output
    else:
        assert code == 2 and message in output, output


def test_an_alias_bomb_stops_in_well_under_a_second(workdir: Path) -> None:
    for where in ("vars", "inventory", "-e @file"):
        bomb = _laughs(12)  # 9**12 values if expanded
        started = time.monotonic()
        if where == "vars":
            code, output = check_runbook(workdir, "vars:\n  b: 1\n" + bomb + "\n" + LOOP)
        elif where == "inventory":
            (workdir / "inventory.yaml").write_text(f"all:\n  vars:\n    x: 1\n{bomb}\n")
            code, output = check_runbook(workdir, LOOP, "-i", "inventory.yaml")
        else:
            (workdir / "vars.yaml").write_text(bomb + "\n")
            code, output = check_runbook(workdir, LOOP, "-e", "@vars.yaml")
        assert time.monotonic() - started < 1.0, where
        assert code == 2 and "aliases are expanded" in output, output


def test_deep_json_in_extra_vars(workdir: Path) -> None:
    code, output = check_runbook(workdir, LOOP, "-e", '{"a": ' + _deep(3000) + "}")
    assert code == 2 and "nested deeper than" in output, output
    assert len(output) < 400, "the -e value is shortened in its message"
    (workdir / "deep.json").write_text('{"a": ' + _deep(3000) + "}")
    code, output = check_runbook(workdir, LOOP, "-e", "@deep.json")
    assert code == 2 and "nested deeper than" in output, output


def test_a_file_over_the_size_bound(workdir: Path) -> None:
    big = "vars:\n" + "".join(f"  v{i}: {'x' * 60}\n" for i in range(yamlfile.MAX_BYTES // 60))
    code, output = check_runbook(workdir, big + LOOP)
    assert code == 2 and "-byte bound for a YAML file" in output, output
    code, output = check_runbook(workdir, LOOP, "-e", "@/dev/zero")
    assert code == 2 and "bound" in output, output


def test_bounds_leave_real_files_alone(workdir: Path) -> None:
    """Real runbooks nest a handful of levels and share blocks with a few aliases."""
    text = "vars:\n  defaults: &d {timeout: 5, retries: 2, env: {A: '1'}}\n"
    text += "".join(f"  host{i}: {{<<: *d, port: {8000 + i}}}\n" for i in range(500))
    text += "  nested: " + _deep(yamlfile.MAX_DEPTH - 3) + "\n"
    code, output = check_runbook(workdir, text + LOOP)
    assert code == 0, output


# ---- strategies ----------------------------------------------------------------------

CONTROL = "".join(chr(c) for c in [*range(0, 32), 127, *range(128, 160)])
JINJA = st.sampled_from(
    [
        "{{ port }}",
        "{{ nope }}",
        "{{ item.text }}",
        "{{ range }}",
        "{{ lookup }}",
        "{{ ''.__class__ }}",
        "{{ 1/0 }}",
        "{{",
        "{% if %}",
        "{{ base_url | regex_replace('(', '') }}",
        "{{ port | int + 1 }}",
        "{{ {'a': 1} }}",
        "{{ [1, 2] }}",
        "{{ none }}",
        "{# c #}",
        "{{ lookup('env', 'HOME') }}",
        "{{ lookup('nope') }}",
        "{{ x | default(1) }}",
        "{{ '{{.Status}}' }}",
    ]
)
TEXT = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=CONTROL + "ab:{}[]&*!|>-#'\"%@`", max_size=20),
    JINJA,
    st.builds(lambda a, b: f"{a}{b}", st.text(max_size=8), JINJA),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
KEYS = st.one_of(
    st.sampled_from(
        ["name", "shell", "vars", "when", "until", "timeout", "register", "use", "include"]
    ),
    st.text(max_size=10),
    st.integers(-3, 3),
    st.booleans(),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=4),
    max_leaves=12,
)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found += _paths(value, (*prefix, index))
    return found


def _replace(data: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    copy = dict(data) if isinstance(data, dict) else list(data)
    copy[path[0]] = _replace(copy[path[0]], path[1:], value)
    return copy


@st.composite
def mutated_runbooks(draw: st.DrawFn) -> Any:
    """BASE with one to three subtrees replaced by fuzzed values, or keys added."""
    data: Any = BASE
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(data)[1:]))  # the root: one case, "not a mapping"
        target, how = _get(data, path), draw(st.integers(0, 3))
        if how <= 1 and isinstance(target, str):  # mostly the values a runbook could hold
            data = _replace(data, path, draw(TEXT))
        elif how <= 1 and not isinstance(target, dict | list):
            data = _replace(data, path, draw(SCALARS))
        elif how == 2 and isinstance(target, dict):
            extra = draw(st.dictionaries(KEYS, VALUES, min_size=1, max_size=2))
            data = _replace(data, path, {**target, **extra})
        else:
            data = _replace(data, path, draw(VALUES))
    return data


def _get(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


BASE_TEXT = _dump(BASE)
SNIPPETS = st.sampled_from(
    [
        "&a ",
        "*a",
        "&b [*a, *a]",
        "<<: *a\n",
        "!!int ",
        "!!float ",
        "!!binary ",
        "!!timestamp ",
        "!!set ",
        "!!omap ",
        "!!python/name:os.system ",
        "!local ",
        "? ",
        "[",
        "]",
        "{",
        "}",
        ": ",
        "- ",
        "\t",
        "\n",
        "---\n",
        "...\n",
        "%YAML 1.1\n",
        "'",
        '"',
        "\\x01",
        "\x00",
        "\x1b",
        "\ufeff",
        "\u2028",
        "\U0001f480",
        "{{ ",
        " }}",
        "|\n",
        ">-\n",
    ]
)


@st.composite
def mutated_texts(draw: st.DrawFn) -> str:
    """BASE's YAML text with snippets, control characters and nesting spliced in."""
    text = BASE_TEXT
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from([0, 0, 0, 1, 2, 3]))
        if kind == 0:
            piece = draw(SNIPPETS)
        elif kind == 1:
            piece = draw(st.text(alphabet=CONTROL, min_size=1, max_size=3))
        elif kind == 2:
            depth = draw(st.sampled_from([1, 10, 63, 64, 65, 200, 999, 1001]))
            piece = draw(st.sampled_from(["[", "{a: "])) * depth
        else:
            piece = draw(st.text(st.characters(exclude_categories=["Cc", "Cs"]), max_size=10))
        text = text[:at] + piece + text[at:]
    return text


@st.composite
def anchored_documents(draw: st.DrawFn) -> str:
    """Variables made of anchors and aliases: fan-out, chains, cycles, merges, alias keys."""
    levels = draw(st.integers(1, 10))
    fan = draw(st.integers(1, 12))
    first = draw(st.sampled_from(["[x, y]", "{x: 1, y: '{{ port }}'}", "'{{ port }}'"]))
    lines = ["vars:", "  port: 8000", f"  a0: &a0 {first}"]
    for n in range(1, levels):
        aliases = ", ".join([f"*a{draw(st.integers(0, n - 1))}"] * fan)
        shape = draw(st.sampled_from(["[{}]", "{{m: [{}]}}", "{{<<: *a0, k: [{}]}}"]))
        lines.append(f"  a{n}: &a{n} " + shape.format(aliases))
    last = f"*a{levels - 1}"
    where = draw(st.sampled_from(["  v", "  ? *a0\n  ", "name", "prompt", "hosts"]))
    tail = draw(st.sampled_from([last, "*a0", "&c [*c]", "{<<: *a0}", "&d {<<: *d}"]))
    return "\n".join(lines) + f"\n{where}: {tail}\n" + LOOP


# ---- the fuzz tests ------------------------------------------------------------------


@examples(500)
@given(data=mutated_runbooks(), as_json=st.booleans())
def test_fuzzed_runbook_structure(workdir: Path, data: Any, as_json: bool) -> None:
    check_runbook(workdir, _dump(data), *(["--json"] if as_json else []))


@examples(500)
@given(text=mutated_texts())
def test_fuzzed_runbook_text(workdir: Path, text: str) -> None:
    check_runbook(workdir, text)


@examples(200)
@given(text=anchored_documents())
def test_fuzzed_aliases(workdir: Path, text: str) -> None:
    check_runbook(workdir, text)


HOST_NAMES = st.one_of(
    st.sampled_from(["web1", "gpu-a", "localhost", "127.0.0.1", "::1", "web[01:03]", "h[a:c]"]),
    st.sampled_from(["web[1:", "x[3:1]", "y[01:3]", "z[a:9]", "h:22", "[::1]:22", "w[1:9:0]"]),
    st.text(max_size=12),
)


GROUPS = st.sampled_from(["all", "web", "gpu", "ungrouped", "x"])


@st.composite
def inventories(draw: st.DrawFn) -> Any:
    hosts = draw(st.dictionaries(HOST_NAMES, st.none() | VALUES, max_size=4))
    groups = {
        name: draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "hosts": st.none() | st.just(hosts) | VALUES,
                    "children": st.none() | st.dictionaries(GROUPS, st.none() | VALUES, max_size=2),
                    "vars": st.none() | VALUES,
                },
            )
        )
        for name in draw(st.lists(GROUPS, max_size=3))
    }
    return draw(st.sampled_from([groups, {"all": {"hosts": hosts}}, draw(VALUES)]))


PATTERNS = st.one_of(
    st.text(alphabet=string.ascii_lowercase[:4] + "0123456789,:&!~*?[].-_ ", max_size=16),
    st.sampled_from(["all", "web:&gpu", "all:!web1", "~web[0-9", "web[0:1]", "!", "&", ",", ""]),
)


@examples(400)
@given(inventory=inventories(), hosts=PATTERNS, limit=st.none() | PATTERNS)
def test_fuzzed_inventories_and_patterns(
    workdir: Path, inventory: Any, hosts: str, limit: str | None
) -> None:
    (workdir / "inventory.yaml").write_text(_dump(inventory))
    args = ["-i", "inventory.yaml", *(["--limit", limit] if limit is not None else [])]
    check_runbook(workdir, _dump({**BASE, "hosts": hosts}), *args)


@st.composite
def extra_vars(draw: st.DrawFn, files: Path) -> list[str]:
    values = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 4))
        if kind == 0:
            key = draw(st.sampled_from(["port", "x", "1a", "", "a-b"]) | st.text(max_size=5))
            values.append(f"{key}={draw(TEXT)}")
        elif kind == 1:
            values.append(json.dumps(draw(VALUES)))
        elif kind == 2:
            depth = draw(st.sampled_from([1, 63, 64, 65, 3000]))
            values.append('{"a": ' + _deep(depth) + "}")
        elif kind == 3:
            path = files / f"vars{draw(st.integers(0, 2))}.yaml"
            text = draw(st.one_of(st.builds(_dump, VALUES), mutated_texts(), anchored_documents()))
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
            values.append(f"@{path.name}")
        else:
            values.append(draw(st.text(max_size=20)))
    return values


@examples(400)
@given(data=st.data())
def test_fuzzed_extra_vars(workdir: Path, data: st.DataObject) -> None:
    values = data.draw(extra_vars(workdir))
    check_runbook(workdir, BASE_TEXT, *[word for value in values for word in ("-e", value)])
