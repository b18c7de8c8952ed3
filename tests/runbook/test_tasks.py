"""Task keywords through real runs: a runbook whose loop steps use them, checked through the
files those steps write (`when`, `register`, `until`/`retries`/`delay`, `ignore_errors`, `env`,
`vars`, `timeout`, `command`, `include`, `wait`)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.standin import process_gone, wait_for

pytestmark = pytest.mark.timeout(60)

RALPH = [sys.executable, "-m", "ralph_runner"]

HEADER = """\
name: task keywords
workdir: work
vars:
  out: "{{ runbook_dir }}/out"
  python: PYTHON
checklist: { path: CHECKLIST.md, strikes: 1 }
loop:
  max_iterations: 4
  steps:
"""
# The last step of every test loop: tick the item so that the next iteration takes the next one.
TICK = r"""
- name: tick
  shell: sed -i '0,/^- \[ \] /s//- [x] /' CHECKLIST.md
"""


class Book:
    """A runbook in tmp_path/book/, a plain work directory, and the steps' output directory."""

    def __init__(self, tmp_path: Path, steps: str, items: tuple[str, ...] = ("the item",)) -> None:
        self.root = tmp_path
        self.out = tmp_path / "book" / "out"
        self.out.mkdir(parents=True)
        self.work = tmp_path / "work"
        self.work.mkdir()
        (self.work / "CHECKLIST.md").write_text("".join(f"- [ ] {item}\n" for item in items))
        self.path = tmp_path / "book" / "runbook.yaml"
        body = textwrap.indent(textwrap.dedent(steps).strip() + TICK, "    ")
        self.path.write_text(HEADER.replace("PYTHON", json.dumps(sys.executable)) + body)

    def argv(self) -> list[str]:
        return [*RALPH, str(self.path), "--json"]

    def run(self, **env: str) -> tuple[int, list[dict[str, Any]]]:
        done = subprocess.run(
            self.argv(),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env},
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]

    def read(self, name: str) -> str:
        return (self.out / name).read_text()

    def lines(self, name: str) -> list[str]:
        return self.read(name).splitlines()


def phase(book: Book) -> str | None:
    try:
        return json.loads((book.work / ".ralph" / "status.json").read_text()).get("phase")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def test_when_false_skips_the_task(tmp_path):
    book = Book(
        tmp_path,
        """
        - name: only later
          when: iteration > 1
          shell: echo no > {{ out }}/later
        - name: never
          when: false
          shell: echo no > {{ out }}/never
        - name: this item
          when: item.text == 'the item' and checklist.todo == 1
          shell: echo yes > {{ out }}/this
        """,
    )
    code, events = book.run()
    assert code == 0
    assert sorted(p.name for p in book.out.iterdir()) == ["this"]
    assert [e["step"] for e in kinds(events, "step-done") if e["ok"]] == [
        "only later",
        "never",
        "this item",
        "tick",
    ]


def counting(steps: str) -> str:
    """Each `COUNT NAME` in `steps` becomes: add one to out/NAME, note the time, print the count."""

    def count(name: str) -> str:
        file = "{{ out }}/" + name
        return (
            f"n=$(( $(cat {file} 2>/dev/null || echo 0) + 1 )); echo $n > {file}; "
            f"date +%s.%N >> {file}-times; echo $n"
        )

    return re.sub(r"COUNT (\w+)", lambda m: count(m[1]), steps)


def test_register_until_retries_delay_with_ansible_semantics(tmp_path):
    book = Book(
        tmp_path,
        counting("""
        - name: count until 3
          shell: "COUNT up"
          register: counter
          until: counter.stdout | trim | int >= 3
          retries: 5
          delay: 0.2
        - name: report
          shell: echo {{ counter.attempts }} {{ counter.stdout | trim }} > {{ out }}/report
        - name: never true
          shell: "COUNT never"
          register: never
          until: never.rc == 42
          retries: 2
          delay: 0
          ignore_errors: true
        - name: default retries
          shell: "COUNT default"
          register: default
          until: default.rc == 42
          delay: 0
          ignore_errors: true
        - name: retries without until retry until success
          shell: "COUNT plain; test $n -ge 2"
          retries: 4
          delay: 0
        - name: results
          shell: echo {{ never.failed }} {{ never.attempts }} > {{ out }}/never-result
        """),
    )
    code, _ = book.run()
    assert code == 0
    assert book.read("report") == "3 3\n"  # attempts counted, until saw the registered stdout
    times = [float(t) for t in book.lines("up-times")]
    assert len(times) == 3 and all(b - a >= 0.2 for a, b in itertools.pairwise(times))
    assert book.read("never") == "3\n"  # retries: 2 -> one run plus two retries
    assert book.read("never-result") == "True 3\n"
    assert book.read("default") == "4\n"  # until with no retries: Ansible's default of 3
    assert book.read("plain") == "2\n"  # stopped at the first success


