"""Issue 36 on the real vLLM (the session's 8-layer model), runbooks/vllm-local.yaml's probes as
shipped, the agent's calls through the loop's proxy: a hang right after a prompt is sent is found
within 10 s, streamed or not, on a fresh run whose pace no streamed request measured (the engine's
histograms and the run's calibration did). Before, each of these took 120 s and more: a pace
"unmeasured" gave the first step the ceiling.
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from pathlib import Path

import pytest
from real_helpers import SERVED_NAME, Engine, wait_until
from test_real_blame import PROXY, standin_agent
from test_real_loops import HANG_BOUND, LOAD_MARGIN, Loop

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]
WORDS = 1500  # the agent's prompt: about 2,000 tokens


def whole_call(body_file: Path, max_tokens: int, stream: bool = False) -> str:
    """A chat completion through the loop's proxy, answered whole (or streamed), its body in a
    file; a cut by curl's --max-time is done (the retry after the death goes on)."""
    body = {"model": SERVED_NAME, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    body["messages"] = [{"role": "user", "content": f"{time.time_ns()} " + "word " * WORDS}]
    body_file.write_text(json.dumps(body))
    command = ["curl", "-sS", "-f", "--max-time", "60", "-o", "/dev/null"]
    command += ["-H", "content-type: application/json", "-d", f"@{body_file}"]
    return f'{{ {shlex.join(command)} "{PROXY}/chat/completions" || [ $? = 28 ]; }}'


def gate(flag: Path) -> str:
    """The agent waits for the test's word (`flag`) before its request."""
    return f"until [ -e {shlex.quote(str(flag))} ]; do sleep 0.05; done"


def hung_then_found(loop: Loop, engine: Engine, flag: Path | None) -> tuple[float, dict]:
    """SIGSTOP of EngineCore (then the agent let go, `flag`): seconds to the death, its event."""
    engine.signal_engine(signal.SIGSTOP)
    stopped = time.monotonic()
    if flag is not None:
        flag.touch()
    death = loop.run.wait_event("death", timeout=HANG_BOUND + LOAD_MARGIN + 130)
    return time.monotonic() - stopped, death


def finish_recovered(loop: Loop) -> None:
    code = loop.finish()
    assert code == 0, (loop.run.events[-5:], loop.run.stderr[-2000:])
    assert loop.marks() == ["x"] and loop.strikes() == {}


def test_an_idle_hang_just_before_a_whole_request_is_found_within_10_s(
    healthy_engine: Engine, tmp_path: Path
) -> None:
    """EngineCore stopped while idle; a moment later the run's first agent request, not
    streamed: found within 10 s, and the death says the prompt's first token was paced."""
    flag = tmp_path / "go"
    call = whole_call(tmp_path / "body.json", 20)
    agent = f"{gate(flag)} && {call} && {shlex.join(standin_agent(healthy_engine))}"
    loop = Loop(tmp_path, healthy_engine, ["idle hang"], think=None, agent=agent)
    loop.run.wait_agent(1, timeout=180)
    found, death = hung_then_found(loop, healthy_engine, flag)
    print(f"idle hang before a whole request found after {found:.1f} s")
    assert found <= HANG_BOUND + LOAD_MARGIN, (found, death)
    assert death["fault"] == "engine stalled with work waiting", death
    finish_recovered(loop)


def test_a_hang_mid_whole_generation_is_found_within_10_s(
    healthy_engine: Engine, tmp_path: Path
) -> None:
    """EngineCore stopped while it generates a non-streamed 3,000-token answer: the engine
    counted its steps since the request, so the first step's allowance is over: found within
    10 s, not at the ceiling."""
    call = whole_call(tmp_path / "body.json", 3000)
    agent = f"{call} && {shlex.join(standin_agent(healthy_engine))}"
    loop = Loop(tmp_path, healthy_engine, ["whole generation"], think=None, agent=agent)
    loop.run.wait_agent(1, timeout=180)
    wait_until(loop.engine_working, 60, "the engine to generate the answer")
    found, death = hung_then_found(loop, healthy_engine, None)
    print(f"hang mid whole generation found after {found:.1f} s")
    assert found <= HANG_BOUND + LOAD_MARGIN, (found, death)
    finish_recovered(loop)


def test_the_first_request_of_a_fresh_run_hung_is_found_within_10_s(
    healthy_engine: Engine, tmp_path: Path
) -> None:
    """The run's first agent request, streamed, and EngineCore stopped the moment it is sent
    (its first step under way, nothing of it measured): found within 10 s."""
    sent = tmp_path / "sent"
    call = whole_call(tmp_path / "body.json", 20, stream=True)
    agent = f"touch {shlex.quote(str(sent))}; {call} && {shlex.join(standin_agent(healthy_engine))}"
    loop = Loop(tmp_path, healthy_engine, ["first request"], think=None, agent=agent)
    wait_until(sent.exists, 180, "the agent's first request")
    found, death = hung_then_found(loop, healthy_engine, None)
    print(f"first request of a fresh run, hung, found after {found:.1f} s")
    assert found <= HANG_BOUND + LOAD_MARGIN, (found, death)
    finish_recovered(loop)
