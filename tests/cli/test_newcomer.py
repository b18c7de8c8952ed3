"""A newcomer's second hour (issue 42): what a new operator met, mended at its cause."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import Scenario, make_workspace
from support.standin import StandIn, free_port, python_env, ralph

from ralph_runner import events
from ralph_runner.output.lines import human_line

pytestmark = pytest.mark.timeout(60)


def test_status_of_a_workdir_that_does_not_exist_says_so_and_exits_2(tmp_path: Path) -> None:
    """Item 8: "no status ... (never run here?)", exit 1, for a typo in the path; the docs (and
    pause, resume and top) say "no such workdir", exit 2."""
    missing = tmp_path / "no-such-dir"
    shown = ralph("status", str(missing))
    assert shown.returncode == 2, (shown.returncode, shown.stderr)
    assert f"{missing}: no such workdir" in shown.stderr
    never = ralph("status", str(tmp_path))  # it exists: never run here is the right answer
    assert never.returncode == 1 and "never run here" in never.stderr, never.stderr


@pytest.mark.parametrize("module", ["server", "agent"])
def test_the_stand_ins_help_names_the_command_that_runs_it(module: str) -> None:
    """Item 9: the stand-in's `--help` said `usage: server.py`, a file no one can run."""
    shown = subprocess.run(
        [sys.executable, "-m", f"ralph_runner.standin.{module}", "--help"],
        env=python_env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"usage: python -m ralph_runner.standin.{module} ")


def test_deaths_and_report_read_this_directory_and_the_report_stays_out_of_the_repo(
    tmp_path: Path,
) -> None:
    """Item 6: `deaths` and `report` wanted a workdir argument where `status` and `top` take
    `.`, and `report .` wrote report.html into the agent's repository (its next iteration
    committed it): now both default to `.`, and the page goes to the workdir's .ralph/."""
    (tmp_path / ".ralph").mkdir()  # a workdir a run has used, with no death yet
    told = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "deaths"],
        cwd=tmp_path, env=python_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert told.returncode == 0 and "no deaths recorded" in told.stdout, told.stderr
    made = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "report"],
        cwd=tmp_path, env=python_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (tmp_path / ".ralph" / "report.html").is_file()
    assert not (tmp_path / "report.html").exists()
    assert "report: .ralph/report.html (0 deaths, 0 iterations" in made.stdout, made.stdout


DOCS = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_docs_minimal_runbook_passes_check_saved_outside_the_checkout(
    page: str, tmp_path: Path
) -> None:
    """Item 3: saved anywhere but runbooks/, `include: agents/opencode.yaml` was "no such file"
    (`use:` fell back to the shipped sets, `include:` did not), and `use: docker` failed on an
    undefined `container`: the page's runbook, as a newcomer saves it, passes `--check`."""
    text = (DOCS / page).read_text()
    found = re.search(
        r"```yaml\n((?:# yaml-language-server.*\n)?name: my loop\n.*?)```", text, re.S
    )
    assert found, f"{page} has no minimal runbook"
    saved = tmp_path / "my-loop.yaml"
    saved.write_text(found.group(1))
    make_workspace(tmp_path / "work", ["one"])
    checked = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(saved), "--check"],
        cwd=tmp_path / "work", env=python_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert "error" not in checked.stderr  # warnings only: opencode and the start script


def test_an_include_found_nowhere_names_every_place_it_was_looked_for(tmp_path: Path) -> None:
    """The fallback to the shipped copy is for a shipped file: a name found in neither place
    stays an error, at the include's line, naming both places."""
    saved = tmp_path / "loop.yaml"
    saved.write_text(
        "name: x\nprompt: p\nloop:\n  steps:\n    - include: agents/no-such-agent.yaml\n"
    )
    make_workspace(tmp_path / "work", ["one"])
    checked = ralph(str(saved), "--check")
    assert checked.returncode == 2, checked.stderr
    assert (
        f"{saved}:5:" in checked.stderr
        and "no such file: agents/no-such-agent.yaml" in checked.stderr
    )
    assert str(tmp_path / "agents" / "no-such-agent.yaml") in checked.stderr
    assert "runbooks/agents/no-such-agent.yaml" in checked.stderr


