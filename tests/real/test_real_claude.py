"""The real Claude Code against the real vLLM's `/v1/messages`, through the loop's agent proxy,
with the shipped recipe's settings: one print-mode call answered (exit 0), and the proxy's
receipt equal to the engine's own token counters.

Its own vLLM (the tiny model), started with the flags the shipped runbooks give for Claude Code
(`--enable-auto-tool-choice --tool-call-parser hermes`: without them vLLM answers claude's
tool_choice "auto" 400), and a context long enough for claude's system prompt and tools.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from real_helpers import MODEL_DIR, ROOT, SERVED_NAME, Engine, metric_sums, wait_until
from support.standin import free_port

from ralph_runner.loop.proxy import Proxy

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]
CLAUDE = ROOT / ".cache" / "agents" / "node_modules" / ".bin" / "claude"
RECIPE = ROOT / "runbooks" / "agents" / "claude.yaml"
TOOL_ARGS = (
    "--dtype bfloat16 --max-model-len 32768 --enforce-eager"
    " --enable-auto-tool-choice --tool-call-parser hermes"
)


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    if not CLAUDE.exists():
        pytest.skip(f"claude not installed at {CLAUDE.relative_to(ROOT)}: run ci/install-agents.sh")
    served = Engine(tmp_path_factory.mktemp("vllm-tools"), free_port(), MODEL_DIR, TOOL_ARGS)
    try:
        served.script("start")
        yield served
    finally:
        served.stop()


def counted(engine: Engine) -> tuple[float, float]:
    sums = metric_sums(httpx.get(engine.root_url + "/metrics", timeout=10).text)
    return sums["vllm:prompt_tokens_total"], sums["vllm:generation_tokens_total"]


def recipe_env(base_url: str, config_dir: Path) -> dict[str, str]:
    """The recipe's `env:`, rendered for this engine (its keys read from the shipped file)."""
    (task,) = yaml.safe_load(RECIPE.read_text())
    values = {
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_AUTH_TOKEN": "none",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": SERVED_NAME,
        "ANTHROPIC_SMALL_FAST_MODEL": SERVED_NAME,
        "CLAUDE_CONFIG_DIR": str(config_dir),
    }
    env = {}
    for key, value in task["env"].items():
        env[key] = values[key] if "{{" in str(value) else str(value)
    return env


def test_claude_answers_through_the_proxy_and_its_receipt_is_the_engines(
    tool_engine: Engine, tmp_path: Path
) -> None:
    before = counted(tool_engine)
    with Proxy(tool_engine.url) as proxy:
        env = {
            **os.environ,
            "HOME": str(tmp_path),
            **recipe_env(proxy.url, tmp_path / "claude"),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",  # a random model writes until max_tokens
        }
        done = subprocess.run(
            [str(CLAUDE), "-p", "--model", SERVED_NAME, "--", "say hi"],
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=600,
        )
        totals = proxy.settled(10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert totals.requests >= 1 and totals.errors == 0 and totals.estimated == 0, totals
    after = wait_until(
        lambda: (now := counted(tool_engine))[1] >= before[1] + totals.generated_tokens and now,
        30,
        "the engine's counters",
    )
    assert totals.prompt_tokens == after[0] - before[0] > 1000  # claude's system prompt, tools
    assert totals.generated_tokens == after[1] - before[1] > 0
    print(
        f"claude -p on vLLM: {totals.requests} requests, {totals.prompt_tokens} +"
        f" {totals.generated_tokens} tokens = the engine's, {totals.request_seconds:.1f} s"
    )