def test_ignore_errors_goes_on_and_a_failure_without_it_stops_the_attempt(tmp_path):
    book = Book(
        tmp_path,
        """
        - name: fails, ignored
          shell: echo partial; exit 3
          register: ignored
          ignore_errors: true
        - name: fails on the second item
          when: item.index == 1
          shell: exit 4
        - name: after
          shell: echo {{ item.text }} {{ ignored.rc }} {{ ignored.failed }} >> {{ out }}/after
        """,
        items=("first", "second"),
    )
    code, events = book.run()
    assert code == 0
    assert book.lines("after") == ["first 3 True"]  # the second item's attempt stopped at exit 4
    assert [e["item"] for e in kinds(events, "done")] == ["first"]
    (strike,) = kinds(events, "strike")
    assert strike["item"] == "second" and strike["reason"] == "fails on the second item: exit 4"
    assert (book.work / "CHECKLIST.md").read_text() == "- [x] first\n- [!] second\n"


def test_env_is_added_to_the_inherited_environment_and_vars_stay_in_their_task(tmp_path):
    book = Book(
        tmp_path,
        """
        - name: env
          shell: echo "$GREETING|$FROM_RALPH|$ITEM|$COUNT" > {{ out }}/env
          env: { GREETING: hello, ITEM: "{{ item.text }}", COUNT: 3 }
        - name: vars
          vars: { who: "{{ item.text | upper }}", n: 7 }
          shell: echo {{ who }} {{ n + 1 }} > {{ out }}/vars
        - name: no leak
          when: who is defined
          shell: echo leaked > {{ out }}/leak
        """,
    )
    code, _ = book.run(FROM_RALPH="inherited")
    assert code == 0
    assert book.read("env") == "hello|inherited|the item|3\n"
    assert book.read("vars") == "THE ITEM 8\n"
    assert not (book.out / "leak").exists()


def test_timeout_kills_the_task_and_registers_timed_out(tmp_path):
    book = Book(
        tmp_path,
        """
        - name: too slow
          shell: >-
            {{ python }} -c 'import time; time.sleep(30)' {{ out }};
            echo late > {{ out }}/late
          timeout: 0.5
          register: slow
          ignore_errors: true
        - name: result
          shell: echo {{ slow.timed_out }} {{ slow.failed }} > {{ out }}/timeout
        """,
    )
    started = time.monotonic()
    code, events = book.run()
    assert code == 0 and time.monotonic() - started < 15
    assert book.read("timeout") == "True True\n" and not (book.out / "late").exists()
    (slow,) = [e for e in kinds(events, "step-done") if e["step"] == "too slow"]
    assert slow["timed_out"] and 0.5 <= slow["seconds"] < 5
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(book.out) in " ".join(p.info["cmdline"] or []) and not process_gone(p.pid)
    ]


def test_command_passes_argv_without_a_shell(tmp_path):
    book = Book(
        tmp_path,
        """
        - name: argv
          command:
            - "{{ python }}"
            - -c
            - WRITER
            - "{{ out }}/argv"
            - a b; $HOME `id` *
            - "{{ item.text }}"
        - name: a string is rendered, then split like a shell would
          command: "{{ python }} -c \\"WRITER\\" {{ out }}/split 'one two' {{ item.text }}"
        - name: no shell, so no redirection
          command: echo hi > {{ out }}/redirected
        """.replace("WRITER", "import sys; open(sys.argv[1], 'w').write(repr(sys.argv[2:]))"),
        items=("it's $(touch pwned)",),
    )
    code, _ = book.run()
    assert code == 0
    assert book.read("argv") == repr(["a b; $HOME `id` *", "it's $(touch pwned)"])
    assert book.read("split") == repr(["one two", "it's $(touch pwned)"])
    assert not (book.out / "redirected").exists() and not (book.work / "pwned").exists()


def test_include_runs_a_task_file_relative_to_the_runbook(tmp_path):
    book = Book(
        tmp_path,
        """
        - name: before
          shell: echo before >> {{ out }}/order
        - include: tasks/more.yaml
          vars: { label: from-include }
        - name: after
          shell: echo after >> {{ out }}/order
        """,
    )
    (book.path.parent / "tasks").mkdir()
    (book.path.parent / "tasks" / "more.yaml").write_text(
        textwrap.dedent(
            """\
            - name: included one
              shell: echo {{ label }} one >> {{ out }}/order
            - name: included two
              shell: echo {{ label }} two {{ item.text }} >> {{ out }}/order
            """
        )
    )
    code, events = book.run()
    assert code == 0
    assert book.lines("order") == [
        "before",
        "from-include one",
        "from-include two the item",
        "after",
    ]
    steps = [e["step"] for e in kinds(events, "step")]
    assert steps == ["before", "included one", "included two", "after", "tick"]


def test_wait_pauses_and_wakes_at_once_on_sigterm(tmp_path):
    book = Book(
        tmp_path,
        """
        - name: before
          shell: date +%s.%N > {{ out }}/before
        - wait: 0.5
        - name: after
          shell: date +%s.%N > {{ out }}/after
        - name: long wait
          when: iteration == 1
          wait: 30
        """,
    )
    process = subprocess.Popen(book.argv(), cwd=book.root, stdout=subprocess.PIPE, text=True)
    try:
        # the shell creates the file before `date` writes into it: wait for the line
        wait_for(
            lambda: (book.out / "after").exists() and book.read("after").endswith("\n"),
            15,
            "the step after the wait",
        )
        assert float(book.read("after")) - float(book.read("before")) >= 0.5
        wait_for(lambda: phase(book) == "long wait", 10, "the long wait to start")
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 143
        assert time.monotonic() - started < 3
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