def test_a_wait_command_that_cannot_run_fails_at_once_and_teardown_knows_nothing_is_held(
    scenario: Scenario,
) -> None:
    """Item 1: a typo in `setup: - wait: {command: ...}` was 600 s of "no room", then exit 4;
    its `No such file or directory` showed only in teardown's error, which said "what setup
    holds may be held still" though nothing was acquired. Exit 127 is not a busy resource."""
    scenario.prepare(["one"])
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    typo = str(scenario.root / "gpu-shed")  # the scheduler's path, misspelt
    book["setup"] = [{"name": "acquire", "wait": {"command": f"{typo} acquire job 80", "max": 600}}]
    book["teardown"] = [{"name": "release", "shell": f"{typo} release job", "timeout": 10}]
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))

    run = scenario.start()
    assert run.wait(timeout=45) == 4, (run.events, run.stderr)  # not after `max` (600 s)
    setup, teardown = run.of("block-steps")
    assert setup["block"] == "setup" and setup["ok"] is False
    assert "cannot run (exit 127)" in setup["error"], setup
    assert "No such file or directory" in setup["error"] or "not found" in setup["error"], setup
    assert teardown["block"] == "teardown" and teardown["ok"] is False
    assert teardown["held"] is False, teardown
    shown = human_line(events.BlockSteps(**_fields(teardown)), lambda _colour, text: text)
    assert shown is not None and "setup acquired nothing" in shown
    assert "may be held still" not in shown


def test_a_failed_teardown_after_a_setup_that_acquired_still_says_it_may_hold(
    scenario: Scenario,
) -> None:
    """The other side of item 1: a setup step that succeeded may hold what teardown failed to
    release, and the line keeps saying so."""
    scenario.prepare(["one"])
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    book["setup"] = [{"name": "acquire", "shell": "true"}]
    book["teardown"] = [{"name": "release", "shell": "exit 3", "timeout": 10}]
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))

    run = scenario.start()
    assert run.wait() == 0, (run.events, run.stderr)
    (teardown,) = run.of("block-steps", block="teardown")
    assert teardown["ok"] is False and teardown["held"] is True, teardown
    shown = human_line(events.BlockSteps(**_fields(teardown)), lambda _colour, text: text)
    assert shown is not None and "may be held still" in shown


def _fields(event: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(events.BlockSteps)}
    return {key: value for key, value in event.items() if key in names}


