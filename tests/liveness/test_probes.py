"""Probe kinds (http, completion, tcp, gpu) and the http, nvml and processes actions, against
real servers. The command and process probes: test_command_process_probes.py."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from probe_helpers import probe
from pydantic import ValidationError
from support.gpu import nvml_works
from support.standin import StandIn, free_port

from ralph_runner import probes
from ralph_runner.actions import KINDS as ACTIONS
from ralph_runner.actions import TaskContext
from ralph_runner.errors import Problem
from ralph_runner.probes import ProbeContext, run_probe
from ralph_runner.process.connection import for_host
from ralph_runner.templating import Templar

pytestmark = pytest.mark.usefixtures("nothing_left_behind")


class Server:
    """A real HTTP/1.1 server on 127.0.0.1 (threads of this process) that counts TCP connections
    and answers whatever the test sets."""

    def __init__(self) -> None:
        self.status = 200
        self.body = b"ok"
        self.content_type = "text/plain"
        self.connections = 0
        self.requests: list[tuple[str, str, bytes]] = []
        lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive
            disable_nagle_algorithm = True  # as uvicorn: no 40 ms wait on delayed ACKs

            def setup(self) -> None:
                super().setup()
                with lock:
                    owner.connections += 1

            def do_GET(self) -> None:
                self.answer()

            def do_POST(self) -> None:
                self.answer()

            def answer(self) -> None:
                sent = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.requests.append((self.command, self.path, sent))
                self.send_response(owner.status)
                self.send_header("Content-Type", owner.content_type)
                self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                self.wfile.write(owner.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def answer(self, status: int, body: object, content_type: str = "application/json") -> None:
        self.status, self.content_type = status, content_type
        self.body = body.encode() if isinstance(body, str) else json.dumps(body).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    web = Server()
    yield web
    web.close()


@pytest.fixture
def standin(tmp_path):
    with StandIn(tmp_path / "vllm") as vllm:
        child = vllm.spawn()
        yield vllm
    child.wait(5)


# http


def test_healthy_http_probe_reuses_one_connection(server, client):
    results = [probe("http", {"url": f"{server.url}/v1/models"}, client) for _ in range(50)]

    assert all(result.ok for result in results)
    assert results[0].reason is None and results[0].detail == "HTTP 200"
    assert len(server.requests) == 50
    assert server.connections == 1


def test_closed_port_is_refused_at_once(client):
    result = probe("http", {"url": f"http://127.0.0.1:{free_port()}/v1/models"}, client)

    assert (result.ok, result.reason) == (False, "refused")
    assert "connection refused" in result.detail
    assert result.seconds < 1.0


def test_hung_server_times_out_within_the_timeout(standin, client):
    standin.admin("hang")

    result = probe("http", {"url": f"{standin.url}/models"}, client, timeout=0.5)

    assert (result.ok, result.reason) == (False, "timeout")
    assert "timed out after 0.5s (read)" in result.detail
    assert 0.5 <= result.seconds < 2.0  # the timeout is kept; past it, only a loaded machine


def test_dead_engine_503_is_a_status_failure(standin, client):
    standin.admin("dead_503")

    result = probe("http", {"url": f"{standin.url}/models"}, client)

    assert (result.ok, result.reason) == (False, "status")
    assert result.detail.startswith("HTTP 503: ")
    assert "EngineDeadError" in result.detail


def test_status_may_be_a_list(server, client):
    server.answer(204, "")

    assert probe("http", {"url": server.url, "status": [200, 204]}, client).ok
    assert probe("http", {"url": server.url}, client).reason == "status"


def test_body_contains_mismatch_is_a_body_failure(server, client):
    server.answer(200, "loading weights", "text/plain")

    missing = probe("http", {"url": server.url, "body_contains": "ready"}, client)
    present = probe("http", {"url": server.url, "body_contains": "weights"}, client)

    assert (missing.ok, missing.reason) == (False, "body")
    assert "'ready'" in missing.detail and "loading weights" in missing.detail
    assert present.ok


def test_json_values_by_dotted_path(server, client):
    server.answer(200, {"data": [{"id": "qwen", "max_model_len": 32768}]})
    url = f"{server.url}/v1/models"

    def check(expected: dict) -> probes.ProbeResult:
        return probe("http", {"url": url, "json": expected}, client)

    assert check({"data.0.id": "qwen", "data.0.max_model_len": "32768"}).ok
    wrong = check({"data.0.id": "llama"})
    missing = check({"data.1.id": "qwen"})
    assert (wrong.reason, wrong.detail) == ("body", "json data.0.id is 'qwen', expected 'llama'")
    assert missing.reason == "body" and missing.detail.startswith("json data.1.id missing")
    server.answer(200, "<html>", "text/html")
    assert check({"data.0.id": "qwen"}).detail == "body is not JSON: <html>"


def test_http_probe_sends_method_and_headers(server, client):
    params = {"url": server.url, "method": "post", "headers": {"Authorization": "Bearer x"}}

    assert probe("http", params, client).ok
    assert server.requests[-1][0] == "POST"


@pytest.fixture
def dropping_server():
    """Answers the first request of each connection and resets the connection when a second
    one arrives: uvicorn closing an idle keep-alive connection just as a probe reuses it."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                connections.append(conn)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                conn.recv(65536)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", connections
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    for conn in connections:
        conn.close()
    thread.join(5)


