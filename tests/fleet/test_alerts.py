"""deploy/alerts.yml: promtool accepts it, and its own unit tests (deploy/alerts_test.yml: a
healthy loop, a killed one, one that gave up, one that dies often) fire the right alerts."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from support.standin import ROOT

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install -y prometheus)"
)


@pytest.mark.parametrize(
    "command", [["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]]
)
def test_promtool_accepts_the_alert_rules(command: list[str]) -> None:
    result = subprocess.run(
        [PROMTOOL, *command], cwd=ROOT / "deploy", capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
