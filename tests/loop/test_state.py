"""state.py: the state survives SIGKILL, one ralph-run owns a workdir, and ralph-run's own files
never make the agent's git tree look dirty."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.standin import alive, live_children

from ralph_runner.errors import FatalError
from ralph_runner.loop import state as run_state
from ralph_runner.loop.state import State, Store
from ralph_runner.workspace.git import EXCLUDE_HEADER, exclude_from_git

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

SAVE_FOREVER = """
import sys, pathlib
from ralph_runner.loop.state import State, Store
store = Store(pathlib.Path(sys.argv[1]))
strikes = {f"항목 {n} " + "x" * 200: n % 3 for n in range(2000)}
state = store.load()
state.strikes = strikes
state.iteration += 1
store.save(state)
print("saving", flush=True)
while True:
    state.iteration += 1
    store.save(state)
"""

LOCK = """
import json, pathlib, subprocess, sys
from ralph_runner.errors import FatalError
from ralph_runner.loop.state import Store
try:
    with Store(pathlib.Path(sys.argv[1])).lock():
        if sys.argv[2] == "spawn":
            agent = subprocess.Popen(["sleep", "30"], close_fds=False)
            print(json.dumps({"agent": agent.pid}), flush=True)
        print(json.dumps({"locked": True}), flush=True)
        sys.stdin.read()
except FatalError as e:
    print(json.dumps({"exit_code": e.exit_code, "message": str(e)}), flush=True)
