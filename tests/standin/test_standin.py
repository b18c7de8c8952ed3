"""The stand-ins, driven as real processes: the vLLM-like server, its start script, the agent."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from httpx_sse import EventSource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from support.faithful import (
    Stream,
    Target,
    check_busy,
    check_chat_stream,
    check_completions_stream,
    check_engine_death,
    check_engine_hang,
    check_metrics_exposition,
    check_responses_stream,
    long_request,
    wait_frozen,
    wait_streaming,
)
from support.standin import ROOT, StandIn, process_gone, wait_for

from ralph_runner.standin import metrics
from ralph_runner.standin.engine import Piece, Stats
from ralph_runner.standin.scripted import ToolCall
from ralph_runner.standin.wire import Chat, Responses

ACCESS_LINE = re.compile(r'^INFO:     127\.0\.0\.1:\d+ - "GET /v1/models HTTP/1\.1" 200 OK$', re.M)
DEATH_LINES = [
    "AssertionError: num_required_blocks",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    "INFO:     Shutting down",
    "INFO:     Application shutdown complete.",
]


def assert_died_like_vllm(server: StandIn, pid: int, reason: str) -> None:
    marker = server.wait_dead(pid)
    assert (marker["pid"], marker["code"]) == (pid, 0)
    assert reason in marker["reason"]
    log = server.log()
    positions = [log.index(line) for line in DEATH_LINES]
    assert positions == sorted(positions), log
    assert server.pid is None
    assert not server.healthy()


# the server


def test_healthy_server_speaks_vllms_api_and_logs_like_it(server: StandIn) -> None:
    pid = server.pid
    assert pid is not None
    assert os.getsid(pid) == pid, "the server must lead its own session to outlive the start step"
    assert psutil.Process(pid).ppid() != os.getpid()

    health = server.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    models = server.get("/v1/models").json()
    assert [card["id"] for card in models["data"]] == [server.model]

    reply = server.chat("x" * 400)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    assert reply.json()["usage"]["prompt_tokens"] == 100

    metrics = server.get("/metrics").text
    for name in ("kv_cache_usage_perc", "num_requests_running", "generation_tokens_total"):
        assert re.search(rf"^vllm:{name}\{{.*\}} \d", metrics, re.M), name
    assert re.search(r"^vllm:prompt_tokens_total\{.*\} 10[0-9]\.0$", metrics, re.M), metrics

    wrong_model = httpx.post(
        f"{server.url}/chat/completions", json={"model": "other", "messages": []}, timeout=3
    )
    assert wrong_model.status_code == 404

    wait_for(lambda: "Avg prompt throughput" in server.log(), what="a stats line")
    log = server.log()
    assert "Application startup complete." in log
    assert ACCESS_LINE.search(log)
    assert re.search(r"Avg prompt throughput: [\d.]+ tokens/s, .* GPU KV cache usage: [\d.]+%", log)


def test_die_exits_0_and_logs_the_engine_death(standin: StandIn) -> None:
    child = standin.spawn()
    standin.trigger(die_at_request=2)
    assert standin.get("/v1/models").status_code == 200
    assert standin.get("/v1/models").status_code == 500
    assert child.wait(timeout=10) == 0
    assert_died_like_vllm(standin, child.pid, "die_at_request")
    assert "num_required_blocks 25 < len(req_blocks) 26" in standin.log()


def test_die_from_the_admin_endpoint(server: StandIn) -> None:
    pid = server.pid
    assert server.admin("die").status_code == 200
    assert_died_like_vllm(server, pid, "die")


def test_a_prompt_over_the_limit_kills_the_server(server: StandIn) -> None:
    pid = server.pid
    server.trigger(die_on_prompt_chars=1000)
    assert server.chat("x" * 1000).status_code == 200
    with pytest.raises(httpx.HTTPError):
        server.chat("x" * 2000).raise_for_status()
    assert_died_like_vllm(server, pid, "die_on_prompt_chars (2000 > 1000)")
    assert "num_required_blocks 32 < len(req_blocks) 33" in server.log()


def test_hang_holds_the_port_and_never_answers(server: StandIn) -> None:
    pid = server.pid
    server.admin("hang")
    with pytest.raises(httpx.ReadTimeout):
        server.get("/health", timeout=0.5)
    assert psutil.pid_exists(pid)
    socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 3, "a hung server still stops on SIGTERM"
    assert server.exit_marker()["reason"] == "SIGTERM"


def test_dead_engine_answers_503_while_the_process_lives(server: StandIn) -> None:
    server.trigger(dead_503=True)
    for path in ("/health", "/v1/models"):
        answer = server.get(path)
        assert answer.status_code == 503
        assert "EngineCore encountered an issue" in answer.json()["error"]["message"]
    assert server.chat("hi").status_code == 503
    assert psutil.pid_exists(server.pid)
    assert server.exit_marker() is None
    assert "EngineDeadError" in server.log()
    assert "Shutting down" not in server.log()


def test_slow_once_delays_one_request_only(server: StandIn) -> None:
    server.admin("slow_once", 1.2)
    started = time.monotonic()
    assert server.get("/v1/models").status_code == 200
    assert time.monotonic() - started >= 1.2
    started = time.monotonic()
    assert server.get("/v1/models").status_code == 200
    assert time.monotonic() - started < 0.9  # not delayed (a margin for a loaded machine)


def test_sigterm_shuts_down_cleanly(standin: StandIn) -> None:
    child = standin.spawn()
    child.terminate()
    assert child.wait(timeout=5) == 0
    assert standin.exit_marker()["reason"] == "SIGTERM"
    assert standin.log().rstrip().endswith(f"Finished server process [{child.pid}]")


def test_unknown_or_broken_faults_are_refused(server: StandIn) -> None:
    answer = server.admin("explode")
    assert answer.status_code == 400
    assert "unknown fault explode" in answer.json()["error"]
    (server.state_dir / "control.json").write_text("{broken")
    assert server.healthy()
    assert "WARNING" in server.log()
    assert "ignored control.json" in server.log()
    assert not (server.state_dir / "control.json").exists()


# the engine, as vLLM's (the checks are shared with the real-vLLM tier: support/standin.py)

ENGINE_ARGS = ("--tokens-per-second", "100")  # a 300-token generation lasts 3 s


@pytest.fixture
def engine(standin: StandIn) -> Iterator[tuple[StandIn, subprocess.Popen[bytes]]]:
    """A stand-in spawned as a child (its exit code is seen) with a measurable engine speed."""
    child = standin.spawn(*ENGINE_ARGS)
    yield standin, child
    standin.stop()


@pytest.fixture
def target(engine: tuple[StandIn, subprocess.Popen[bytes]]) -> Target:
    standin, child = engine
    return standin.target(child)


def test_metrics_parse_as_prometheus_text_with_vllms_names(target: Target) -> None:
    check_metrics_exposition(target)
    text = target.get("/metrics").text
    assert "# TYPE vllm:generation_tokens_total counter" in text
    assert "# TYPE vllm:generation_tokens_created gauge" in text  # prometheus_client's
    assert 'vllm:num_requests_running{engine="0",model_name="stand-in"} 0.0' in text
    assert '{engine="0",finished_reason="stop",model_name="stand-in"}' in text


def test_metrics_are_byte_for_byte_what_prometheus_client_writes() -> None:
    """The stand-in writes /metrics itself (it runs on the standard library alone). The same
    series as prometheus_client's metric families, from a custom collector, written by its
    generate_latest (as vLLM's /metrics is written), give the same text."""
    stats = Stats(running=2, waiting=3, kv_cache_usage=0.125, prompt_tokens=1234)
    stats.generation_tokens, stats.preemptions, stats.steps, stats.step_tokens = 5678, 1, 7, 99
    stats.finished.update(stop=4, length=1)
    stats.sleeping = True
    model, started = 'a "quoted" \\ model', 1796111835.8359013

    class Families(Collector):
        def collect(self) -> Iterator[Metric]:
            labels = {"engine": "0", "model_name": model}
            for series in metrics.SERIES:
                samples = series.samples(stats)
                names = [*labels, *samples[0][0]]
                family: CounterMetricFamily | GaugeMetricFamily
                if series.kind == "counter":
                    family = CounterMetricFamily(series.name, series.help, labels=names)
                    for extra, value in samples:
                        values = [*labels.values(), *extra.values()]
                        family.add_metric(values, value, created=started)
                else:
                    family = GaugeMetricFamily(series.name, series.help, labels=names)
                    for extra, value in samples:
                        family.add_metric([*labels.values(), *extra.values()], value)
                yield family
            for histogram in metrics.HISTOGRAMS:
                count, total = histogram.count_sum(stats)
                buckets = HistogramMetricFamily(histogram.name, histogram.help, labels=[*labels])
                buckets.add_metric([*labels.values()], [("+Inf", count)], total)
                yield buckets
            help_text = "Start time of the process since unix epoch."
            yield GaugeMetricFamily("process_start_time_seconds", help_text, value=started)
            help_text = "Resident memory size in bytes."
            yield GaugeMetricFamily("process_resident_memory_bytes", help_text, value=resident)

    resident = 123456789
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    written = metrics.exposition(stats, model, started, resident)
    assert written == generate_latest(registry).decode()


def test_tokens_are_counted_as_they_are_generated(target: Target) -> None:
    stream = Stream(f"{target.url}/chat/completions", long_request(target))
    wait_streaming(stream)
    during = target.metrics()
    assert during["vllm:num_requests_running"] == 1
    assert 0 < during["vllm:generation_tokens_total"] < target.long_tokens
    assert during["vllm:kv_cache_usage_perc"] > 0
    stream.wait()
    after = target.metrics()
    assert after["vllm:generation_tokens_total"] == target.long_tokens
    assert after["vllm:num_requests_running"] == 0


def test_chat_streams_as_server_sent_events(target: Target) -> None:
    stream = check_chat_stream(target)
    assert stream.data()[1]["choices"][0]["delta"] == {"content": "OK"}


def test_completions_stream(target: Target) -> None:
    check_completions_stream(target)


def test_responses_stream_as_codex_reads_it(target: Target) -> None:
    check_responses_stream(target)


def test_responses_whole(target: Target) -> None:
    body = {"model": target.model, "input": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{target.url}/responses", json=body, timeout=5).json()
    assert (answer["object"], answer["status"]) == ("response", "completed")
    assert answer["id"].startswith("resp_")
    (item,) = answer["output"]
    assert (item["type"], item["content"][0]["text"]) == ("message", "OK")
    assert answer["usage"]["output_tokens"] == 1


def test_a_real_openai_client_reads_the_streams(target: Target) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=target.url, api_key="none", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=target.model,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "OK"
    assert chunks[-1].usage.completion_tokens == 1
    with client.responses.stream(model=target.model, input="hi") as events:
        final = events.get_final_response()
    assert final.output_text == "OK" and final.usage.output_tokens == 1


def test_engine_hang_keeps_the_api_up_and_freezes_the_counters(target: Target) -> None:
    check_engine_hang(target)
    assert "EngineDeadError" not in target.log()


def test_engine_hang_blocks_a_whole_answer_until_resume(target: Target) -> None:
    target.hang()
    with pytest.raises(httpx.ReadTimeout):
        target.generate(timeout=0.5, max_tokens=1)
    waiting = Stream(f"{target.url}/chat/completions", long_request(target, max_tokens=2))
    target.resume()
    assert waiting.wait().data()[-1] == "[DONE]"


def test_engine_death_fails_the_stream_in_flight_and_exits_0(target: Target) -> None:
    check_engine_death(target)


def test_engine_death_keeps_health_up_for_the_shutdown_delay(standin: StandIn) -> None:
    child = standin.spawn("--shutdown-delay", "3")
    standin.admin("engine_death")
    answer = standin.chat("hi")
    assert answer.status_code == 500
    message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    assert answer.json()["error"] == {
        "message": message,
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert standin.get("/health").status_code == 200
    assert standin.get("/v1/models").status_code == 200
    assert child.wait(timeout=10) == 0
    assert standin.exit_marker()["reason"] == "engine dead: engine_death"
    assert not standin.healthy()


def test_engine_death_cuts_a_responses_stream(target: Target) -> None:
    stream = Stream(f"{target.url}/responses", long_request(target, "/responses"))
    wait_streaming(stream, 5)
    target.kill()
    stream.wait()
    assert isinstance(stream.error, httpx.RemoteProtocolError), repr(stream.error)
    kinds = [e.event for e in stream.events]
    assert "response.completed" not in kinds and kinds[-1] == "response.output_text.delta"
    assert target.exit_code(10) == 0


def test_worker_timeout_is_a_hang_then_a_death(standin: StandIn) -> None:
    child = standin.spawn(*ENGINE_ARGS, "--execute-model-timeout", "3")
    target = standin.target(child)
    stream = Stream(f"{target.url}/chat/completions", long_request(target))
    wait_streaming(stream)
    standin.admin("worker_timeout")
    wait_frozen(target)
    assert target.get("/health").status_code == 200
    stream.wait(30)
    assert stream.data()[-2]["error"]["code"] == 500
    assert child.wait(timeout=10) == 0
    log = standin.log()
    timeout = log.index("TimeoutError: RPC call to execute_model timed out.")
    assert timeout < log.index("EngineDeadError") < log.index("Shutting down")


def test_busy_engine_has_a_waiting_line_and_moving_counters(standin: StandIn) -> None:
    child = standin.spawn(*ENGINE_ARGS, "--max-num-seqs", "1")
    check_busy(standin.target(child))


def test_busy_fault_makes_every_generation_long(target: Target, standin: StandIn) -> None:
    standin.admin("busy", 50)
    answer = target.generate(timeout=10).json()
    assert answer["usage"]["completion_tokens"] == 50
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert target.generate(timeout=5, max_tokens=3).json()["usage"]["completion_tokens"] == 3


def test_a_client_that_goes_away_is_aborted(target: Target) -> None:
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{target.url}/chat/completions", json=long_request(target)) as r,
    ):
        next(r.iter_bytes())
    wait_for(lambda: target.metrics()["vllm:num_requests_running"] == 0, 10, "the abort")
    assert target.metrics()["vllm:generation_tokens_total"] < target.long_tokens


# wire formats of tool calls (the default scripted model makes none: fed pieces directly)

CALL = ToolCall(name="write", arguments='{"path": "a.txt", "text": "hello"}', id="call_1")
CALL_PIECES = [Piece("", 0, CALL)] + [Piece(CALL.arguments[i : i + 4], 0) for i in range(0, 36, 4)]


def sse_data(frames: list[bytes]) -> list[tuple[str, Any]]:
    """The frames as a client's SSE parser (httpx-sse) reads them: (event, decoded data)."""
    headers = {"content-type": "text/event-stream"}
    response = httpx.Response(200, content=b"".join(frames), headers=headers)
    events = EventSource(response).iter_sse()
    return [(e.event, e.data if e.data == "[DONE]" else json.loads(e.data)) for e in events]


def test_chat_tool_calls_stream_as_vllms_tool_parsers_do() -> None:
    chat = Chat("m", {"stream": True, "stream_options": {"include_usage": True}}, 3)
    frames = chat.stream_open() + chat.stream_pieces(CALL_PIECES[:4])
    frames += chat.stream_pieces(CALL_PIECES[4:]) + chat.stream_close("tool_calls")
    data = [d for _, d in sse_data(frames)]
    deltas = [d["choices"][0]["delta"] for d in data[1:-3]]
    first = deltas[0]["tool_calls"][0]
    assert first == {"index": 0, "id": "call_1", "type": "function", "function": {"name": "write"}}
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:])
    assert json.loads(arguments) == {"path": "a.txt", "text": "hello"}
    assert data[-3]["choices"][0]["finish_reason"] == "tool_calls"
    assert data[-2]["usage"]["completion_tokens"] == len(CALL_PIECES)
    whole = chat.body(CALL_PIECES, "tool_calls")["choices"][0]["message"]
    assert whole["tool_calls"][0]["function"] == {"name": "write", "arguments": CALL.arguments}
    assert whole["content"] is None


