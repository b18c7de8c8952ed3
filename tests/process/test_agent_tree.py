"""The agent dies with the loop: after `kill -9` of ralph-run, the agent's whole process tree is
gone within 1 s (PR_SET_PDEATHSIG on the command, the tree guard for the rest of its tree).

The agent is a bash script shaped like a node agent's tree: children in its session, one in
a process group of its own, a grandchild that ignores SIGTERM, one that escaped into a session
of its own (setsid).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest
import yaml
from support.standin import alive, cmdline_of, wait_for
from test_loop import Loop, marked

from ralph_runner.process import execute, tree_guard_pipe

pytestmark = pytest.mark.timeout(60)

TICK = "sed -i 's/^- \\[ \\] /- [x] /' CHECKLIST.md && git commit -qam done"
TREE = r"""#!/bin/bash
mark=$1
"$PY" -c 'import time; time.sleep(300)' "$mark-child" &
"$PY" -c 'import time; time.sleep(300)' "$mark-child" &
"$PY" -c 'import os, time; os.setpgid(0, 0); time.sleep(300)' "$mark-group" &
stubborn='import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'
bash -c '"$0" -c "$1" "$2"; :' "$PY" "$stubborn" "$mark-stubborn" &
setsid "$PY" -c 'import time; time.sleep(300)' "$mark-escaped" &
wait
"""
PARTS = ("child", "group", "stubborn", "escaped")


@pytest.fixture
def loop(tmp_path):
    workspace = Loop(tmp_path, f"m{uuid.uuid4().hex[:12]}")
    yield workspace
    assert workspace.close() == [], "a test left agent processes behind"


def tree_loop(loop: Loop) -> Loop:
    agent = loop.root / "tree.sh"
    agent.write_text(TREE.replace('"$PY"', f'"{sys.executable}"'))
    agent.chmod(0o755)
    return loop.setup(
        ["the item"],
        loop={"steps": [{"name": "agent", "shell": f"{agent} {loop.marker}", "timeout": 120}]},
    )


def use_agent(loop: Loop, shell: str) -> None:
    data = yaml.safe_load(loop.runbook.read_text())
    data["loop"]["steps"][0]["shell"] = shell
    loop.runbook.write_text(yaml.safe_dump(data, sort_keys=False))


def whole_tree(loop: Loop) -> list[psutil.Process]:
    """Waits until every part of the tree runs; returns its processes."""

    def up():
        found = marked(loop.marker)
        names = " ".join(" ".join(cmdline_of(p)) for p in found)
        return found if all(f"{loop.marker}-{part}" in names for part in PARTS) else None

    return wait_for(up, 15, "the agent's whole tree")


def test_kill_9_of_ralph_run_takes_the_agents_whole_tree_within_1_s(loop):
    tree_loop(loop)
    process = loop.start()
    whole_tree(loop)
    process.kill()
    killed = time.monotonic()
    wait_for(lambda: not marked(loop.marker), 5, "the agent's tree to be gone")
    gone_after = time.monotonic() - killed
    assert gone_after < 1.0, f"the tree outlived ralph-run by {gone_after:.2f} s"
    process.communicate(timeout=10)

    use_agent(loop, TICK)
    again = loop.run()  # the next run finds nothing left to clear, and goes on
    assert again.returncode == 0, again.stderr


def test_killed_with_its_tree_guard_the_frozen_tree_is_cleared_by_the_next_run(loop):
    """`pkill -9 -f ralph_runner` takes the tree guard too: the agent, frozen by SIGSTOP with its
    tree under it, is what `.ralph/running.json` recorded; the next run kills it all."""
    tree_loop(loop)
    process = loop.start()
    tree = whole_tree(loop)
    (dog,) = wait_for(lambda: [p for p in tree_guards() if _cwd(p) == str(loop.root)], 10, "dog")
    dog.kill()
    process.kill()
    process.communicate(timeout=10)
    leader = next(p for p in tree if cmdline_of(p)[1:2] == [str(loop.root / "tree.sh")])
    wait_for(lambda: leader.status() == psutil.STATUS_STOPPED, 5, "the agent to be frozen")
    assert all(p.is_running() for p in tree)  # frozen, not killed: its tree stays under it

    use_agent(loop, TICK)
    again = loop.run()
    assert again.returncode == 0, again.stderr
    assert not marked(loop.marker)  # the escaped grandchild too: found under its parent


def test_the_tree_guard_leaves_when_the_loop_ends(loop):
    tree_loop(loop)
    use_agent(loop, TICK)
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert [p for p in tree_guards() if _cwd(p) == str(loop.root)] == []


def tree_guards() -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if "ralph_runner.process.tree_guard" in " ".join(p.info["cmdline"] or [])
        and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def _cwd(process: psutil.Process) -> str | None:
    try:
        return process.cwd()
    except psutil.Error:
        return None


def test_every_command_gets_pdeathsig_whatever_thread_starts_it():
    probe = (
        "import ctypes; value = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(value)); print(value.value)"
    )
    results = []
    command = [sys.executable, "-c", probe]
    worker = threading.Thread(target=lambda: results.append(execute.run(command)))
    worker.start()
    worker.join()
    results.append(execute.run([sys.executable, "-c", probe]))
    assert [r.output.strip() for r in results] == [str(int(signal.SIGKILL))] * 2
    assert all(r.ok for r in results)


def test_a_command_from_a_worker_thread_runs_to_its_end():
    # PDEATHSIG fires when the *thread* that forked ends: run() keeps it waiting until then.
    results = []
    worker = threading.Thread(target=lambda: results.append(execute.shell("sleep 0.3; echo end")))
    worker.start()
    worker.join(10)
    assert results and results[0].ok and results[0].output == "end\n"


def test_the_tree_guard_kills_registered_trees_when_its_pipe_closes(tmp_path):
    """execute.tree_guard() on its own: a process that dies by SIGKILL while it runs a tree."""
    marker = f"w{uuid.uuid4().hex[:12]}"
    script = tmp_path / "tree.sh"
    script.write_text(TREE.replace('"$PY"', f'"{sys.executable}"'))
    script.chmod(0o755)
    code = (
        "import sys\n"
        "from ralph_runner.process import execute\n"
        "with execute.tree_guard():\n"
        "    execute.run([sys.argv[1], sys.argv[2]])\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(script), marker])
    try:
        wait_for(lambda: len(marked(marker)) >= 7, 15, "the tree")
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not marked(marker), 5, "the tree to be gone")
        assert time.monotonic() - killed < 1.0
    finally:
        holder.wait(10)
        for process in marked(marker):
            with contextlib.suppress(psutil.Error):  # it may end by itself meanwhile
                process.kill()


def test_commands_still_run_when_the_tree_guard_is_gone():
    with execute.tree_guard():
        dog = psutil.Process(tree_guard_pipe.guard.process.pid)
        dog.kill()
        wait_for(lambda: not alive(dog), 5, "gone")
        results = [execute.shell("echo still here") for _ in range(2)]
    assert [(r.exit_code, r.output) for r in results] == [(0, "still here\n")] * 2