def test_a_dropped_keep_alive_connection_is_retried_once(dropping_server, client):
    url, connections = dropping_server

    first = probe("http", {"url": url}, client)
    second = probe("http", {"url": url}, client)

    assert first.ok and second.ok, second.detail
    assert len(connections) == 2


# completion


def test_completion_generates_a_token(standin, client):
    params = {"url": standin.url, "model": standin.model}

    result = probe("completion", params, client)

    assert result.ok, result.detail


def test_completion_with_dead_engine_is_a_status_failure(standin, client):
    standin.admin("dead_503")

    result = probe("completion", {"url": standin.url, "model": standin.model}, client)

    assert (result.ok, result.reason) == (False, "status")
    assert result.detail.startswith("HTTP 503")


def test_completion_500_is_a_status_failure(server, client):
    server.answer(500, {"error": {"message": "EngineCore encountered an issue."}})

    result = probe("completion", {"url": f"{server.url}/v1/", "model": "m"}, client)

    assert (result.ok, result.reason) == (False, "status")
    assert result.detail.startswith("HTTP 500: ") and "EngineCore" in result.detail
    method, path, sent = server.requests[-1]
    assert (method, path) == ("POST", "/v1/chat/completions")
    assert json.loads(sent)["max_tokens"] == 1


def test_completion_without_choices_is_a_body_failure(server, client):
    server.answer(200, {"choices": []})

    result = probe("completion", {"url": server.url, "model": "m"}, client)

    assert (result.ok, result.reason) == (False, "body")


# tcp


def test_tcp_connects_or_is_refused(server, client):
    up = probe("tcp", {"host": "127.0.0.1", "port": server.port}, client)
    port = free_port()
    down = probe("tcp", {"port": str(port)}, client)

    assert up.ok and up.detail == f"127.0.0.1:{server.port}: connected"
    assert (down.ok, down.reason) == (False, "refused")
    assert down.detail == f"127.0.0.1:{port}: connection refused"


# gpu


def test_gpu_probe_without_driver_fails_softly(client):
    result = probe("gpu", {"index": 0, "min_free_mib": 1}, client)

    if nvml_works():
        assert result.detail.startswith("GPU 0: ") and "MiB free" in result.detail
    else:
        assert (result.ok, result.reason) == (False, "error")
        assert result.detail.startswith("no NVIDIA driver (")


def test_gpu_memory_thresholds():
    """The verdict on NVML's memory figures (bytes); runs without a GPU."""
    gpu = probes.KINDS["gpu"]
    used, total = 88000 * 1024 * 1024, 98304 * 1024 * 1024
    figures = "GPU 0: 88000 MiB used, 10304 MiB free of 98304 MiB"

    passed = probes.Verdict(True, None, figures)
    assert gpu.verdict(gpu.Params(min_free_mib=8000), used, total) == passed
    assert gpu.verdict(gpu.Params(min_free_mib=20000), used, total) == probes.Verdict(
        False,
        "status",
        f"{figures} (want >= 20000 MiB free)",
    )
    assert gpu.verdict(gpu.Params(max_used_percent=80), used, total) == probes.Verdict(
        False,
        "status",
        f"{figures} (89.5% used, want <= 80%)",
    )


def test_nvml_report_shows_what_the_gpu_does_not_report_as_na():
    nvml = ACTIONS["nvml"]
    gpus = [
        {
            "index": 0,
            "name": "NVIDIA GB10",
            "memory_used_mib": None,
            "memory_free_mib": None,
            "memory_total_mib": None,
            "utilization_percent": 97,
            "processes": [{"pid": 4242, "used_mib": None, "name": "python3"}],
        }
    ]

    assert nvml.report(gpus, "580.95").splitlines() == [
        "NVIDIA driver 580.95, 1 GPU(s)",
        "GPU 0: NVIDIA GB10, n/a used, n/a free, n/a total, utilization 97%",
        "  pid 4242: n/a python3",
    ]


