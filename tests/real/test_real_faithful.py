"""The stand-in cannot drift from vLLM: the same behavioural checks (standin_helpers.check_*)
run against the stand-in and against the real vLLM, each spawned as a child so its exit code
is seen. The real engine is broken as the issue measured it: SIGSTOP / SIGCONT / kill -9 of its
VLLM::EngineCore (of the 8-layer model, whose generations last); the stand-in through its
admin endpoint (engine_hang, resume, engine_death).

One server per kind for the whole module (a cold vLLM start costs 20-40 s, minutes on a loaded
machine); the engine-death check ends it, so it comes last. It is this test's child, not the
session's server (test_real_blame.py, which sorts first, starts that one through the start
script, and it idles meanwhile): the death check needs the API server's own exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from real_helpers import (
    ENGINE_CORE,
    ENGINE_ENV,
    PYTHON,
    SERVED_NAME,
    SLOW_ARGS,
    SLOW_MODEL_DIR,
    START_TIMEOUT,
    gone,
    group_of,
    role,
    wait_until,
)
from standin_helpers import (
    StandIn,
    Target,
    check_busy,
    check_chat_stream,
    check_completions_stream,
    check_engine_death,
    check_engine_hang,
    check_metrics_exposition,
    check_responses_stream,
    free_port,
)

pytestmark = pytest.mark.timeout(600)

# The stand-in at a measurable speed, with vLLM's sequence limit of the real server below.
STANDIN_ARGS = ("--tokens-per-second", "100", "--max-num-seqs", "1")
# The real engine is the 8-layer model (~200 tokens/s here): its long generation lasts ~20 s.
# The tiny model's did not, however long: 24,000 tokens ended before a waiting request showed,
# and 8,000 before SIGSTOP, in CI (about 5,000 tokens/s on a quiet machine).
REAL_LONG_TOKENS = 4000


class RealVllm:
    """The real API server as this test's child (its own session: the group is its tree)."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "vllm.log"
        command = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--model", str(SLOW_MODEL_DIR)]
        command += ["--served-model-name", SERVED_NAME, *SLOW_ARGS.split()]
        with self.log_path.open("wb") as log:
            self.child = subprocess.Popen(
                command,
                env={**os.environ, **ENGINE_ENV},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids: list[int] = []

    def wait_healthy(self) -> None:
        def up() -> bool:
            assert self.child.poll() is None, f"vLLM exited: {self.log()[-2000:]}"
            try:
                return httpx.get(f"{self.root_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, START_TIMEOUT, "vLLM to start")
        self.pids = [p.pid for p in group_of(self.child.pid)]

    def signal_engine(self, signum: signal.Signals) -> Callable[[], None]:
        return lambda: role(group_of(self.child.pid), ENGINE_CORE).send_signal(signum)

    def exit_code(self, timeout: float) -> int | None:
        try:
            return self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def target(self) -> Target:
        return Target(
            root_url=self.root_url,
            model=SERVED_NAME,
            hang=self.signal_engine(signal.SIGSTOP),
            resume=self.signal_engine(signal.SIGCONT),
            kill=self.signal_engine(signal.SIGKILL),
            exit_code=self.exit_code,
            log=self.log,
            long_tokens=REAL_LONG_TOKENS,
        )

    def close(self) -> None:
        """Kills what is left of the group (after a failed check) and waits until none is."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGCONT)
            os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait(30)
        wait_until(lambda: not gone(self.pids), 15, "vLLM's processes to end")


@pytest.fixture(scope="module", params=["stand-in", pytest.param("vllm", marks=pytest.mark.real)])
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "stand-in":
        with StandIn(directory) as standin:
            yield standin.target(standin.spawn(*STANDIN_ARGS))
        return
    server = RealVllm(directory)
    try:
        server.wait_healthy()
        yield server.target()
    finally:
        server.close()


def test_metrics_have_vllms_names_types_and_labels(target: Target) -> None:
    check_metrics_exposition(target)


def test_chat_stream_chunks(target: Target) -> None:
    check_chat_stream(target)


def test_completions_stream_chunks(target: Target) -> None:
    check_completions_stream(target)


def test_responses_stream_events(target: Target) -> None:
    check_responses_stream(target)


def test_busy_engine_queues_and_its_counters_move(target: Target) -> None:
    check_busy(target)


def test_engine_hang_answers_health_models_metrics_and_freezes(target: Target) -> None:
    check_engine_hang(target)


def test_engine_death_is_500_then_exit_0(target: Target) -> None:
    """Last: the server is gone after it."""
    check_engine_death(target)
