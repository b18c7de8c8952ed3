"""`--check`'s warnings (issue 42): what would not stop the run at once but would waste it is
said before the run, at its file and line, and the exit stays 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.e2e import make_workspace
from support.standin import free_port, python_env

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
WARNING = "ralph-run: warning: "


def check(runbook: Path, work: Path, *extra: str) -> tuple[int, list[str], str]:
    """`ralph-run RUNBOOK --check` run in `work`: its exit, its warning lines, its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(runbook), "--check", *extra],
        cwd=work, env=python_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    said = [line for line in done.stderr.splitlines() if line.startswith(WARNING)]
    assert len(said) == len(done.stderr.splitlines()), done.stderr  # nothing else on stderr
    return done.returncode, said, done.stdout


def write(path: Path, book: dict) -> Path:
    path.write_text(yaml.safe_dump(book, sort_keys=False))
    return path


def test_every_command_the_run_will_start_is_looked_for(tmp_path: Path) -> None:
    """The first word of each loop, setup, teardown, recovery and wait command: a typo is
    named at its line; a builtin, a program on PATH and an assignment before it are not."""
    work = make_workspace(tmp_path / "work", ["one"])
    script = tmp_path / "release.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    book = {
        "name": "x",
        "prompt": "p",
        "setup": [{"name": "acquire", "wait": {"command": f"{tmp_path}/gpu-shed acquire"}}],
        "teardown": [{"name": "release", "shell": f"{script} release"}],
        "recovery": {"steps": [{"name": "start", "shell": "FOO=1 no-such-starter --now"}]},
        "loop": {
            "steps": [
                {"name": "agent", "shell": "opencodee run hello"},
                {"name": "builtin", "shell": "kill -0 $$ && echo ok"},
                {"name": "on path", "command": ["git", "status"]},
                {"name": "made at run time", "shell": "$(which git) status"},
            ]
        },
    }
    runbook = write(tmp_path / "loop.yaml", book)
    code, said, _ = check(runbook, work)
    assert code == 0, said
    text = "\n".join(said)
    assert f"{runbook}:5:" in text and f"`{tmp_path}/gpu-shed`: no such file" in text, text
    assert "recovery step 'start': `no-such-starter` not found on PATH" in text, text
    assert "loop step 'agent': `opencodee` not found on PATH" in text, text
    assert len(said) == 3, said  # release.sh, kill, git and $(...) are fine


def test_a_script_that_is_not_executable_is_said(tmp_path: Path) -> None:
    work = make_workspace(tmp_path / "work", ["one"])
    script = tmp_path / "start.sh"
    script.write_text("#!/bin/sh\n")  # no chmod +x: bash says "Permission denied", 126
    book = {"name": "x", "prompt": "p", "loop": {"steps": [{"shell": f"{script} go"}]}}
    code, said, _ = check(write(tmp_path / "loop.yaml", book), work)
    assert code == 0 and len(said) == 1, said
    assert f"`{script}`: not an executable file" in said[0]


def test_llama_cpp_with_a_missing_model_and_server_is_warned_and_workers_and_proxy_told(
    tmp_path: Path,
) -> None:
    """Item 4: `runbooks/llama-cpp.yaml -e model_path=/nonexistent --check` passed, and the
    run failed 31 s later with llama-server not installed; `--check` said nothing of
    `workers` or `proxy`."""
    work = make_workspace(tmp_path / "work", ["one"])
    missing = tmp_path / "no-such-model.gguf"
    runbook = ROOT / "runbooks" / "llama-cpp.yaml"
    code, said, plan = check(
        runbook, work, "-e", f"model_path={missing}", "-e", "llama_server=no-such-llama-server"
    )
    assert code == 0, said
    text = "\n".join(said)
    assert f"needs.files[0]: no such file: {missing}" in text, text
    assert "needs.commands[0]: `no-such-llama-server` not found on PATH" in text, text
    shown = yaml.safe_load(plan)["loop"]
    assert shown["workers"].startswith("1: one item at a time"), shown
    assert shown["proxy"].startswith("on: the agent's requests go through a loopback proxy")

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    _, said, _ = check(
        runbook, work, "-e", f"model_path={model}", "-e", f"llama_server={sys.executable}"
    )
    assert not [line for line in said if "needs." in line], said


