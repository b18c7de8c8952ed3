"""Issue 29, findings 1 and 2, written as the attack: another user (made with `useradd` for the
test) makes ralph-run's predictable directory in the shared temp directory before us.

- the ssh control-socket directory: with theirs in place ralph-run shares no connection (no
  ControlPath into it: ssh would hand the whole remote command line, secrets included, to a
  socket they listen on); with none, it makes its own, 0700;
- the recovery lock's directory: theirs, with a symlink planted where our lock file goes, makes
  the run refuse to start (exit 2, the directory named) and the symlink's target stays as it was.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import patch

import pytest
from support.standin import python_env

from ralph_runner.liveness import recovery_lock

LOCK = "planted-lock-test"  # the runbook's recovery.lock: its file's name follows from it

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd to make another user",
)


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    name = f"rr{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temp directory as /tmp is: everyone may make names in it (sticky, 1777). Under /tmp
    itself: pytest's own temp tree is closed to other users."""
    shared = Path(tempfile.mkdtemp(prefix="rr-shared-", dir="/tmp"))
    shared.chmod(0o1777)
    try:
        yield shared
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def as_user(user: pwd.struct_passwd, *command: str) -> None:
    subprocess.run(list(command), check=True, user=user.pw_uid, group=user.pw_gid)


def in_child(code: str, tmp: Path) -> str:
    """Runs `code` in a new Python whose temp directory is `tmp` (no XDG_RUNTIME_DIR)."""
    env = {k: v for k, v in python_env(TMPDIR=str(tmp)).items() if k != "XDG_RUNTIME_DIR"}
    env.pop("RALPH_LOCK_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


REUSE = """
    from ralph_runner.process.connection import reuse_options
    print(repr(reuse_options()))
"""


def test_an_ssh_socket_directory_another_user_made_is_not_used(other_user, shared_tmp):
    theirs = shared_tmp / f"ralph-run-ssh-{os.getuid()}"
    as_user(other_user, "mkdir", "-m", "0777", str(theirs))
    as_user(other_user, "touch", str(theirs / "fake-control-socket"))

    options = in_child(REUSE, shared_tmp)

    assert "ControlPath" not in options and str(theirs) not in options, options
    assert os.stat(theirs).st_uid == other_user.pw_uid  # left as it was


def test_without_one_ralph_run_makes_its_own_ssh_socket_directory(shared_tmp):
    options = in_child(REUSE, shared_tmp)

    ours = shared_tmp / f"ralph-run-ssh-{os.getuid()}"
    assert f"ControlPath={ours}/%C" in options, options
    info = os.lstat(ours)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700


def test_a_lock_directory_with_a_planted_symlink_stops_the_run(other_user, shared_tmp, tmp_path):
    victim = tmp_path / "victim"  # a file of ours, 0600, that the lock must never write
    victim.write_text("precious\n")
    victim.chmod(0o600)
    theirs = shared_tmp / f"ralph-run-{os.getuid()}"
    as_user(other_user, "mkdir", "-m", "0777", str(theirs))
    # the link at the lock's real name (the runbook names its lock; its file is the digest's),
    # as ralph-run computes it in that directory: were the directory taken, the lock would be
    # written through this link
    with patch.dict(os.environ, {"RALPH_LOCK_DIR": str(theirs)}):
        planted = recovery_lock._path(recovery_lock.key_for(LOCK, []))
    assert planted.parent == theirs
    as_user(other_user, "ln", "-s", str(victim), str(planted))
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("- [ ] an item\n")
    runbook = tmp_path / "runbook.yaml"
    runbook.write_text(
        json.dumps(
            {
                "workdir": str(work),
                "health": {"probes": [{"name": "p", "tcp": {"port": 9}, "timeout": 1}]},
                "recovery": {"lock": LOCK},
                "loop": {"steps": [{"shell": "true"}]},
            }
        )
    )
    env = {k: v for k, v in python_env(TMPDIR=str(shared_tmp)).items() if k != "XDG_RUNTIME_DIR"}
    env.pop("RALPH_LOCK_DIR", None)

    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(runbook)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "recovery lock" in done.stderr and str(theirs) in done.stderr, done.stderr
    assert f"belongs to uid {other_user.pw_uid}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600
