"""templating.py: shell strings stay safe under hostile text (checked with real bash), the sandbox
holds, every error names its place, and Ansible's filters, tests and lookups work."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ralph_runner.errors import FatalError, Problem
from ralph_runner.templating import Templar, has_template

pytestmark = pytest.mark.timeout(60)

WHERE = Problem("", "runbooks/vllm.yaml", 42, 14, "loop.steps[1].shell")
HOSTILE = [
    "$(touch X)",
    "`touch X`",
    "'; touch X; '",
    '"; touch X; "',
    "a b",
    "first line\nsecond; touch X\n",
    "${IFS}touch${IFS}X",
    "* ~ ?",
    "-n",
    "'",
    "",
    "항목: $(touch X) 고치기",
]


@pytest.fixture
def templar(tmp_path: Path) -> Templar:
    return Templar(tmp_path)


def arguments(templar: Templar, text: str, cwd: Path) -> list[str]:
    """The argv that real bash hands to a command when `text` is rendered into a shell string."""
    command = templar.render(
        "printf '%s\\0' {{ item.text }} > args.bin", {"item": {"text": text}}, shell=True
    )
    subprocess.run(["bash", "-c", command], cwd=cwd, check=True, timeout=10)
    received = (cwd / "args.bin").read_bytes().decode()
    return received.split("\0")[:-1]


# ---- shell quoting ------------------------------------------------------------------------


@pytest.mark.parametrize("text", HOSTILE)
def test_item_text_reaches_the_command_as_exactly_one_argument(
    templar: Templar, tmp_path: Path, text: str
) -> None:
    (tmp_path / "decoy").write_text("")  # an unquoted * would expand to it

    assert arguments(templar, text, tmp_path) == [text]
    assert not (tmp_path / "X").exists()


@settings(max_examples=40, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")))
def test_any_text_is_one_argument(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    cwd = tmp_path_factory.mktemp("any")
    assert arguments(Templar(cwd), text, cwd) == [text]


def test_numbers_and_plain_words_stay_unquoted(templar: Templar) -> None:
    variables = {"port": 8000, "ratio": 0.9, "model": "Qwen/Qwen3-32B", "gpus": -1}
    rendered = templar.render(
        "vllm --port {{ 8000 }} {{ port }} --model {{ model }} -r {{ ratio }} {{ gpus }}",
        variables,
        shell=True,
    )
    assert rendered == "vllm --port 8000 8000 --model Qwen/Qwen3-32B -r 0.9 -1"


def test_none_is_an_empty_word_in_shell_and_nothing_in_text(templar: Templar) -> None:
    assert templar.render("run {{ x }} end", {"x": None}, shell=True) == "run '' end"
    assert templar.render("run {{ x }} end", {"x": None}) == "run  end"


def test_safe_inserts_raw_shell(templar: Templar, tmp_path: Path) -> None:
    command = templar.render("{{ steps | safe }}", {"steps": "echo one; echo two"}, shell=True)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=10)
    assert done.stdout == "one\ntwo\n"


def test_quote_filter_is_not_quoted_twice(templar: Templar) -> None:
    assert templar.render("echo {{ x | quote }}", {"x": "a b"}, shell=True) == "echo 'a b'"
    assert templar.render("echo {{ x | quote }}", {"x": "a b"}) == "echo 'a b'"


def test_html_escaping_is_no_opt_out_of_shell_quoting(templar: Templar) -> None:
    variables = {"x": "$(touch X)"}
    assert templar.render("{{ x | e }}", variables, shell=True) == "'$(touch X)'"
    assert templar.render("{{ x | tojson }}", variables, shell=True) == "'\"$(touch X)\"'"


def test_literal_text_and_control_structures_are_not_quoted(templar: Templar) -> None:
    rendered = templar.render(
        "for f in {% for name in names %}{{ name }} {% endfor %}; do echo $f; done",
        {"names": ["a b", "c"]},
        shell=True,
    )
    assert rendered == "for f in 'a b' c ; do echo $f; done"


def test_go_template_braces(templar: Templar) -> None:
    raw = "{% raw %}docker ps --format '{{.Status}}'{% endraw %}"
    assert templar.render(raw, {}, shell=True) == "docker ps --format '{{.Status}}'"
    literal = "docker ps --format {{ '{{.Names}} {{.Status}}' }}"
    assert templar.render(literal, {}, shell=True) == "docker ps --format '{{.Names}} {{.Status}}'"


# ---- errors ---------------------------------------------------------------------------------


def test_undefined_variable_names_it_and_the_place(templar: Templar) -> None:
    with pytest.raises(FatalError) as caught:
        templar.render("opencode run --model {{ model }}", {}, shell=True, where=WHERE)
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column) == ("runbooks/vllm.yaml", 42, 14)
    assert problem.path == "loop.steps[1].shell"
    assert problem.message == "undefined variable 'model' in template"


def test_undefined_in_a_long_template_gives_the_template_line(templar: Templar) -> None:
    with pytest.raises(FatalError, match=r"'checklst' in template \(line 3 of the template\)"):
        templar.render("Read PLAN.md.\nDo: {{ item.text }}\n{{ checklst.todo }} left\n", _item())


def test_missing_key_suggests_the_close_one(templar: Templar) -> None:
    with pytest.raises(FatalError, match=r"undefined attribute 'txt'.*did you mean 'text'\?"):
        templar.render("{{ item.txt }}", _item())


def test_default_works_on_missing_chains(templar: Templar) -> None:
    assert templar.render("{{ result.stdout | default('none') }}", {}) == "none"
    assert templar.render("{{ result.stdout | d('none') }}", {"result": {}}) == "none"
    assert templar.render("{{ '' | default('x', true) }}", {}) == "x"


def test_syntax_error_gives_the_template_line(templar: Templar) -> None:
    with pytest.raises(FatalError) as caught:
        templar.render("line one\n{{ item.text }\n", _item(), where=WHERE)
    (problem,) = caught.value.problems
    assert problem.line == 42
    assert problem.message.startswith("template syntax error:")
    assert problem.message.endswith("(line 2 of the template)")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ lookup.__globals__ }}",
        "{{ item.update({'text': 'changed'}) }}",
    ],
)
def test_sandbox_refuses(templar: Templar, template: str) -> None:
    variables = _item()
    with pytest.raises(FatalError, match="unsafe template") as caught:
        templar.render(template, variables, where=WHERE)
    assert caught.value.problems[0].file == "runbooks/vllm.yaml"
    assert variables["item"]["text"] == "fix the parser"


@pytest.mark.parametrize(
    "template",
    [
        "{{ [range] }}",
        "{{ {'a': lookup} }}",
        "{{ 'a' ~ range }}",
        "{{ x ~ [range] }}",
        "{{ ''.format_map | string }}",
        "{{ [range] | join }}",
        "{{ range | pprint }}",
        "{{ [range] | to_json }}",
        "{{ '%s' % range }}",
        "{{ '%s' % (range,) }}",
        "{{ '{}'.format(range) }}",
        "{% for f in [range] %}{{ f }}{% endfor %}",
    ],
)
@pytest.mark.parametrize("shell", [False, True])
def test_a_function_never_becomes_text(templar: Templar, template: str, shell: bool) -> None:
    """A function in a list, joined by `~`, `%`, `.format()` or made text by a filter rendered
    as its repr (issue 37): the same error at the template's place as a bare one."""
    with pytest.raises(FatalError) as caught:
        templar.render(template, {"x": "x"}, shell=shell, where=WHERE)
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.column) == ("runbooks/vllm.yaml", 42, 14)
    assert problem.message.startswith("the template gives a function ("), problem.message
    assert problem.message.endswith("), not a value")
    with pytest.raises(FatalError, match="gives a function"):
        templar.render_data({"a": "{{ [range] }}"}, {}, where=WHERE)


