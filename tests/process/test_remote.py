"""One runbook, several hosts: collectors and recovery run on the inventory host over real ssh
(sshd on 127.0.0.1), while the loop's steps stay on the controller."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml
from support.sshd import MISSING_REASON, running_sshd, sshd_available

RALPH = [sys.executable, "-m", "ralph_runner"]
pytestmark = pytest.mark.skipif(not sshd_available(), reason=MISSING_REASON)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


def test_collectors_run_on_the_remote_host_and_steps_on_the_controller(tmp_path, sshd):
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("- [ ] one\n")
    remote_vars = {k: str(v) for k, v in sshd.hostvars().items()}
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "gpu_hosts": {
                            "vars": {"service_name": "vLLM"},
                            "hosts": {"spark-b": {**remote_vars, "container": "vllm-b"}},
                        }
                    }
                }
            }
        )
    )
    runbook = tmp_path / "runbook.yaml"
    runbook.write_text(
        textwrap.dedent(f"""\
        hosts: gpu_hosts
        workdir: {work}
        diagnostics:
          collect:
            - name: where am I
              shell: echo "ssh=${{SSH_CONNECTION:+yes}} container={{{{ container }}}}"
            - name: controller side
              delegate_to: localhost
              shell: echo "ssh=${{SSH_CONNECTION:+yes}}"; pwd
        loop:
          steps: [{{ shell: "true" }}]
        """)
    )
    done = subprocess.run(
        [*RALPH, "diagnose", str(runbook), "-i", str(inventory), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    outputs = {c["name"]: c["output"] for c in record["collectors"]}
    assert record["host"] == "spark-b"
    assert outputs["where am I"] == "ssh=yes container=vllm-b\n"
    assert outputs["controller side"] == f"ssh=\n{work}\n"

    check = subprocess.run(
        [*RALPH, str(runbook), "-i", str(inventory), "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
    (plan,) = json.loads(check.stdout)
    assert plan["connection"].startswith("ssh ") and "127.0.0.1" in plan["connection"]