"""


@pytest.fixture
def spawn():
    """Start `python -c CODE ARGS...` with ralph_runner importable; kill whatever is left."""
    started: list[subprocess.Popen] = []
    before = {child.pid for child in psutil.Process().children(recursive=True)}

    def start(code: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()
    left = [child for child in live_children() if child.pid not in before]
    assert left == []


def poll(condition, seconds: float = 10) -> bool:
    """Wait until `condition()` holds; False if it still does not after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def message(process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    assert line, f"child exited with {process.wait()} before answering"
    return json.loads(line)


def test_save_and_load_round_trip(tmp_path: Path):
    store = Store(tmp_path)
    state = State(
        iteration=7,
        strikes={"src/game.js 상태 머신 골격": 2, "- [ ] $(rm -rf ~)": 1},
        deaths=2,
        death_times=[1714787198.5, 1714790798],
        current_item="src/game.js 상태 머신 골격",
        phase="post-step",
        pid=4242,
        started=1714780000.25,
        status="running",
        last_death={
            "death": 2,
            "time": "2024-05-04T02:46:38+00:00",
            "phase": "during-step",
            "item": "x",
            "reason": "timeout",
            "fault": "hang",
        },
    )
    store.save(state)
    assert Store(tmp_path).load() == state
    assert sorted(p.name for p in store.dir.iterdir()) == ["state.json"]


def test_a_temp_file_left_by_a_crash_is_reused(tmp_path: Path):
    store = Store(tmp_path)
    store.dir.mkdir()
    (store.dir / ".state.json.ralph-tmp").write_text('{"iteration": 1')
    store.save(State(iteration=2))
    assert store.load() == State(iteration=2)
    assert [p.name for p in store.dir.iterdir()] == ["state.json"]


def test_a_fresh_workdir_loads_a_fresh_state_and_creates_nothing(tmp_path: Path):
    assert Store(tmp_path).load() == State()
    assert list(tmp_path.iterdir()) == []


def test_unknown_keys_from_a_newer_version_are_ignored(tmp_path: Path):
    store = Store(tmp_path)
    store.dir.mkdir()
    store.state_path.write_text(json.dumps({"iteration": 3, "added_in_v9": {"a": 1}}))
    assert store.load() == State(iteration=3)


def test_corrupt_state_names_the_file_and_how_to_reset(tmp_path: Path):
    store = Store(tmp_path)
    store.dir.mkdir()
    store.state_path.write_text('{"iteration": 3,\n  "strikes": {')
    with pytest.raises(FatalError) as caught:
        store.load()
    problem = caught.value.problems[0]
    assert caught.value.exit_code == 2
    assert problem.file == str(store.state_path)
    assert problem.line == 2
    assert f"delete {store.state_path} to start over" in problem.message


@pytest.mark.parametrize(
    "data",
    [[], {"iteration": "3"}, {"strikes": {"a": "1"}}, {"status": "dancing"}, {"pid": True}],
)
def test_wrongly_typed_state_is_reported_not_a_traceback(tmp_path: Path, data):
    store = Store(tmp_path)
    store.dir.mkdir()
    store.state_path.write_text(json.dumps(data))
    with pytest.raises(FatalError, match="to start over") as caught:
        store.load()
    assert caught.value.problems[0].file == str(store.state_path)


def test_every_status_has_its_moves_and_every_move_ends_in_a_status():
    assert set(run_state.TRANSITIONS) == set(run_state.STATUSES)
    for targets in run_state.TRANSITIONS.values():
        assert targets <= set(run_state.STATUSES)
    assert set(run_state.STATUSES) >= run_state.STARTS_OVER


@pytest.mark.parametrize("ended", run_state.ENDED)
def test_a_run_ends_in_any_ended_status_and_the_next_run_starts_from_it(ended):
    st = State()
    run_state.move(st, "running")
    run_state.move(st, ended)
    assert st.status == ended
    run_state.move(st, "running")
    assert st.status == "running"


@pytest.mark.parametrize(
    ("start", "to"), [("idle", "finished"), ("finished", "gave-up"), ("crashed", "idle")]
)
def test_an_illegal_move_is_refused_and_the_status_stays(start, to):
    st = State(status=start)
    with pytest.raises(run_state.IllegalTransition, match=f"from '{start}' to '{to}'"):
        run_state.move(st, to)
    assert st.status == start


def test_a_crashed_run_is_resumed_not_started_over():
    assert "crashed" not in run_state.STARTS_OVER
    assert State.from_dict({"status": "crashed"}).status == "crashed"


def test_status_snapshot_round_trips(tmp_path: Path):
    store = Store(tmp_path)
    assert store.read_status() is None
    snapshot = {"running": True, "iteration": 30, "done": 6, "todo": 22, "skipped": 14}
    store.write_status(snapshot)
    found = store.read_status()  # a partial file reads whole (workspace/status_file.py)
    assert found is not None and {key: found[key] for key in snapshot} == snapshot
    assert json.loads(store.status_path.read_text()) == snapshot
    store.status_path.write_text("[1]")
    with pytest.raises(FatalError, match="expected a JSON object"):
        store.read_status()


def test_state_saved_in_a_loop_survives_sigkill_at_any_moment(tmp_path: Path, spawn):
    """Readers never see half a state, a run killed with -9 mid-save leaves a loadable one,
    and the next run continues from it."""
    seen = 0
    for _ in range(8):
        child = spawn(SAVE_FOREVER, str(tmp_path))
        assert child.stdout.readline() == "saving\n"
        deadline = time.monotonic() + random.uniform(0.02, 0.1)  # spreads the kill over a save
        while time.monotonic() < deadline:
            assert len(Store(tmp_path).load().strikes) == 2000
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        state = Store(tmp_path).load()
        assert state.iteration >= seen
        assert len(state.strikes) == 2000
        seen = state.iteration
    assert seen > 8


def test_a_second_process_cannot_lock_a_held_workdir(tmp_path: Path, spawn):
    store = Store(tmp_path)
    with store.lock():
        assert store.lock_path.read_text() == f"{os.getpid()}\n"
        rival = spawn(LOCK, str(tmp_path), "hold")
        answer = message(rival)
    assert answer == {
        "exit_code": 3,
        "message": f"{store.lock_path}: another ralph-run (pid {os.getpid()}) holds {tmp_path}",
    }
    assert store.lock_path.read_text() == ""
    with store.lock():  # released: it can be taken again
        pass


def test_this_process_cannot_lock_what_a_live_child_holds(tmp_path: Path, spawn):
    holder = spawn(LOCK, str(tmp_path), "hold")
    assert message(holder) == {"locked": True}
    with pytest.raises(FatalError) as caught, Store(tmp_path).lock():
        pass
    assert caught.value.exit_code == 3
    assert f"another ralph-run (pid {holder.pid}) holds {tmp_path}" in str(caught.value)
    holder.stdin.close()  # the holder releases and exits
    assert holder.wait(timeout=10) == 0
    with Store(tmp_path).lock():
        pass


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path: Path, spawn):
    """The killed run's agent may still be alive; it must not keep the workdir locked."""
    store = Store(tmp_path)
    holder = spawn(LOCK, str(tmp_path), "spawn")
    agent = psutil.Process(message(holder)["agent"])
    assert message(holder) == {"locked": True}
    holder.kill()
    holder.wait()
    assert store.lock_path.read_text() == f"{holder.pid}\n"  # the dead run's pid is still there
    assert agent.is_running()
    try:
        with store.lock():
            assert store.lock_path.read_text() == f"{os.getpid()}\n"
    finally:
        agent.kill()
        assert poll(lambda: not alive(agent))