def test_values_still_join_format_and_filter(templar: Templar) -> None:
    variables = {"x": "x", "items": ["a", "b"]}
    assert templar.render("{{ 'a' ~ 1 ~ x }}|{{ '%s-%d' % ('a', 2) }}|{{ 10 % 3 }}", variables) == (
        "a1x|a-2|1"
    )
    assert templar.render("{{ '{}'.format(3) }}|{{ items | map('upper') | join }}", variables) == (
        "3|AB"
    )
    assert templar.render("{% for i in range(2) %}{{ loop.index }}{% endfor %}", {}) == "12"


def test_runtime_errors_are_fatal_not_tracebacks(templar: Templar) -> None:
    with pytest.raises(FatalError, match="ZeroDivisionError"):
        templar.render("{{ 1 / 0 }}", {})
    with pytest.raises(FatalError, match="JSONDecodeError"):
        templar.render("{{ x | from_json }}", {"x": "{not json"})


# ---- filters and tests ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ x | quote }}", "'it'\"'\"'s'"),
        ("{{ data | to_json }}", '{"b": [1, 2], "a": "\\u00e9"}'),
        (
            "{{ data | to_nice_json }}",
            '{\n    "a": "\\u00e9",\n    "b": [\n        1,\n        2\n    ]\n}',
        ),
        ("{{ ('{\"k\": [3]}' | from_json).k[0] }}", "3"),
        ("{{ data | to_yaml }}", "a: é\nb: [1, 2]\n"),
        ("{{ ('k: [4, 5]' | from_yaml).k[1] }}", "5"),
        (r"{{ log | regex_search('blocks (\\d+) < len') }}", "blocks 25 < len"),
        (
            r"{{ log | regex_search('(\\d+) < len\\(req_blocks\\) (\\d+)', '\\2', '\\1') }}",
            "['26', '25']",
        ),
        ("{{ log | regex_search('ENGINEDEAD', ignorecase=true) }}", "EngineDead"),
        ("{{ log | regex_search('nothing') }}", ""),
        (
            r"{{ log | regex_replace('\\d+', 'N') }}",
            "num_required_blocks N < len(req_blocks) N; EngineDeadError",
        ),
        (r"{{ log | regex_findall('\\d+') }}", "['25', '26']"),
        ("{{ path | basename }}", "start_vllm.sh"),
        ("{{ path | dirname }}", "~/gpu-scheduler"),
        (
            "{{ 'yes' | bool }} {{ 'off' | bool }} {{ 1 | bool }} {{ none | bool }}",
            "True False True False",
        ),
        ("{{ '42' | int + 1 }}", "43"),
        ("{{ 'ralph 루프' | b64encode }}", "cmFscGgg66Oo7ZSE"),
        ("{{ 'cmFscGgg66Oo7ZSE' | b64decode }}", "ralph 루프"),
        ("{{ x | mandatory }}", "it's"),
        ("{{ log is match('num_') }} {{ log is match('Engine') }}", "True False"),
        ("{{ log is search('Engine') }} {{ log is search('^Engine') }}", "True False"),
    ],
)
def test_filter(templar: Templar, template: str, expected: str) -> None:
    variables = {
        "x": "it's",
        "data": {"b": [1, 2], "a": "é"},
        "log": "num_required_blocks 25 < len(req_blocks) 26; EngineDeadError",
        "path": "~/gpu-scheduler/start_vllm.sh",
        "none": None,
    }
    assert templar.render(template, variables) == expected


