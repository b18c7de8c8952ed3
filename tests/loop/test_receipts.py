"""Receipts: each iteration's own tokens (through the loop's agent proxy), commit and shortstat,
exact with two loops on one server; the proxy passes streams through untouched."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.e2e import Scenario, make_workspace, runbook
from support.standin import StandIn, free_port

from ralph_runner.durable import jsonl
from ralph_runner.loop.proxy import Proxy
from ralph_runner.standin.engine import tokens_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def scenarios():
    """Scenarios made by the test, each closed at its end (its servers stopped)."""
    made: list[Scenario] = []

    def make(root: Path) -> Scenario:
        made.append(Scenario(root))
        return made[-1]

    yield make
    for scenario in made:
        scenario.close()


def proxied_runbook(max_tokens: int, items_sleep: str = "0.1") -> dict[str, Any]:
    """The e2e runbook with `loop: {proxy: true}` and the agent on `{{ agent_base_url }}`."""
    book = runbook(agent_sleep=items_sleep)
    step = book["loop"]["steps"][1]
    direct = "--url {{ base_url }}"
    assert direct in step["shell"]
    step["shell"] = step["shell"].replace(
        direct, f"--url {{{{ agent_base_url }}}} --max-tokens {max_tokens}"
    )
    book["loop"]["proxy"] = True
    return book


def counters(standin: StandIn) -> dict[str, float]:
    """The stand-in's token counters, as vLLM names them."""
    text = standin.get("/metrics").text
    found = {"prompt": 0.0, "generated": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_total":
                found["prompt"] += sample.value
            elif sample.name == "vllm:generation_tokens_total":
                found["generated"] += sample.value
    return found


def history(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / ".ralph" / "iterations.jsonl"
    return [entry for _, entry in jsonl.read(path, jsonl.Skipped())]


def check_git_receipt(line: dict[str, Any]) -> None:
    """The stand-in agent ticks one line of CHECKLIST.md and commits it."""
    assert line["head_before"] and line["head_after"]
    assert line["commit"] == line["head_after"] != line["head_before"]
    assert (line["files_changed"], line["insertions"], line["deletions"]) == (1, 1, 1), line


def test_one_loop_counts_what_the_server_served(tmp_path: Path, scenarios) -> None:
    scenario = scenarios(tmp_path)
    scenario.prepare(["first", "second", "third"])
    scenario.runbook_path.write_text(yaml.safe_dump(proxied_runbook(5), sort_keys=False))
    before = counters(scenario.standin)
    run = scenario.start()
    assert run.wait() == 0, run.events
    after = counters(scenario.standin)
    lines = history(scenario.workspace)
    assert [line["outcome"] for line in lines] == ["done"] * 3
    for line in lines:
        receipt = line["receipt"]
        assert receipt["requests"] == 1 and receipt["request_errors"] == 0
        assert receipt["generated_tokens"] == 5
        assert receipt["prompt_tokens"] == tokens_of(line["prompt_chars"])
        assert receipt["tokens_estimated"] is False
        assert receipt["first_token_seconds"] is not None
        assert receipt["generation_seconds"] >= 0 and receipt["request_seconds"] > 0
        check_git_receipt(line)
    assert (
        sum(line["receipt"]["prompt_tokens"] for line in lines)
        == after["prompt"] - before["prompt"]
    )
    assert sum(line["receipt"]["generated_tokens"] for line in lines) == (
        after["generated"] - before["generated"]
    )
    receipts = run.of("receipt")
    assert [r["generated_tokens"] for r in receipts] == [5, 5, 5]


def test_two_loops_on_one_server_count_only_their_own(tmp_path: Path, scenarios) -> None:
    first = scenarios(tmp_path / "a")
    first.prepare([f"a{i}" for i in range(4)])
    first.runbook_path.write_text(yaml.safe_dump(proxied_runbook(3, "0.3"), sort_keys=False))
    second = scenarios(tmp_path / "b")
    second.standin = first.standin  # one server, two loops
    make_workspace(second.workspace, [f"b{i}" for i in range(4)])
    second.runbook_path.write_text(yaml.safe_dump(proxied_runbook(11, "0.3"), sort_keys=False))
    before = counters(first.standin)
    runs = [first.start(), second.start()]
    assert [run.wait() for run in runs] == [0, 0], [run.events for run in runs]
    after = counters(first.standin)
    totals = {"prompt": 0, "generated": 0}
    windows = []
    for scenario, own in ((first, 3), (second, 11)):
        lines = history(scenario.workspace)
        assert [line["outcome"] for line in lines] == ["done"] * 4
        for line in lines:
            receipt = line["receipt"]
            assert receipt["requests"] == 1
            assert receipt["generated_tokens"] == own, line
            assert receipt["prompt_tokens"] == tokens_of(line["prompt_chars"]), line
            totals["prompt"] += receipt["prompt_tokens"]
            totals["generated"] += receipt["generated_tokens"]
            check_git_receipt(line)
        windows.append((lines[0]["started"], lines[-1]["started"] + lines[-1]["seconds"]))
    assert totals == {k: after[k] - before[k] for k in totals}
    (a_start, a_end), (b_start, b_end) = windows
    assert a_start < b_end and b_start < a_end, "the two loops did not run at the same time"


# -- the proxy itself, against the stand-in ----------------------------------------------

MASKS = [
    (re.compile(rb'"(id|item_id|response_id)": ?"[^"]*"'), rb'"\1":"<id>"'),
    (re.compile(rb'"(created|created_at|completed_at)": ?[0-9.]+'), rb'"\1":0'),
    (re.compile(rb'"(chatcmpl|cmpl|resp|msg)-[0-9a-zA-Z_-]+"'), rb'"<id>"'),
]
REQUESTS = [
    (
        "/chat/completions",
        {
            "messages": [{"role": "user", "content": "say something rather long, please " * 9}],
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    ("/completions", {"prompt": "once upon a time " * 7, "max_tokens": 9, "stream": True}),
    ("/responses", {"input": "hello there " * 5, "max_output_tokens": 7, "stream": True}),
]


def masked(body: bytes) -> bytes:
    for pattern, replacement in MASKS:
        body = pattern.sub(replacement, body)
    return body


@pytest.fixture
def server(tmp_path: Path):
    with StandIn(tmp_path / "vllm") as standin:
        standin.start()
        yield standin


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    with httpx.stream("POST", url + path, json=body, timeout=10) as response:
        data = b"".join(response.iter_raw())
        return response.status_code, dict(response.headers), data


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=[p for p, _ in REQUESTS])
def test_a_stream_passes_through_byte_for_byte(
    server: StandIn, path: str, body: dict[str, Any]
) -> None:
    body = {"model": server.model, **body}
    with Proxy(server.url) as proxy:
        assert proxy.url.endswith("/v1") and proxy.url != server.url
        direct = stream(server.url, path, body)
        proxied = stream(proxy.url, path, body)
        totals = proxy.settled(5)
    assert direct[0] == proxied[0] == 200
    assert proxied[1]["content-type"] == direct[1]["content-type"]
    assert masked(proxied[2]) == masked(direct[2])
    assert proxied[2].count(b"\n\n") == direct[2].count(b"\n\n") > 2  # the same events
    assert totals.requests == 1 and totals.errors == 0
    assert totals.first_tokens == 1 and totals.first_token_seconds > 0
    usage = [json.loads(line[5:]) for line in proxied[2].split(b"\n") if b'"usage"' in line]
    if usage:  # chat with include_usage, responses' response.completed
        last = usage[-1].get("usage") or usage[-1]["response"]["usage"]
        assert totals.prompt_tokens == last.get("prompt_tokens", last.get("input_tokens"))
        assert totals.generated_tokens == last.get("completion_tokens", last.get("output_tokens"))
        assert totals.estimated == 0
    else:  # completions without stream_options: content pieces, a lower bound, said so
        assert totals.estimated == 1 and 0 < totals.generated_tokens <= 9


def test_a_whole_answer_is_counted_and_requests_in_flight_are_told(server: StandIn) -> None:
    with Proxy(server.url) as proxy:
        response = httpx.post(
            proxy.url + "/chat/completions",
            json={"model": server.model, "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        usage = response.json()["usage"]
        totals = proxy.settled(5)
        assert (totals.prompt_tokens, totals.generated_tokens) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        )
        models = httpx.get(proxy.url + "/models", timeout=5)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == server.model
        # the client has the whole answer a moment before the proxy's handler counts it done
        # (seen under load in a clean-clone rehearsal): settled waits for that moment
        assert proxy.settled(5).requests == 2 and proxy.in_flight() == 0
        body = {"model": server.model, "prompt": "x", "max_tokens": 400, "ignore_eos": True}
        seen: list[int] = []
        with httpx.stream(
            "POST", proxy.url + "/completions", json={**body, "stream": True}, timeout=20
        ) as streaming:
            for _ in streaming.iter_raw():
                seen.append(proxy.in_flight())
                break
        assert seen == [1]
        assert proxy.settled(10).requests == 3
        assert proxy.in_flight() == 0


def test_a_dead_server_is_a_502_that_says_refused() -> None:
    with Proxy(f"http://127.0.0.1:{free_port()}/v1") as proxy:
        response = httpx.post(proxy.url + "/chat/completions", json={}, timeout=10)
        assert response.status_code == 502
        assert "refused" in response.json()["error"]["message"].lower()
        assert proxy.settled(5).errors == 1 and proxy.in_flight() == 0


def test_without_the_proxy_the_line_still_has_commit_and_shortstat(
    tmp_path: Path, scenarios
) -> None:
    scenario = scenarios(tmp_path)
    scenario.prepare(["only"])
    run = scenario.start()
    assert run.wait() == 0, run.events
    (line,) = history(scenario.workspace)
    assert line["receipt"] is None and "proxy" in line["receipt_note"]
    check_git_receipt(line)
    shortstat = subprocess.run(
        ["git", "diff", "--shortstat", line["head_before"], line["head_after"]],
        cwd=scenario.workspace,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "1 file changed, 1 insertion(+), 1 deletion(-)" in shortstat


def test_tokens_per_item_and_items_per_hour_from_receipts(tmp_path: Path) -> None:
    from ralph_runner import events
    from ralph_runner.deaths import stats, text
    from ralph_runner.fleet.metrics import Textfile

    def line(item: str, outcome: str, prompt: int, generated: int) -> dict[str, Any]:
        receipt = {"requests": 2, "prompt_tokens": prompt, "generated_tokens": generated}
        return {
            "item": item,
            "outcome": outcome,
            "seconds": 900,
            "commit": None,
            "receipt": receipt,
        }

    lines = [line("a", "strike", 100, 10), line("a", "done", 300, 30), line("b", "done", 50, 5)]
    found = stats.throughput(lines)
    assert found["items_done"] == 2 and found["items_per_hour"] == pytest.approx(2 / 0.75)
    assert found["tokens_per_item"] == pytest.approx((450 + 45) / 2)
    assert found["by_item"]["a"]["prompt_tokens"] == 400 and found["by_item"]["a"]["attempts"] == 2
    shown = "\n".join(text.throughput_lines(found))
    assert "items per hour: 2.7" in shown and "tokens per item: 248" in shown
    assert stats.throughput([{**lines[0], "receipt": None}])["too_little"]

    textfile = Textfile(tmp_path / "ralph.prom", "gpu-a", warn=lambda message: None)
    for number, prompt, generated in ((1, 120, 7), (2, 30, 3)):
        textfile.on_event(
            events.Receipt(
                iteration=number,
                item="a",
                requests=1,
                request_errors=0,
                prompt_tokens=prompt,
                generated_tokens=generated,
                tokens_estimated=False,
                first_token_seconds=None,
                generation_seconds=1.0,
                request_seconds=1.0,
            )
        )
    textfile.close(0)
    written = (tmp_path / "ralph.prom").read_text()
    assert 'ralph_agent_prompt_tokens_total{host="gpu-a"} 150.0' in written
    assert 'ralph_agent_generated_tokens_total{host="gpu-a"} 10.0' in written