# --- git -----------------------------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    config = ["-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "core.quotePath=off"]
    command = ["git", *config, *args]
    return subprocess.run(command, cwd=repo, check=True, capture_output=True, text=True).stdout


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    (path / "CHECKLIST.md").write_text("- [ ] a\n")
    git(path, "add", "CHECKLIST.md")
    git(path, "commit", "-qm", "init")
    return path


def make_ralph_files(workdir: Path, logs: list[str]) -> None:
    store = Store(workdir)
    store.save(State(iteration=1))
    store.write_status({"running": True})
    with store.lock():
        pass
    (store.dir / ".state.json.ralph-tmp").write_text("{")  # left by a crash mid-save
    (workdir / ".CHECKLIST.md.ralph-tmp").write_text("- [")
    for log in logs:
        (workdir / log).parent.mkdir(parents=True, exist_ok=True)
        (workdir / log).write_text("===== vLLM down detected =====\n")


def test_ralph_files_leave_the_tree_clean(tmp_path: Path):
    repo = make_repo(tmp_path / "repo")
    logs = ["logs/vllm-deaths.log", "logs/vllm-deaths.jsonl", "죽음 [1] *.log "]
    make_ralph_files(repo, logs)
    assert git(repo, "status", "--porcelain") != ""
    exclude_from_git(repo, [Path(log) for log in logs])
    assert git(repo, "status", "--porcelain") == ""
    (repo / "logs" / "other.log").write_text("not ours")
    (repo / "죽음 [1] x.log ").write_text("not ours either")
    assert sorted(git(repo, "status", "--porcelain", "-uall").splitlines()) == [
        '?? "죽음 [1] x.log "',  # quoted for its trailing blank
        "?? logs/other.log",
    ]


def test_exclude_is_idempotent(tmp_path: Path):
    repo = make_repo(tmp_path / "repo")
    for _ in range(3):
        exclude_from_git(repo, [Path("logs/vllm-deaths.log")])
    lines = (repo / ".git" / "info" / "exclude").read_text().splitlines()
    ours = ["*.ralph-tmp", "/.ralph/", "/logs/vllm-deaths.log"]
    assert [line for line in lines if not line.startswith("#")] == ours


def test_exclude_appends_to_an_exclude_file_without_final_newline(tmp_path: Path):
    repo = make_repo(tmp_path / "repo")
    exclude = repo / ".git" / "info" / "exclude"
    exclude.write_text("/build")
    exclude_from_git(repo, [])
    assert exclude.read_text() == f"/build\n{EXCLUDE_HEADER}\n*.ralph-tmp\n/.ralph/\n"


def test_workdir_in_a_subdirectory_and_logs_outside_the_repo(tmp_path: Path):
    repo = make_repo(tmp_path / "repo")
    workdir = repo / "agent"
    workdir.mkdir()
    outside = tmp_path / "var" / "deaths.log"
    make_ralph_files(workdir, ["../shared.log"])
    exclude_from_git(workdir, [Path("../shared.log"), outside])
    assert git(repo, "status", "--porcelain") == ""
    lines = (repo / ".git" / "info" / "exclude").read_text().splitlines()
    assert "/agent/.ralph/" in lines
    assert "/shared.log" in lines
    assert not any("deaths.log" in line for line in lines)


def test_a_git_worktree_uses_the_main_repositorys_exclude(tmp_path: Path):
    repo = make_repo(tmp_path / "repo")
    worktree = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", str(worktree))
    make_ralph_files(worktree, ["deaths.log"])
    exclude_from_git(worktree, [Path("deaths.log")])
    assert git(worktree, "status", "--porcelain") == ""


def test_outside_a_git_repository_nothing_is_written(tmp_path: Path):
    workdir = tmp_path / "plain"
    workdir.mkdir()
    exclude_from_git(workdir, [Path("deaths.log")])
    assert list(workdir.iterdir()) == []