LOG = "num_required_blocks 25 < len(req_blocks) 26; EngineDeadError"
DATA = {"b": [1, 2], "a": "é", "nested": {"k": None}}


@pytest.mark.parametrize(
    ("name", "value", "args"),
    [
        ("quote", "it's $(x)", ()),
        ("quote", None, ()),
        ("to_json", DATA, ()),
        ("to_nice_json", DATA, ()),
        ("from_json", '{"k": [1, "x"]}', ()),
        ("to_yaml", DATA, ()),
        ("from_yaml", "k: [1, 2]\nv: yes\n", ()),
        ("regex_search", LOG, (r"(\d+) < len\(req_blocks\) (\d+)", r"\2", r"\1")),
        ("regex_search", LOG, (r"blocks \d+",)),
        ("regex_search", LOG, ("absent",)),
        ("regex_replace", LOG, (r"(\d+)", r"<\1>")),
        ("regex_findall", LOG, (r"\d+",)),
        ("basename", "~/gpu-scheduler/start_vllm.sh", ()),
        ("dirname", "~/gpu-scheduler/start_vllm.sh", ()),
        ("bool", "yes", ()),
        ("bool", "Off", ()),
        ("bool", 1, ()),
        ("b64encode", "ralph 루프", ()),
        ("b64decode", "cmFscGgg66Oo7ZSE", ()),
    ],
)
def test_filters_agree_with_ansible(
    templar: Templar, name: str, value: object, args: tuple
) -> None:
    core = pytest.importorskip("ansible.plugins.filter.core")
    expected = core.FilterModule().filters()[name](value, *args)
    rendered = templar.render_data(
        f"{{{{ value | {name}(*args) }}}}", {"value": value, "args": args}
    )
    assert rendered == expected