@pytest.mark.timeout(90)
def test_demo_yaml_copied_into_ones_own_repository_runs_and_keeps_its_state_out(
    tmp_path: Path,
) -> None:
    """Item 2: `cp runbooks/demo.yaml` as the demo's "next:" says, run in one's own repo, was
    `start_server.sh: command not found` (exit 4) and `python: python3` (wrong outside the
    venv); item 7: its `.standin` state sat in the workdir for the agent to commit. Now the
    stand-in starts as `{{ ralph_python }} -m ralph_runner.standin.start`, its state under
    ~/.local/state/ralph-run/, and `--check` warns of nothing."""
    home, work = tmp_path / "home", make_workspace(tmp_path / "mine", ["first", "second"])
    home.mkdir()
    copied = work / "my-runbook.yaml"
    copied.write_text((DOCS / "runbooks" / "demo.yaml").read_text())
    subprocess.run(["git", "-C", str(work), "add", "my-runbook.yaml"], check=True)
    subprocess.run(["git", "-C", str(work), "commit", "-qm", "runbook"], check=True)
    port = free_port()
    state = home / ".local" / "state" / "ralph-run" / f"standin-{port}"
    env = python_env(HOME=str(home), PATH="/usr/bin:/bin")  # no venv, no `python` on PATH
    command = [sys.executable, "-m", "ralph_runner", "my-runbook.yaml", "-e", f"port={port}"]
    checked = subprocess.run(
        [*command, "--check"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr
    try:
        ran = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=80)
    finally:
        StandIn(state, port).stop()
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "- [x] first" in (work / "CHECKLIST.md").read_text()
    assert (state / "server.log").is_file()
    assert not (work / ".standin").exists()
    tracked = subprocess.run(
        ["git", "-C", str(work), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(tracked) == ["CHECKLIST.md", "PLAN.md", "my-runbook.yaml"], tracked


def test_the_stand_in_agent_ticks_its_own_item_so_two_workers_pass_verify(
    scenario: Scenario,
) -> None:
    """Item 5: the stand-in agent ticked the first open item, not the one in its prompt: with
    `workers: 2` the second worker's tick landed on the first worker's item and every parallel
    attempt failed verify. Each agent now ticks the item its prompt names."""
    items = ["alpha item", "beta item", "gamma item", "delta item"]
    scenario.prepare(items, agent_sleep="0.5")
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    book["loop"]["workers"] = 2
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))

    run = scenario.start()
    assert run.wait() == 0, (run.events, run.stderr)
    assert scenario.checklist() == "".join(f"- [x] {item}\n" for item in items)
    ended = run.of("iteration-ended")
    assert [e for e in ended if e["outcome"] != "done"] == [], ended  # was: "deferred", not ticked
    assert len(ended) == len(items) and run.of("worker-retry") == [], run.events
    assert len({e["worker"] for e in run.of("worker-started")}) == 2, run.of("worker-started")


def test_the_stand_in_agent_ticks_the_longest_item_its_prompt_names(tmp_path: Path) -> None:
    """ "fix" is in "fix the parser": the prompt's item is the longest open one it holds; a
    prompt naming none ticks the first open item, as before."""
    from ralph_runner.standin.agent import tick

    checklist = tmp_path / "CHECKLIST.md"
    checklist.write_text("- [ ] fix\n- [x] done\n- [ ] fix the parser\n")
    assert tick(checklist, "Do exactly this item: fix the parser") == "fix the parser"
    assert checklist.read_text() == "- [ ] fix\n- [x] done\n- [x] fix the parser\n"
    assert tick(checklist, "no item named here") == "fix"
    assert tick(checklist, "anything") is None


def test_status_shows_only_the_newest_runs_start_not_an_old_failed_one(scenario: Scenario) -> None:
    """Item 8: `status` showed the first run's failed start ("started: ... its start failed")
    after later good runs. A run's start is its own: the next run that finds the service up
    shows none."""
    scenario.prepare(["one", "two"], attempts=1, delay=0.1)
    scenario.standin.stop()
    (scenario.standin.state_dir / "fail_starts").write_text("9\n")  # "CUDA out of memory"
    first = scenario.start()
    assert first.wait() == 4, (first.events, first.stderr)
    shown = scenario.command("status")
    assert "start:      the service was not running at" in shown and "its start failed" in shown

    (scenario.standin.state_dir / "fail_starts").write_text("0\n")
    scenario.standin.start(HEALTH_TIMEOUT="1")
    second = scenario.start()
    assert second.wait() == 0, (second.events, second.stderr)
    shown = scenario.command("status")
    assert "finished" in shown, shown
    assert "start failed" not in shown and "the service was not running" not in shown, shown


def test_no_receipts_before_any_iteration_does_not_blame_the_proxy() -> None:
    """Item 8: `deaths` with the proxy on and 0 iterations said "(loop.proxy off)"."""
    from ralph_runner.deaths import stats

    none_yet = stats.throughput([])["too_little"]
    assert none_yet is not None and "proxy" not in none_yet and "no iterations" in none_yet
    without = stats.throughput([{"item": "a", "outcome": "done", "seconds": 3.0}])["too_little"]
    assert without is not None and "loop.proxy off" in without


@pytest.mark.parametrize("left", ["a committed tick and uncommitted work", "an uncommitted tick"])
def test_an_item_struck_for_its_uncommitted_work_is_not_counted_done(
    scenario: Scenario, left: str
) -> None:
    """Item 7: an item that got a strike for uncommitted changes still ended "done": its tick
    stayed in CHECKLIST.md and the next look found nothing to do. A failed attempt's tick is
    undone, so the item is tried again, struck each time, and skipped at `strikes` (3)."""
    leaves_work = left.endswith("uncommitted work")
    scenario.prepare(["one"], after_agent="echo more >> notes.txt" if leaves_work else "")
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    if not leaves_work:
        for step in book["loop"]["steps"]:
            if "shell" in step and "standin.agent" in step["shell"]:
                step["shell"] = step["shell"].replace(" -- ", " --no-commit -- ")
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))

    run = scenario.start()
    assert run.wait() == 0, (run.events, run.stderr)
    reasons = [e["reason"] for e in run.of("strike")]
    assert len(reasons) == 3, run.events
    wanted = "uncommitted changes" if leaves_work else "no new commit"
    assert all(wanted in reason for reason in reasons), reasons
    assert scenario.checklist() == "- [!] one\n"
    (summary,) = run.of("summary")
    assert summary["done"] == 0 and summary["skipped"] == 1, summary


