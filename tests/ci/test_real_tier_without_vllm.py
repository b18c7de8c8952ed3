"""The README's test command is green on a machine without vLLM: the real tier's tests skip with
the install's one-line reason, and the `[stand-in]` halves of test_real_faithful.py, which need
no engine, still run. They used to error: tests/real/conftest.py started the real vLLM whenever
a `[vllm]` item was collected, skipped or not (issue 31, item 15).

The tier runs in a copy of the suite under tmp_path, whose `.cache/` has no vLLM (or says it is
unavailable), so what this checkout has installed does not matter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tier_copy import copy_of_the_tier, run_the_tier


@pytest.mark.parametrize("unavailable", [False, True], ids=["not-installed", "unavailable"])
def test_without_vllm_the_real_tier_skips_with_its_reason_and_the_stand_in_halves_run(
    tmp_path: Path, unavailable: bool
) -> None:
    checkout = copy_of_the_tier(tmp_path, "real")
    reason = "real vLLM not installed: run ci/install-vllm.sh"
    if unavailable:
        (checkout / ".cache").mkdir()
        (checkout / ".cache" / "vllm-venv.unavailable").write_text("no wheel for this CPU\n")
        reason = "real vLLM unavailable here: no wheel for this CPU"
    code, output = run_the_tier(checkout, "real", timeout=300)
    assert code == 0, output
    assert not re.search(r"\berrors?\b", output.splitlines()[-1]), output
    summary = output.splitlines()[-1]
    assert re.match(r"7 passed, \d+ skipped in ", summary), output  # the 7 [stand-in] halves
    assert reason in output
    assert "faithful.py::test_chat_stream_chunks[stand-in]" not in output  # neither error nor skip


def test_under_ci_the_skipped_tier_fails_the_run_unless_it_is_allowed(tmp_path: Path) -> None:
    checkout = copy_of_the_tier(tmp_path, "real")
    code, output = run_the_tier(checkout, "real", timeout=300, CI="true")
    assert code == 1, output
    assert re.search(r"CI: the real tier skipped \d+ test\(s\) that RALPH_ALLOW_SKIP", output)
    code, output = run_the_tier(
        checkout, "real", timeout=300, CI="true", RALPH_ALLOW_SKIP="real/vllm: no vLLM here"
    )
    assert code == 0, output
    assert "excused by RALPH_ALLOW_SKIP: real/vllm: no vLLM here" in output