def test_mandatory_names_the_missing_variable(templar: Templar) -> None:
    with pytest.raises(FatalError, match="mandatory variable 'base_url' not defined"):
        templar.render("{{ base_url | mandatory }}", {})
    with pytest.raises(FatalError, match="set base_url in the inventory"):
        templar.render("{{ base_url | mandatory('set base_url in the inventory') }}", {})


# ---- lookups --------------------------------------------------------------------------------


def test_file_lookup_is_relative_to_base_dir(tmp_path: Path) -> None:
    (tmp_path / "PLAN.md").write_text("# Plan\nbuild it\n\n")
    templar = Templar(tmp_path, cwd=Path("/"))
    assert templar.render("{{ lookup('file', 'PLAN.md') }}", {}) == "# Plan\nbuild it"
    absolute = str(tmp_path / "PLAN.md")
    assert templar.render("{{ lookup('file', p, rstrip=false) }}", {"p": absolute}).endswith("\n\n")


def test_missing_file_lookup_is_fatal(templar: Templar) -> None:
    with pytest.raises(FatalError, match=r"lookup\('file', 'PLAN.md'\).*No such file") as caught:
        templar.render("{{ lookup('file', 'PLAN.md') }}", {}, where=WHERE)
    assert caught.value.problems[0].path == "loop.steps[1].shell"