def test_responses_function_calls_stream_as_codex_reads_them() -> None:
    responses = Responses("m", {"stream": True}, 3)
    frames = responses.stream_open() + responses.stream_pieces([Piece("Hi")])
    frames += responses.stream_pieces(CALL_PIECES) + responses.stream_close("tool_calls")
    events = sse_data(frames)
    kinds = [kind for kind, _ in events]
    assert kinds[kinds.index("response.output_item.done") + 1] == "response.output_item.added"
    call_kinds = kinds[kinds.index("response.output_item.done") + 1 :]
    assert call_kinds[0] == "response.output_item.added"
    assert set(call_kinds[1:-3]) == {"response.function_call_arguments.delta"}
    assert call_kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-2][1]["item"]
    assert (done["type"], done["call_id"], done["name"]) == ("function_call", "call_1", "write")
    assert done["arguments"] == CALL.arguments
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]


# the start script


def test_start_is_idempotent(server: StandIn) -> None:
    pid = server.pid
    again = server.start()
    assert "[start] already running" in again.stdout
    assert (server.starts, server.pid) == (1, pid)


def test_start_after_death_starts_a_new_server(server: StandIn) -> None:
    old = server.pid
    server.admin("die")
    server.wait_dead(old)
    server.start()
    assert server.starts == 2
    assert server.pid not in (None, old)
    assert server.healthy()