def test_probe_params_forbid_unknown_keys():
    with pytest.raises(ValidationError, match="extra"):
        probes.KINDS["http"].Params.model_validate({"url": "http://x", "timout": 3})
    with pytest.raises(ValidationError):
        probes.KINDS["tcp"].Params.model_validate({"port": 70000})


def test_run_probe_never_raises(client):
    ctx = ProbeContext(client=client, connection=for_host({}), timeout=1.0)

    result = run_probe("broken", "http", None, ctx)  # params the schema would have refused

    assert (result.ok, result.reason) == (False, "error")
    assert result.as_dict()["detail"].startswith("AttributeError")


# actions


def task_context(
    tmp_path: Path, variables: dict | None = None, max_output=65536, hostvars: dict | None = None
) -> TaskContext:
    return TaskContext(
        variables=variables or {},
        templar=Templar(tmp_path),
        connection=for_host(hostvars or {}),
        cwd=tmp_path,
        env={},
        timeout=2.0,
        max_output=max_output,
        where=Problem("test task"),
    )


def http_task(params: dict, ctx: TaskContext):
    module = ACTIONS["http"]
    return module.run(module.Params.model_validate(params), ctx)


def test_http_action_renders_and_registers(server, tmp_path):
    server.answer(200, {"object": "list", "data": [{"id": "qwen"}]})
    ctx = task_context(tmp_path, {"base": server.url})
    params = {"url": "{{ base }}/v1/models"}

    result = http_task(params, ctx)

    assert result.ok
    assert ACTIONS["http"].describe(ACTIONS["http"].Params(**params), ctx) == (
        f"GET {server.url}/v1/models"
    )
    registered = result.register()
    assert registered["status"] == 200
    assert registered["json"]["data"][0]["id"] == "qwen"
    assert json.loads(registered["content"]) == registered["json"]


def test_http_action_posts_json_and_checks_status(server, tmp_path):
    server.answer(503, "busy", "text/plain")
    params = {"url": server.url, "method": "POST", "body": {"mode": "{{ mode }}"}}

    result = http_task(params, task_context(tmp_path, {"mode": "die"}))

    assert not result.ok
    assert result.data == {"status": 503, "json": None, "content": "busy"}
    assert server.requests[-1] == ("POST", "/", b'{"mode":"die"}')
    assert http_task({**params, "status": [200, 503]}, task_context(tmp_path, {"mode": "x"})).ok


def test_http_action_keeps_the_last_bytes(server, tmp_path):
    server.answer(200, "head-" + "x" * 100 + "-tail", "text/plain")

    result = http_task({"url": server.url}, task_context(tmp_path, max_output=10))

    assert result.data["content"] == "xxxxx-tail" and result.output == "xxxxx-tail"
    assert result.cut_bytes == 100


def test_http_action_refused(tmp_path):
    result = http_task({"url": f"http://127.0.0.1:{free_port()}/"}, task_context(tmp_path))

    assert not result.ok and result.data["status"] == -1
    assert "connection refused" in result.output


def test_nvml_action_without_driver(tmp_path):
    module = ACTIONS["nvml"]

    result = module.run(None, task_context(tmp_path))

    if nvml_works():
        assert result.ok and "GPU 0: " in result.output
    else:
        assert not result.ok
        assert result.output.startswith("no NVIDIA driver: ")


def test_processes_action_lists_the_matching_process(tmp_path, sleeper):
    child, _, name = sleeper
    module = ACTIONS["processes"]
    # The sleeper's own path: no other process (a parallel test's sleeper) matches it.
    match = re.escape(str(tmp_path / name))
    params = module.Params.model_validate({"top": 3, "match": match})

    result = module.run(params, task_context(tmp_path))

    assert result.ok
    assert [row["pid"] for row in result.data["matches"]] == [child.pid]
    assert len(result.data["top"]) == 3
    assert "top 3 processes by memory:" in result.output
    assert re.search(rf"^\s+{child.pid}\s+[\d.]+\s+[\d.]+\s+\S*{name} 30$", result.output, re.M)


def test_processes_action_without_match(tmp_path):
    module = ACTIONS["processes"]

    result = module.run(module.Params(), task_context(tmp_path))

    assert result.ok and result.data["matches"] == []
    assert len(result.data["top"]) == 10
    assert "matching" not in result.output


@pytest.mark.parametrize("kind", ["nvml", "processes"])
def test_machine_local_actions_refuse_a_remote_host(tmp_path, kind):
    module = ACTIONS[kind]
    ctx = task_context(tmp_path, hostvars={"ansible_host": "spark-b.lan", "ansible_user": "ops"})

    result = module.run(module.Params.model_validate({}) if kind == "processes" else None, ctx)

    assert not result.ok
    assert "not those of ssh ops@spark-b.lan" in result.output