def test_env_lookup(templar: Templar, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALPH_TEST_TOKEN", "abc")
    monkeypatch.delenv("RALPH_TEST_UNSET", raising=False)
    assert templar.render("{{ lookup('env', 'RALPH_TEST_TOKEN') }}", {}) == "abc"
    assert templar.render("[{{ lookup('env', 'RALPH_TEST_UNSET') }}]", {}) == "[]"
    fallback = "{{ lookup('env', 'RALPH_TEST_UNSET', default='x') }}"
    assert templar.render(fallback, {}) == "x"
    both = "{{ query('env', 'RALPH_TEST_TOKEN', 'RALPH_TEST_UNSET') }}"
    assert templar.render(both, {}) == "['abc', '']"


def test_pipe_lookup_runs_in_cwd_and_strips_the_newline(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    templar = Templar(Path("/"), cwd=tmp_path)
    assert templar.render("{{ lookup('pipe', 'pwd') }}", {}) == str(tmp_path)
    assert templar.render("{{ lookup('pipe', 'git rev-parse --is-inside-work-tree') }}", {}) == (
        "true"
    )
    prompt = "log:\n{{ lookup('pipe', 'printf \"a\\nb\\n\\n\"') }}\nend"
    assert templar.render(prompt, {}) == "log:\na\nb\nend"


def test_failing_pipe_is_fatal_with_its_output(templar: Templar) -> None:
    with pytest.raises(FatalError) as caught:
        templar.render("{{ lookup('pipe', 'echo broken >&2; exit 3') }}", {}, where=WHERE)
    (problem,) = caught.value.problems
    assert "exit code 3" in problem.message
    assert "broken" in problem.message
    assert problem.line == 42


def test_pipe_timeout_is_fatal_and_leaves_no_process(tmp_path: Path) -> None:
    templar = Templar(tmp_path, pipe_timeout=0.5)
    # A duration of this test's own: no other test's sleep (pytest-xdist runs three) matches it.
    seconds = f"31.{uuid.uuid4().int % 10**12:012d}"
    started = time.monotonic()
    with pytest.raises(FatalError, match=r"timed out after 0\.5 s"):
        templar.render(f"{{{{ lookup('pipe', 'sleep {seconds} & sleep {seconds}') }}}}", {})
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 5
    while _processes(["sleep", seconds]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes(["sleep", seconds]) == []


def test_check_mode_runs_no_pipe(tmp_path: Path) -> None:
    templar = Templar(tmp_path, check=True)
    rendered = templar.render("{{ lookup('pipe', 'touch ran') }}", {})
    assert "not run in --check" in rendered
    assert not (tmp_path / "ran").exists()


def test_unknown_lookup_lists_the_known_ones(templar: Templar) -> None:
    with pytest.raises(FatalError, match=r"unknown lookup 'url' \(known: env, file, pipe\)"):
        templar.render("{{ lookup('url', 'http://x') }}", {})


# ---- data, expressions, analysis ------------------------------------------------------------


def test_render_data_keeps_native_values(templar: Templar) -> None:
    data = {
        "url": "{{ base_url }}/models",
        "port": "{{ port }}",
        "tokens": " {{- 1 + 1 -}} ",
        "hosts": ["{{ hosts }}", "{{ hosts | length }} hosts", 7, None],
        "raw": "{{ 'a;b' | safe }}",
    }
    variables = {"base_url": "http://127.0.0.1:8000/v1", "port": 8000, "hosts": ["a", "b"]}
    assert templar.render_data(data, variables) == {
        "url": "http://127.0.0.1:8000/v1/models",
        "port": 8000,
        "tokens": 2,
        "hosts": [["a", "b"], "2 hosts", 7, None],
        "raw": "a;b",
    }
    assert type(templar.render_data("{{ 'a' | safe }}", {})) is str


def test_render_data_error_names_the_nested_key(templar: Templar) -> None:
    where = Problem("", "runbooks/vllm.yaml", 12, 7, "health.probes[0].http")
    with pytest.raises(FatalError) as caught:
        templar.render_data({"url": "{{ base }}/models"}, {}, where=where)
    (problem,) = caught.value.problems
    assert problem.path == "health.probes[0].http.url"
    assert (problem.line, problem.message) == (12, "undefined variable 'base' in template")


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("result.rc == 0", True),
        ("result.rc != 0", False),
        ("'ready' in out.stdout", True),
        ("'Engine' in out.stdout", False),
        ("{{ result.rc == 0 and attempts < 3 }}", True),
        ("attempts + 1", 3),
        (True, True),
        (False, False),
    ],
)
def test_evaluate_when_and_until(
    templar: Templar, expression: str | bool, expected: object
) -> None:
    variables = {"result": {"rc": 0}, "out": {"stdout": "server ready\n"}, "attempts": 2}
    assert templar.evaluate(expression, variables) == expected


def test_evaluate_errors_are_fatal(templar: Templar) -> None:
    with pytest.raises(FatalError, match="undefined variable 'result'"):
        templar.evaluate("result.rc == 0", {}, where=WHERE)
    with pytest.raises(FatalError, match="template syntax error"):
        templar.evaluate("result.rc ==", {"result": {}})


def test_text_templates_with_loops_keep_their_shape(templar: Templar) -> None:
    report = (
        "== death {{ deaths }} ==\n"
        "{% for probe in probes %}- {{ probe.name }}: {{ 'ok' if probe.ok else probe.reason }}\n"
        "{% endfor %}"
    )
    probes = [{"name": "models", "ok": False, "reason": "refused"}, {"name": "gen", "ok": True}]
    rendered = templar.render(report, {"deaths": 2, "probes": probes})
    assert rendered == "== death 2 ==\n- models: refused\n- gen: ok\n"


def test_undefined_names_for_check(templar: Templar) -> None:
    template = (
        "{% for f in files %}{{ f }} {{ model }}{% endfor %}{% set n = 1 %}{{ n }}"
        "{{ out.stdout | default('') }}{% if gpu is defined %}{{ gpu.name }}{% endif %}"
        "{{ lookup('env', 'HOME') }} {{ item.text }}"
    )
    assert templar.undefined_names(template, {"files": [], "item": {}}) == {"model"}
    with pytest.raises(FatalError, match="template syntax error"):
        templar.undefined_names("{% for %}", {}, where=WHERE)


def test_has_template() -> None:
    assert has_template("{{ x }}")
    assert has_template("{% raw %}x{% endraw %}")
    assert has_template("a {# note #}")
    assert not has_template("docker ps --format table")
    assert not has_template("")


def _processes(cmdline: list[str]) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["cmdline"] == cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def _item() -> dict:
    return {"item": {"text": "fix the parser", "line": 3, "index": 0, "attempts": 0}}