def test_failed_start_then_a_good_one(server: StandIn) -> None:
    old = server.pid
    server.admin("die")
    server.wait_dead(old)
    (server.state_dir / "fail_starts").write_text("1\n")

    failed = server.run_start_script()
    assert failed.returncode == 1
    assert "CUDA out of memory: another job holds 80 GiB" in failed.stderr
    assert server.starts == 1
    assert not server.healthy()

    server.start()
    assert server.starts == 2
    assert server.healthy()


def test_start_replaces_a_hung_server(server: StandIn) -> None:
    hung = server.pid
    server.admin("hang")
    result = server.start(HEALTH_TIMEOUT="0.5")
    assert f"server pid {hung} is up but not healthy" in result.stdout
    assert process_gone(hung)
    assert server.pid != hung
    assert server.healthy()


def test_start_replaces_a_hung_engine_that_still_answers_health(server: StandIn) -> None:
    hung = server.pid
    server.admin("engine_hang")
    assert server.healthy()
    result = server.start(HEALTH_TIMEOUT="0.5")
    assert f"server pid {hung} is up but not healthy (hung): stopping" in result.stdout
    assert process_gone(hung)
    assert server.pid != hung and server.starts == 2
    assert server.chat("hi", timeout=2).status_code == 200


def test_start_leaves_a_busy_engine_alone(standin: StandIn) -> None:
    standin.start(MAX_NUM_SEQS="1", TOKENS_PER_SECOND="100")
    busy = standin.pid
    stream = Stream(f"{standin.url}/chat/completions", long_request(standin.target()))
    wait_streaming(stream)
    result = standin.start(HEALTH_TIMEOUT="0.5")
    assert "[start] already running (busy)" in result.stdout
    assert (standin.pid, standin.starts) == (busy, 1)
    assert stream.wait().data()[-1] == "[DONE]"


def test_start_replaces_a_dead_engine_whose_api_still_answers(standin: StandIn) -> None:
    standin.start(SHUTDOWN_DELAY="30")
    dying = standin.pid
    standin.admin("engine_death")
    assert standin.healthy()
    result = standin.start()
    assert f"server pid {dying} is up but not healthy (status 500)" in result.stdout
    assert standin.pid != dying and standin.chat("hi").status_code == 200


def test_start_reports_a_server_that_dies_while_starting(standin: StandIn) -> None:
    standin.trigger(die=True)
    result = standin.run_start_script()
    assert result.returncode == 1
    assert "server exited during startup" in result.stderr
    assert "EngineDeadError" in result.stderr


# the agent


def test_the_server_runs_on_the_standard_library_alone() -> None:
    """The docker tier bind-mounts the stand-in into an image with nothing but python3: no
    module of the server may need a package from PyPI (python -S: no site-packages)."""
    modules = ["server", "api_server", "handler", "faults", "metrics", "generation", "engine"]
    modules += ["wire", "vllm_log", "scripted"]
    code = "; ".join(f"import ralph_runner.standin.{m}" for m in modules)
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
