"""The stand-in's log, line for line in the shape of vLLM's, so diagnostics read like the real ones.

The texts are vLLM 0.32's (`core_client.py`, `async_llm.py`, `multiproc_executor.py`, uvicorn):
a death record that holds `EngineDeadError` from the stand-in holds it where vLLM prints it.
"""

from __future__ import annotations

import threading
from datetime import datetime
from pathlib import Path

VERSION = "0.32.0"
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
SITE = "/usr/local/lib/python3.12/dist-packages/vllm"
DEAD_ERROR = "vllm.v1.engine.exceptions.EngineDeadError"
STREAM_GENERATORS = {
    "chat": ("serving.py:929", "chat completion"),
    "completions": ("serving.py:500", "completion"),
    "messages": ("serving.py:929", "chat completion"),  # vLLM's Messages API wraps chat's
}


class VllmLog:
    """Writes lines shaped like vLLM's, flushed one by one, so a `tail` at death shows the end."""

    def __init__(self, path: Path, pid: int) -> None:
        self.pid = pid
        self._file = path.open("a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def record(self, level: str, where: str, message: str, process: str = "APIServer") -> None:
        """A vLLM logger line: `(APIServer pid=N) INFO 05-04 01:46:37 [file.py:123] message`."""
        stamp = datetime.now().strftime("%m-%d %H:%M:%S")
        self._write(f"({process} pid={self.pid}) {level} {stamp} [{where}] {message}")

    def uvicorn(self, message: str) -> None:
        """A uvicorn line, as vLLM's API server prints them, with no prefix: `INFO:     msg`."""
        self._write(f"INFO:     {message}")

    def _write(self, line: str) -> None:
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def startup(self, model: str, port: int, kv_cache_tokens: int, max_num_seqs: int) -> None:
        self.record("INFO", "api_utils.py:347", f"vLLM stand-in, version {VERSION}")
        self.record(
            "INFO",
            "api_utils.py:286",
            f"non-default args: {{'model': '{model}', 'port': {port}, "
            f"'max_num_seqs': {max_num_seqs}}}",
        )
        self.record(
            "INFO",
            "core.py:133",
            f"Initializing a V1 LLM engine (v{VERSION}) with config: model='{model}'",
            process="EngineCore",
        )
        self.record(
            "INFO",
            "kv_cache_utils.py:2327",
            f"GPU KV cache size: {kv_cache_tokens:,} tokens",
            "EngineCore",
        )
        self.record("INFO", "entry.py:140", f"Starting vLLM server on http://127.0.0.1:{port}")
        self.uvicorn(f"Started server process [{self.pid}]")
        self.uvicorn("Application startup complete.")

    def kv_cache_assertion(self, blocks: int) -> None:
        """What EngineCore printed when its KV-cache manager hit the seed story's off-by-one."""
        for line in (
            "EngineCore encountered a fatal error.",
            "Traceback (most recent call last):",
            f'  File "{SITE}/v1/core/kv_cache_manager.py", line 301, in allocate_slots',
            f"AssertionError: num_required_blocks {blocks} < len(req_blocks) {blocks + 1}",
        ):
            self.record("ERROR", "core.py:1512", line, process="EngineCore")

    def execute_model_timeout(self) -> None:
        """What EngineCore prints when a Worker did not answer within
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (a stopped or stuck Worker)."""
        for line in (
            "EngineCore encountered a fatal error.",
            "Traceback (most recent call last):",
            f'  File "{SITE}/v1/executor/multiproc_executor.py", line 440, in get_response',
            "    status, result = mq.dequeue(timeout=dequeue_timeout)",
            "TimeoutError: RPC call to execute_model timed out.",
        ):
            self.record("ERROR", "core.py:1512", line, process="EngineCore")

    def engine_core_exited(self) -> None:
        """The API server's side of an EngineCore that is gone (killed, or failed as above);
        vLLM prints a traceback between the last two lines, left out here to keep the
        captured tail short."""
        self.record(
            "WARNING",
            "core_client.py:817",
            "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
        )
        for line, step in (
            (770, "start timeout=default"),
            (772, "stopping engine manager"),
            (774, "engine manager stopped"),
            (775, "cleaning up background resources"),
            (777, "complete"),
        ):
            self.record("INFO", f"core_client.py:{line}", f"[shutdown] MPClient: {step}")
        self.record("ERROR", "async_llm.py:906", "AsyncLLM output_handler failed.")
        self.record("ERROR", "async_llm.py:906", f"{DEAD_ERROR}: {ENGINE_DEAD}")

    def stream_failed(self, api: str) -> None:
        """A stream generator that met the dead engine (chat and completions catch it)."""
        where, what = STREAM_GENERATORS[api]
        self.record("ERROR", where, f"Error in {what} stream generator.")
        self.record("ERROR", where, f"{DEAD_ERROR}: {ENGINE_DEAD}")

    def legacy_death(self, blocks: int) -> None:
        """The stand-in's first death shape (`die`): the assertion, then EngineDeadError."""
        self.kv_cache_assertion(blocks)
        self.record("ERROR", "async_llm.py:906", "AsyncLLM output_handler failed.")
        self.record("ERROR", "async_llm.py:906", f"{DEAD_ERROR}: {ENGINE_DEAD}")

    def shutdown(self) -> None:
        self.uvicorn("Shutting down")
        self.uvicorn("Waiting for application shutdown.")
        self.uvicorn("Application shutdown complete.")
        self.uvicorn(f"Finished server process [{self.pid}]")
