"""On a machine where llama-server could not be built, the llama.cpp tier skips every test with
the install's one-line reason, and under CI only the excuse ci/run-tests.sh writes from that
line (`llamacpp/llama.cpp: ...`) lets the run pass. The tier runs in a copy of the suite under
tmp_path, whose `.cache/` has no llama.cpp (or says why), so this checkout's install does not
matter."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tier_copy import copy_of_the_tier, count_tests, run_the_tier

TIER = count_tests("llamacpp")  # the tier's tests, each of which must skip


@pytest.mark.parametrize("unavailable", [False, True], ids=["not-installed", "unavailable"])
def test_without_llama_server_every_test_skips_with_the_installs_reason(
    tmp_path: Path, unavailable: bool
) -> None:
    checkout = copy_of_the_tier(tmp_path, "llamacpp")
    reason = "llama.cpp not installed: run ci/install-llamacpp.sh"
    if unavailable:
        (checkout / ".cache").mkdir()
        why = "llama-server did not build (see .cache/install-llamacpp.log)"
        (checkout / ".cache" / "llamacpp.unavailable").write_text(why + "\n")
        reason = f"llama.cpp unavailable here: {why}"
    code, output = run_the_tier(checkout, "llamacpp")
    assert code == 0, output
    assert re.search(rf"^{TIER} skipped in ", output.splitlines()[-1]), output
    assert reason in output


def test_under_ci_the_skipped_tier_fails_the_run_unless_its_install_said_why(
    tmp_path: Path,
) -> None:
    checkout = copy_of_the_tier(tmp_path, "llamacpp")
    code, output = run_the_tier(checkout, "llamacpp", CI="true")
    assert code == 1, output
    assert re.search(
        rf"CI: the llamacpp tier skipped {TIER} test\(s\) that RALPH_ALLOW_SKIP", output
    )
    excuse = "llamacpp/llama.cpp: llamacpp tier: skipped: no c++ here to build llama-server"
    code, output = run_the_tier(checkout, "llamacpp", CI="true", RALPH_ALLOW_SKIP=excuse)
    assert code == 0, output
    assert f"excused by RALPH_ALLOW_SKIP: {excuse}" in output
