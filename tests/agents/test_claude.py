"""Claude Code, the real binary, drives a real ralph-run loop on the stand-in's Messages API.

The shipped recipe (runbooks/agents/claude.yaml) against the scripted stand-in speaking
`/v1/messages` as vLLM does, streamed, with tool_use blocks: claude runs the Bash tool calls
that tick the item and commit, through the loop's agent proxy, whose receipt must equal what
the stand-in counted; and a 429 `rate_limit_error` that outlasts claude's own retries is a
usage limit ralph-run waits out, with no strike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml
from agent_helpers import AgentScenario
from test_agents_loop import ITEM, SCRIPT, assert_item_done

from ralph_runner.durable import jsonl

pytestmark = [pytest.mark.agents, pytest.mark.timeout(300)]

MakeScenario = Callable[[str], AgentScenario]


def proxied(scenario: AgentScenario, strikes: int | None = None, **limits: float) -> None:
    """The scenario's runbook with `loop: {proxy: true}` (and `limits:`, strikes if given)."""
    book = yaml.safe_load(scenario.runbook_path.read_text())
    book["loop"]["proxy"] = True
    if limits:
        book["limits"] = limits
    if strikes is not None:
        book["checklist"]["strikes"] = strikes
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))


def receipts(scenario: AgentScenario) -> list[dict[str, Any]]:
    path = scenario.workspace / ".ralph" / "iterations.jsonl"
    return [line["receipt"] for _, line in jsonl.read(path, jsonl.Skipped())]


def generated_tokens(scenario: AgentScenario) -> float:
    text = scenario.standin.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == "vllm:generation_tokens_total"
    )


def test_claude_does_the_item_and_its_receipt_is_the_servers_count(
    agent_scenario: MakeScenario,
) -> None:
    scenario = agent_scenario("claude").prepare_agent([ITEM], SCRIPT)
    proxied(scenario)
    prompt, generated = scenario.prompt_tokens(), generated_tokens(scenario)
    run = scenario.start()

    assert_item_done(scenario, run, run.wait(240))
    assert scenario.records("death") == []
    # claude's own files stay in its config dir under .ralph/ (excluded from git)
    assert (scenario.workspace / ".ralph" / "claude").is_dir()
    (receipt,) = receipts(scenario)
    # the ticking and the commit are tool calls: one request each, then the closing text
    assert receipt["requests"] >= 3 and receipt["request_errors"] == 0, receipt
    assert receipt["tokens_estimated"] is False
    assert receipt["prompt_tokens"] == scenario.prompt_tokens() - prompt > 500
    assert receipt["generated_tokens"] == generated_tokens(scenario) - generated > 0
    print(
        f"claude's iteration: {receipt['requests']} requests, {receipt['prompt_tokens']} +"
        f" {receipt['generated_tokens']} tokens, the stand-in's count"
    )
    scenario.assert_nothing_left()


RATE_LIMITED = 8.0  # s of 429s from when it is set: claude's first request meets them


def test_claude_on_a_429_is_waited_out_with_no_strike(
    agent_scenario: MakeScenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    # claude retries a 429 itself, honouring retry-after; with its retries spent (here none) it
    # prints "API Error: Request rejected (429) · <message>" and exits 1
    monkeypatch.setenv("CLAUDE_CODE_MAX_RETRIES", "0")
    scenario = agent_scenario("claude").prepare_agent([ITEM], SCRIPT)
    proxied(scenario, strikes=1, margin=1)  # a strike would skip the item: exit not 0
    scenario.standin.trigger(rate_limit=RATE_LIMITED)
    run = scenario.start()

    assert_item_done(scenario, run, run.wait(240))
    (limited,) = run.of("limited")
    assert limited["source"] == "claude" and limited["item"] == ITEM, limited
    assert "429" in limited["line"], limited
    # the stand-in's message says "retry after N s" (what its window has left): that + margin
    assert 0 < limited["seconds"] <= RATE_LIMITED + 1 + 1, limited
    assert not run.of("strike") and not run.of("agent-broken")
    print(f"claude's 429: {limited['line']!r}, waited {limited['seconds']:.1f} s")
    assert [e["item"] for e in run.of("iteration")] == [ITEM, ITEM]
    scenario.assert_nothing_left()
