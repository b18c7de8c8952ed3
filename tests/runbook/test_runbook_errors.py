"""Bad runbooks, collector sets, templates, arguments: exit 2, file:line:col, key path."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.e2e import make_workspace

from ralph_runner import cli

GOOD = """\
name: t
vars:
  base_url: http://127.0.0.1:9/v1
health:
  probes:
    - name: models
      http: { url: "{{ base_url }}/models" }
loop:
  steps:
    - ensure_alive: { phase: start }
    - name: agent
      shell: echo {{ item.text }}
    - verify: {}
"""


def run_cli(tmp_path: Path, runbook: str, *args: str, files: dict[str, str] | None = None):
    """`ralph-run RUNBOOK --check ARGS` from a workdir a run would accept (a git repository with
    its CHECKLIST.md: --check fails without them, as the run does), the runbook beside it."""
    path = tmp_path / "runbook.yaml"
    path.write_text(textwrap.dedent(runbook))
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    work = make_workspace(tmp_path / "work", ["one"])
    with contextlib.chdir(work), pytest.raises(SystemExit) as exit_info:
        cli.main([str(path), "--check", *args])
    return exit_info.value.code, path


# (runbook text, expected line, expected key path, a phrase of the message)
CASES = {
    "yaml syntax": ("loop:\n  steps: [\n", 3, "", "invalid YAML"),
    "tab indentation": ("loop:\n\tsteps: []\n", 2, "", "invalid YAML"),
    "duplicate key": ("loop:\n  steps: []\nloop:\n  steps: []\n", 3, "", "duplicate key 'loop'"),
    "not a mapping": ("- just\n- a list\n", 1, "", "a runbook must be a mapping"),
    "missing loop": ("name: x\n", 1, "loop", "required key is missing"),
    "unknown top key": (GOOD + "helth: {}\n", 14, "helth", "did you mean 'health'"),
    "unknown task keyword": (
        GOOD.replace("      shell: echo", "      timout: 3\n      shell: echo"),
        12,
        "loop.steps[1].timout",
        "did you mean 'timeout'",
    ),
    "two actions in a task": (
        GOOD.replace("      shell: echo {{ item.text }}", "      shell: a\n      command: b"),
        11,
        "loop.steps[1]",
        "exactly one of",
    ),
    "no action in a task": (
        GOOD.replace("      shell: echo {{ item.text }}", "      timeout: 3"),
        11,
        "loop.steps[1]",
        "found none",
    ),
    "timeout not a number": (
        GOOD.replace("      shell: echo", "      timeout: soon\n      shell: echo"),
        12,
        "loop.steps[1].timeout",
        "valid number",
    ),
    "negative strikes": (
        GOOD + "checklist: { strikes: 0 }\n",
        14,
        "checklist.strikes",
        "greater than 0",
    ),
    "probe with two kinds": (
        GOOD.replace(
            '      http: { url: "{{ base_url }}/models" }',
            '      http: { url: "x" }\n      tcp: { host: a, port: 1 }',
        ),
        6,
        "health.probes[0]",
        "exactly one of",
    ),
    "unknown probe option": (
        GOOD.replace('http: { url: "{{ base_url }}/models" }', 'http: { url: "x", stauts: 200 }'),
        7,
        "health.probes[0].http.stauts",
        "did you mean 'status'",
    ),
    "steps not a list": ("loop:\n  steps: echo hi\n", 2, "loop.steps", "valid list"),
    "verify option typo": (
        GOOD.replace("    - verify: {}", "    - verify: { comitted: true }"),
        13,
        "loop.steps[2].verify.comitted",
        "did you mean 'committed'",
    ),
    "exit code out of range": (
        GOOD + "recovery: { exit_code: 300 }\n",
        14,
        "recovery.exit_code",
        "less than or equal to 255",
    ),
    "unknown collector set": (
        GOOD + "diagnostics:\n  collect:\n    - use: dokcer\n",
        16,
        "diagnostics.collect[0].use",
        "no collector set 'dokcer'",
    ),
    "missing include": (
        GOOD.replace("    - verify: {}", "    - include: nowhere.yaml"),
        13,
        "loop.steps[2].include",
        "no such file",
    ),
    "undefined variable in a step": (
        GOOD.replace("echo {{ item.text }}", "echo {{ modle }}"),
        12,
        "loop.steps[1].shell",
        "undefined variable 'modle'",
    ),
    "undefined variable in a var": (
        GOOD.replace("  base_url: http://127.0.0.1:9/v1", "  base_url: http://{{ hostt }}/v1"),
        3,
        "vars.base_url",
        "undefined variable 'hostt'",
    ),
    "jinja syntax error": (
        GOOD.replace("echo {{ item.text }}", "echo {{ item.text }"),
        12,
        "loop.steps[1].shell",
        "",
    ),
    "bad hosts pattern": (GOOD + "hosts: gpu_hostz\n", 14, "hosts", "gpu_hostz"),
    "probe port neither a number nor a template": (
        GOOD.replace('http: { url: "{{ base_url }}/models" }', "tcp: { port: eighty }"),
        7,
        "health.probes[0].tcp.port",
        "valid integer",
    ),
    "bad regular expression": (
        GOOD.replace('http: { url: "{{ base_url }}/models" }', 'process: { cmdline: "vllm[" }'),
        7,
        "health.probes[0].process.cmdline",
        "not a regular expression",
    ),
    "templated port that renders to a word": (
        GOOD.replace('http: { url: "{{ base_url }}/models" }', 'tcp: { port: "{{ base_url }}" }'),
        7,
        "health.probes[0].tcp",
        "once rendered: port",
    ),
    "secret that names no variable": (
        GOOD + "secrets: [base_url, api_kee]\n",
        14,
        "secrets[1]",
        "api_kee",
    ),
    "undefined variable in a recovery step, at its shell line": (
        GOOD + "recovery:\n  steps:\n    - name: restart\n      shell: docker rm {{ contaner }}\n",
        17,
        "recovery.steps[0].shell",
        "undefined variable 'contaner'",
    ),
    "undefined variable in a task's vars, at its line": (
        GOOD.replace("      shell: echo", "      vars: { x: '{{ ready }}' }\n      shell: echo"),
        12,
        "loop.steps[1].vars.x",
        "undefined variable 'ready'",
    ),
    "secrets not a list": (GOOD + "secrets: token\n", 14, "secrets", "valid list"),
    "unknown key in a pause step": (
        GOOD + "pause:\n  - name: stop vLLM\n    shel: docker stop vllm\n",
        16,
        "pause[0].shel",
        "did you mean 'shell'",
    ),
    "a rejuvenation's decode drop of more than all of it": (
        GOOD.replace("loop:\n", "  rejuvenate: { decode_drop: 1.5 }\nloop:\n"),
        8,
        "health.rejuvenate.decode_drop",
        "less than 1",
    ),
    "a rejuvenation step's when naming no field of death": (
        GOOD.replace(
            "loop:\n",
            "  rejuvenate:\n    steps:\n      - name: restart\n        shell: x\n"
            "        when: death.hang\nloop:\n",
        ),
        12,
        "health.rejuvenate.steps[0].when",
        "did you mean death.hung?",
    ),
    "a rejuvenation with no /metrics to read": (
        GOOD.replace("loop:\n", "  rejuvenate: { decode_drop: 0.3 }\nloop:\n"),
        8,
        "health.rejuvenate",
        "reads the server's /metrics: add a `progress` probe",
    ),
    "a loop step in the resume block": (
        GOOD + "resume:\n  - name: x\n    verify: {}\n",
        16,
        "resume[0].verify",
        "not in resume",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_runbook(tmp_path, capsys, name):
    text, line, path, phrase = CASES[name]
    code, runbook = run_cli(tmp_path, text)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert f"{runbook}:{line}:" in err, err
    if path:
        assert f": {path}: " in err, err
    assert phrase in err


def test_bad_collector_set_names_its_own_file(tmp_path, capsys):
    code, _ = run_cli(
        tmp_path,
        GOOD + "diagnostics:\n  collect:\n    - use: mine\n",
        files={"collectors/mine.yaml": "collect:\n  - name: x\n    shel: echo\n"},
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"{tmp_path / 'collectors' / 'mine.yaml'}:3:5: collect[0].shel" in err
    assert "did you mean 'shell'" in err


def test_several_errors_reported_at_once(tmp_path, capsys):
    text = GOOD.replace("      shell: echo", "      timout: 3\n      shell: echo") + "helth: {}\n"
    code, _ = run_cli(tmp_path, text)
    err = capsys.readouterr().err
    assert code == 2
    assert "timout" in err and "helth" in err


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["-e", "novalue"], "-e"),
        (["-e", "@missing.yaml"], "missing.yaml"),
        (["-e", "{not json"], "-e"),
        (["--limit", "nohost"], "nohost"),
        (["-i", "no-inventory.yaml"], "no-inventory.yaml"),
    ],
)
def test_bad_arguments(tmp_path, capsys, args, phrase):
    code, _ = run_cli(tmp_path, GOOD, *args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert phrase in err
    assert "Traceback" not in err


@pytest.mark.system  # runs ralph-run
def test_missing_runbook_and_unknown_option_exit_2_without_traceback(tmp_path):
    for argv in (
        ["ralph-run", str(tmp_path / "nope.yaml"), "--check"],
        ["ralph-run", "x", "--bogus"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "ralph_runner", *argv[1:]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2
        assert "Traceback" not in done.stderr
        assert done.stderr.strip()


def test_verify_committed_outside_a_git_repository_is_refused_before_the_loop(tmp_path, capsys):
    runbook = tmp_path / "runbook.yaml"
    runbook.write_text(
        f"workdir: {tmp_path}\nloop:\n  steps:\n    - shell: touch RAN\n    - verify: {{}}\n"
    )
    (tmp_path / "CHECKLIST.md").write_text("- [ ] one\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(runbook)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"{runbook}:5:7: loop.steps[1].verify: verify needs a commit" in err
    assert not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("section", ["recovery:\n  steps", "diagnostics:\n  collect"])
@pytest.mark.parametrize("action", ["verify: {}", "ensure_alive: { phase: x }"])
def test_a_loop_step_outside_the_loop_is_refused_at_its_line(tmp_path, capsys, section, action):
    """`verify` and `ensure_alive` need the loop: in a recovery or a capture they once passed
    --check and crashed at the first death."""
    code, runbook = run_cli(tmp_path, f"{GOOD}{section}:\n    - name: x\n      {action}\n")
    err = capsys.readouterr().err
    where = section.replace(":\n  ", ".")
    kind = action.split(":")[0]
    assert code == 2, err
    assert f"{runbook}:17:7: {where}[0].{kind}: '{kind}' is a loop step" in err, err


def test_a_loop_step_in_an_included_recovery_file_is_refused_at_its_line(tmp_path, capsys):
    code, _ = run_cli(
        tmp_path,
        GOOD + "recovery:\n  steps:\n    - include: restart.yaml\n",
        files={"restart.yaml": "- shell: docker restart vllm\n- verify: {}\n"},
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{tmp_path / 'restart.yaml'}:2:3: tasks[1].verify: 'verify' is a loop step" in err
    assert "not in recovery.steps" in err


@pytest.mark.parametrize(
    ("change", "line", "path", "names"),
    [
        (
            ("    - verify: {}", "    - verify: {}\n      when: item.attemps > 1"),
            14,
            "when",
            "'item'",
        ),
        (("    - verify: {}", "    - verify: {}\n      when: '{{ redy }}'"), 14, "when", "'redy'"),
        (
            ("    - verify: {}", "    - verify: {}\n      until: reslt.rc == 0"),
            14,
            "until",
            "'reslt'",
        ),
    ],
)
def test_check_finds_undefined_names_in_when_and_until(tmp_path, capsys, change, line, path, names):
    """--check renders no `when:` (it may test a result registered by an earlier step), but
    names nothing defines are found at their line."""
    code, runbook = run_cli(tmp_path, GOOD.replace(*change))
    err = capsys.readouterr().err
    if names == "'item'":  # `item` exists: only its missing field would fail, at run time
        assert code == 0, err
        return
    assert code == 2, err
    assert f"{runbook}:{line}:7: loop.steps[2].{path}: undefined variable {names}" in err, err


def test_check_accepts_registered_results_and_guarded_names(tmp_path, capsys):
    text = GOOD.replace(
        "    - verify: {}",
        "    - shell: make test\n      register: tests\n      ignore_errors: true\n"
        "    - verify: {}\n      when: tests.rc == 0 and (gpu is defined or extra | default(1))",
    )
    code, _ = run_cli(tmp_path, text)
    assert code == 0, capsys.readouterr().err


def test_check_finds_an_undefined_name_in_the_prompt(tmp_path, capsys):
    code, runbook = run_cli(tmp_path, GOOD + "prompt: 'Do {{ item.text }} with {{ modle }}'\n")
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{runbook}:14:1: prompt: undefined variable 'modle'" in err, err


@pytest.mark.parametrize(
    "value", ["{{ '%s'.format_map }}", "{{ lookup }}", "{{ range }}", "{{ 'x'.upper }}"]
)
def test_a_var_that_renders_to_a_function_is_refused_at_its_place(tmp_path, capsys, value):
    """Issue 29, finding 15: `{{ '%s'.format_map }}` in a var rendered `<function ...>` into
    the steps that used it, exit 0; the same in the prompt was refused. A value that is a
    function (or a class) is an error at its own position, wherever it is."""
    book = GOOD.replace(
        "  base_url: http://127.0.0.1:9/v1\n",
        f'  base_url: http://127.0.0.1:9/v1\n  fn: "{value}"\n',
    )
    book = book.replace("shell: echo {{ item.text }}", "shell: echo {{ fn }} {{ item.text }}")
    code, runbook = run_cli(tmp_path, book)
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{runbook}:4:3: vars.fn: the template gives a function" in err, err
