"""The slurm tier: real jobs on the one-node Slurm that ci/install-slurm.sh starts on this
machine (4 fake GPUs), driven by the real `ralph-run slurm` against the stand-in server. Without
that Slurm each test is skipped with the install's one-line reason, never passed."""

from __future__ import annotations

from pathlib import Path

import pytest
from slurm_helpers import tier_missing


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = tier_missing()
    if reason is None:
        return
    for item in items:
        if Path(str(item.path)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.skip(reason=reason))