def test_a_checklist_of_malformed_lines_says_nothing_to_do(scenario: Scenario) -> None:
    """Item 7: a CHECKLIST with 0 valid items and malformed lines ended "checklist finished",
    exit 0: the run says there was nothing to do, and why."""
    scenario.prepare(["one"])
    (scenario.workspace / "CHECKLIST.md").write_text("-[ ] one\n- [] two\n")
    subprocess.run(["git", "-C", str(scenario.workspace), "commit", "-qam", "typo"], check=True)
    run = scenario.start()
    assert run.wait() == 0, (run.events, run.stderr)
    (summary,) = run.of("summary")
    assert summary["malformed"] == 2 and summary["iterations"] == 0, summary
    names = {f.name for f in dataclasses.fields(events.Summary)}
    event = events.Summary(**{k: v for k, v in summary.items() if k in names})
    shown = human_line(event, lambda _colour, text: text)
    assert shown is not None and shown.startswith("nothing to do: no '- [ ]' item"), shown
    assert "2 lines like an item but not one" in shown, shown


@pytest.mark.parametrize(
    ("text", "where", "said"),
    [
        (
            "name: x\nprompt: p\nloop:\n  steps:\n    - shell: a\n   - shell: b\n",
            ":6:4:",
            "this line is indented differently from the lines before it",
        ),
        (
            "name: x\nprompt: p\nvars:\n  a: 1\n  b\n  c: 2\n",
            ":6:3:",
            "line 5 is text inside a mapping, with no `key:`",
        ),
        ("name: x\nprompt: p\n  loop: 1\n", ":3:7:", "a `key:` where no key can start"),
        ("name: x\nprompt: p\nloop:\n\tsteps: 1\n", ":4:1:", "a tab in the indentation"),
        (
            "name: x\nprompt: p\nloop:\n  steps: [{shell: a}]\nmax_iterations: 3\n",
            ":5:1:",
            "'max_iterations' is not a key here: it belongs to loop (is this line indented",
        ),
    ],
)
def test_indentation_mistakes_are_said_in_a_sentence_at_their_line(
    tmp_path: Path, text: str, where: str, said: str
) -> None:
    """Item 9: bad indentation gave raw PyYAML ("expected <block end>, but found '?'") or "it
    is a key elsewhere, not here" without saying where."""
    runbook = tmp_path / "loop.yaml"
    runbook.write_text(text)
    checked = ralph(str(runbook), "--check")
    assert checked.returncode == 2, checked.stderr
    assert f"{runbook}{where}" in checked.stderr and said in checked.stderr, checked.stderr
    assert "expected <block end>" not in checked.stderr and "Traceback" not in checked.stderr


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("echo {{ modle }}", "undefined variable 'modle' in template; did you mean 'model'?"),
        ("echo {{ model | uper }}", "no filter named 'uper'; did you mean 'upper'?"),
        ("echo {{ 'x' if 3 is od }}", "no test named 'od'; did you mean 'odd'?"),
    ],
)
def test_template_typos_get_a_did_you_mean(tmp_path: Path, template: str, said: str) -> None:
    """Item 9: `item.txt` had a did-you-mean, a variable, filter or test typo had none (and a
    filter typo in --check was an internal error, exit 70)."""
    runbook = tmp_path / "loop.yaml"
    book = {"name": "x", "prompt": "p", "vars": {"model": "m"}}
    book["loop"] = {"steps": [{"shell": template}]}
    runbook.write_text(yaml.safe_dump(book, sort_keys=False))
    checked = ralph(str(runbook), "--check")
    assert checked.returncode == 2, checked.stderr
    assert f"{runbook}:" in checked.stderr and said in checked.stderr, checked.stderr
