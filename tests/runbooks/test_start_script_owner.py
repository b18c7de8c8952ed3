"""Issue 37, High 1, at the start scripts, written as the attack: another local user (made with
`useradd` for the test) holds the server's port with a server that answers every health check.
The scripts said "already running: healthy"; now each checks who holds the port (the kernel's
tables) and fails, exit 1, naming the uid. Where a script started the server itself, the port
must also be held by the process it started (tests/data/fake-vllm-python plays vLLM).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.foreign import NEEDS_ROOT, Impostor, another_user
from support.standin import free_port, python_env

ROOT = Path(__file__).resolve().parents[2]
VLLM_LOCAL = ROOT / "runbooks" / "vllm-local" / "start_vllm.sh"
LLAMA = ROOT / "runbooks" / "llama-cpp" / "start_llama_server.sh"
COMPOSE = ROOT / "runbooks" / "compose" / "start_vllm.sh"
FAKE_PYTHON = ROOT / "tests" / "data" / "fake-vllm-python"


@pytest.fixture
def user() -> Iterator:
    with another_user() as made:
        yield made


def start(script: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(script), "start"], env=python_env(**env), capture_output=True, text=True, timeout=60
    )


def vllm_env(tmp_path: Path, port: int) -> dict[str, str]:
    return {
        "VLLM_PYTHON": str(FAKE_PYTHON),
        "VLLM_MODEL": "/models/fake",
        "VLLM_SERVED_MODEL_NAME": "stand-in",
        "VLLM_PORT": str(port),
        "VLLM_DIR": str(tmp_path / "vllm"),
        "FAKE_VLLM_STATE": str(tmp_path / "standin"),
        "HEALTH_TIMEOUT": "2",
        "START_TIMEOUT": "20",
        "STOP_TIMEOUT": "3",
    }


def held_by(port: int, user) -> str:
    return f"port {port} is held by uid {user.pw_uid}, not by us (uid {os.geteuid()})"


def refused(done: subprocess.CompletedProcess[str], why: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    assert why in done.stderr, done.stdout + done.stderr
    assert "already running" not in done.stdout and "healthy:" not in done.stdout, done.stdout


@NEEDS_ROOT
@pytest.mark.parametrize("script", ["llama-cpp", "vllm-local", "compose"])
def test_already_running_on_another_users_port_is_refused(tmp_path, user, script):
    port = free_port()
    env = {
        "llama-cpp": {
            "LLAMA_PORT": str(port),
            "LLAMA_DIR": str(tmp_path / "llama"),
            "LLAMA_PYTHON": sys.executable,
            "HEALTH_TIMEOUT": "2",
        },
        "vllm-local": {**vllm_env(tmp_path, port), "VLLM_PYTHON": sys.executable},
        "compose": {"PORT": str(port), "COMPOSE": "false", "HEALTH_TIMEOUT": "2"},
    }[script]
    if script == "compose" and shutil.which("curl") is None:
        pytest.skip("curl not installed: the compose script's health check needs it")
    path = {"llama-cpp": LLAMA, "vllm-local": VLLM_LOCAL, "compose": COMPOSE}[script]
    theirs = Impostor(port, user).listening()
    try:
        done = start(path, **env)
    finally:
        theirs.stop()

    refused(done, held_by(port, user))
    assert not list(tmp_path.glob("*/*.pid"))  # nothing of ours was started


@NEEDS_ROOT
def test_a_start_whose_port_another_user_took_fails_and_stops_ours(tmp_path, user):
    """Their server answers unhealthy once, so the script starts ours; ours cannot bind, and
    their server answers the next check as healthy: the start fails, ours is stopped."""
    port = free_port()
    theirs = Impostor(port, user, fails=1).listening()
    try:
        done = start(VLLM_LOCAL, **vllm_env(tmp_path, port))
    finally:
        theirs.stop()

    refused(done, held_by(port, user))
    assert "starting vLLM" in done.stdout
    assert not (tmp_path / "vllm" / "vllm.pid").exists()  # stopped: no group left


def test_a_start_answered_by_a_server_it_did_not_start_fails(tmp_path):
    """The same with a server of our own user on the port: the uid is ours, but the socket is
    not the started process group's."""
    port = free_port()
    stray = Impostor(port, fails=1).listening()
    try:
        done = start(VLLM_LOCAL, **vllm_env(tmp_path, port))
    finally:
        stray.stop()

    refused(done, f"port {port} is not held by the server this script started")
    assert not (tmp_path / "vllm" / "vllm.pid").exists()
