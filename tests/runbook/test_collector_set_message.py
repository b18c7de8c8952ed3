"""An unknown collector set names each place it was looked for once, as an absolute path, and
the set meant (issue 31, item 8: "looked in collectors, collectors, CLONE/collectors")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

RUNBOOK = """\
name: collectors
prompt: "do {{ item.text }}"
loop:
  steps:
    - name: agent
      shell: "true"
diagnostics:
  collect:
    - use: vlm
"""


def test_an_unknown_set_names_distinct_absolute_places_and_the_close_match(tmp_path: Path):
    work = tmp_path / "project"
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    (work / "CHECKLIST.md").write_text("- [ ] one\n")
    (work / "runbook.yaml").write_text(RUNBOOK)
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "runbook.yaml", "--check"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    found = re.search(
        r"no collector set 'vlm'; did you mean 'vllm'\? \(looked in ([^)]*)\)", done.stderr
    )
    assert found, done.stderr
    places = found.group(1).split(", ")
    assert len(places) == len(set(places)) == 3, places
    assert all(Path(place).is_absolute() for place in places), places
    assert places[:2] == [str(work / "collectors"), str(tmp_path / "collectors")]
