"""The console names the cause of a failure (issue 21): the line that explains it, not the
last line printed. vLLM's start-up traceback ends in a wrapper ("See root cause above.") under
its root cause; opencode's JSON error ends in `}`, its message is inside."""

from __future__ import annotations

from ralph_runner import events
from ralph_runner.loop import failures
from ralph_runner.output.lines import human_line
from ralph_runner.process import output_text

VLLM_CPU_MEMORY = """\
INFO 12-01 21:40:01 [api_server.py:1] vLLM API server version 0.32.0
(EngineCore_DP0 pid=4242) Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py", line 88, in init_device
ValueError: Available memory on node 0 (8.19/9.59 GiB) on startup is less than desired CPU \
memory utilization (0.92, 8.82 GiB)
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
OPENCODE_MODEL_NOT_FOUND = """\
{
  "type": "error",
  "error": {
    "name": "ProviderModelNotFoundError",
    "data": {
      "providerID": "vllm",
      "modelID": "qwen3-coder",
      "message": "Model not found: vllm/qwen3-coder"
    }
  }
}
"""


def test_the_root_cause_of_a_traceback_not_its_wrapper() -> None:
    line = output_text.explaining_line(VLLM_CPU_MEMORY)
    assert line is not None and line.startswith("ValueError: Available memory on node 0")


def test_an_agents_json_error_gives_its_message() -> None:
    assert (
        output_text.explaining_line(OPENCODE_MODEL_NOT_FOUND) == "Model not found: vllm/qwen3-coder"
    )
    reason = failures.reason("run opencode", "exit 1", OPENCODE_MODEL_NOT_FOUND, True)
    assert reason == "run opencode: exit 1: Model not found: vllm/qwen3-coder"


def test_output_with_no_error_line_keeps_the_last_line() -> None:
    assert output_text.explaining_line("working\nstill working\n") is None
    assert failures.reason("agent", "exit 1", "a\nthe end", True) == "agent: exit 1: the end"


def test_the_console_names_a_skipped_recovery_step_with_its_condition() -> None:
    line = human_line(
        events.RecoveryStep(attempt=1, step="stop the hung server", skipped="when: death.hung"),
        lambda _colour, text: text,
    )
    assert line == "  ⏭ recovery attempt 1: stop the hung server: skipped (when: death.hung)"


def test_the_console_names_the_fault_and_the_signature_of_a_death() -> None:
    plain = lambda _colour, text: text  # noqa: E731
    death = events.Death(death=2, phase="during-step", fault="engine dead", reason="HTTP 500")
    assert human_line(death, plain) == "💀 death #2 at during-step: engine dead (HTTP 500)"
    report = events.Report(
        death=2, log="logs/d.log", signature="AssertionError: num_required_blocks"
    )
    assert str(human_line(report, plain)).endswith(
        "🔎 signature: AssertionError: num_required_blocks"
    )