def test_a_checklist_with_nothing_to_do_and_malformed_lines_is_warned(tmp_path: Path) -> None:
    """Item 7: a CHECKLIST with 0 valid items and malformed lines ran "finished", exit 0, and
    `--check` warned of nothing."""
    work = make_workspace(tmp_path / "work", ["one"])
    (work / "CHECKLIST.md").write_text("- [x] one\n-[ ] two\n- [] three\n")
    subprocess.run(["git", "-C", str(work), "commit", "-qam", "edit"], check=True)
    book = {"name": "x", "prompt": "p", "loop": {"steps": [{"shell": "true"}]}}
    code, said, _ = check(write(tmp_path / "loop.yaml", book), work)
    assert code == 0, said
    text = "\n".join(said)
    assert "nothing to do (1 done, 0 skipped, 0 open)" in text, text
    assert "lines 2, 3 look like an item but are not one" in text, text
    assert "not committed" not in text


def test_an_uncommitted_checklist_is_warned(tmp_path: Path) -> None:
    work = make_workspace(tmp_path / "work", ["one"])
    (work / "CHECKLIST.md").write_text("- [ ] one\n- [ ] two\n")  # edited, not committed
    book = {"name": "x", "prompt": "p", "loop": {"steps": [{"shell": "true"}]}}
    code, said, _ = check(write(tmp_path / "loop.yaml", book), work)
    assert code == 0 and len(said) == 1, said
    assert "CHECKLIST.md is not committed" in said[0]


def test_state_inside_the_workdir_is_warned_unless_git_ignores_it(tmp_path: Path) -> None:
    """Item 7: demo.yaml's `.standin` (the stand-in's pid file and log) sat in the workdir
    and the agent's commits took it along."""
    work = make_workspace(tmp_path / "work", ["one"])
    book = {
        "name": "x",
        "prompt": "p",
        "vars": {"server_dir": ".server", "outside_dir": str(tmp_path / "state")},
        "loop": {"steps": [{"shell": "true"}]},
    }
    runbook = write(tmp_path / "loop.yaml", book)
    code, said, _ = check(runbook, work)
    assert code == 0 and len(said) == 1, said
    assert "variable 'server_dir': .server is inside the workdir" in said[0]
    assert f"{runbook}:" in said[0]
    (work / ".gitignore").write_text(".server/\n")
    subprocess.run(["git", "-C", str(work), "add", ".gitignore"], check=True)
    subprocess.run(["git", "-C", str(work), "commit", "-qm", "ignore"], check=True)
    _, said, _ = check(runbook, work)
    assert said == [], said


def test_the_llama_start_script_names_a_missing_model_and_server(tmp_path: Path) -> None:
    """Item 4: a missing model was told as llama-server's "exiting due to model loading error",
    without the path, after the server had started; the script now says which file, before."""
    script = ROOT / "runbooks" / "llama-cpp" / "start_llama_server.sh"
    missing = tmp_path / "no-such-model.gguf"
    env = python_env(LLAMA_MODEL=str(missing), LLAMA_DIR=str(tmp_path / "llama"))
    env["LLAMA_SERVER"] = sys.executable  # a program that exists: only the model is missing
    env["LLAMA_PORT"] = str(free_port())  # nothing listens there: the script goes on to start
    started = subprocess.run(
        ["bash", str(script), "start"], env=env, capture_output=True, text=True, timeout=60
    )
    assert started.returncode == 1, started.stdout + started.stderr
    assert f"no model file at {missing}" in started.stderr, started.stdout + started.stderr

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    env.update(LLAMA_MODEL=str(tmp_path / "model.gguf"), LLAMA_SERVER="no-such-llama-server")
    started = subprocess.run(
        ["bash", str(script), "start"], env=env, capture_output=True, text=True, timeout=60
    )
    assert started.returncode == 1, started.stdout + started.stderr
    assert "no-such-llama-server not found" in started.stderr, started.stdout + started.stderr
