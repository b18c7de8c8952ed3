"""The real vLLM's Anthropic Messages API (`/v1/messages`, what Claude Code calls) through the
loop's agent proxy: the proxy's receipt equals the engine's own token counters, streamed and
whole (Claude Code adds `?beta=true`)."""

from __future__ import annotations

import httpx
import pytest
from real_helpers import SERVED_NAME, Engine, metric_sums, wait_until

from ralph_runner.loop.proxy import Proxy

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]
PROMPT = "Say hello to the sea, the sand and the sky. " * 6


def counted(engine: Engine) -> tuple[float, float]:
    sums = metric_sums(httpx.get(engine.root_url + "/metrics", timeout=10).text)
    return sums["vllm:prompt_tokens_total"], sums["vllm:generation_tokens_total"]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_messages_call_through_the_proxy_has_the_engines_receipt(
    healthy_engine: Engine, stream: bool
) -> None:
    before = counted(healthy_engine)
    body = {
        "model": SERVED_NAME,
        "max_tokens": 8,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": stream,
    }
    with Proxy(healthy_engine.url) as proxy:
        base = proxy.url.removesuffix("/v1")  # Claude Code's ANTHROPIC_BASE_URL
        response = httpx.post(f"{base}/v1/messages?beta=true", json=body, timeout=300)
        assert response.status_code == 200, response.text
        totals = proxy.settled(10)
    assert totals.requests == 1 and totals.errors == 0 and totals.estimated == 0
    # the engine publishes its counters as its steps end: wait until they moved
    after = wait_until(
        lambda: (now := counted(healthy_engine))[1] > before[1] and now, 30, "the counters"
    )
    assert totals.prompt_tokens == after[0] - before[0] > 0
    assert totals.generated_tokens == after[1] - before[1] > 0
    print(f"receipt {totals.prompt_tokens} + {totals.generated_tokens} tokens = the engine's")
