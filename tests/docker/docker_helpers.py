"""The docker tier's parts: a compose service running the vLLM stand-in, and the vllm.yaml run.

`ComposeService` is one service of runbooks/compose/standin.yml under a name and port of its own
(a test run never meets another's container), driven by the same start script and compose file
an operator uses. `vllm_runbook` is runbooks/vllm.yaml as shipped, with only its agent command
replaced by the stand-in agent: probes, collectors and recovery are the real runbook's.
"""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from support.standin import ROOT, StandIn, free_port

IMAGE = "ralph-standin:latest"
COMPOSE_DIR = ROOT / "runbooks" / "compose"
START_SCRIPT = COMPOSE_DIR / "start_vllm.sh"
STANDIN_COMPOSE = COMPOSE_DIR / "standin.yml"
DOCKERD_SCRIPT = ROOT / "ci" / "dockerd.sh"
INSTALL_SCRIPT = ROOT / "ci" / "install-docker.sh"
ROOTFS_DONE = ROOT / ".cache" / "rootfs.done"
NAME_PREFIX = f"ralph-test-{os.getpid()}-"  # every container of this pytest run
_numbers = itertools.count(1)


def run(command: list[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
    """A command's outcome, output as text; never raises for a failing exit code."""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def first_line(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()
    return text[0]


def containers(prefix: str = NAME_PREFIX, running_only: bool = False) -> list[str]:
    """Names of the containers whose name starts with `prefix`."""
    command = ["docker", "ps", "--filter", f"name=^{prefix}", "--format", "{{.Names}}"]
    if not running_only:
        command.insert(2, "-a")
    return run(command).stdout.split()


def compose_command() -> list[str]:
    """As start_vllm.sh chooses: the v2 plugin where there is one, else docker-compose (v1)."""
    if run(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


class ComposeService:
    """The stand-in as a compose service: container `name`, serving 127.0.0.1:`port`."""

    def __init__(self, root: Path) -> None:
        self.name = f"{NAME_PREFIX}{next(_numbers)}"
        self.port = free_port()
        self.state_dir = root / "standin-state"
        self.server = StandIn(self.state_dir, self.port)  # its URLs, faults and health
        self.url = self.server.url
        self.start_script = START_SCRIPT
        self.compose = compose_command()

    @property
    def env(self) -> dict[str, str]:
        """What start_vllm.sh and the compose file read; ralph-run's recovery inherits it."""
        return {
            **os.environ,
            "CONTAINER": self.name,
            "PORT": str(self.port),
            "STATE_DIR": str(self.state_dir),
            "COMPOSE_FILE": str(STANDIN_COMPOSE),
            "COMPOSE_PROJECT_NAME": self.name,
            "POLL_INTERVAL": "0.2",
            "START_TIMEOUT": "60",
        }

    def start(self) -> subprocess.CompletedProcess:
        done = run([str(START_SCRIPT)], timeout=90, env=self.env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    def status(self) -> str:
        """`docker ps -a` Status of exactly this container ("" when there is none)."""
        command = ["docker", "ps", "-a", "--filter", f"name=^{self.name}$"]
        return run([*command, "--format", "{{.Status}}"]).stdout.strip()

    def logs(self) -> str:
        done = run(["docker", "logs", self.name])
        return done.stdout + done.stderr

    def down(self) -> subprocess.CompletedProcess:
        """`docker compose down`: stops and removes the container, as its operator would."""
        return run([*self.compose, "down", "-t", "5"], timeout=90, env=self.env)


def vllm_runbook(path: Path, agent_sleep: str = "0") -> str:
    """runbooks/vllm.yaml with its agent step running the stand-in agent; the agent step's name.

    The agent sleeps `agent_sleep` seconds (a Jinja expression: it may use `iteration`) before
    its call, so that a test can break the server while it waits.
    """
    runbook = yaml.safe_load((ROOT / "runbooks" / "vllm.yaml").read_text(encoding="utf-8"))
    (step,) = [s for s in runbook["loop"]["steps"] if "opencode" in str(s.get("shell", ""))]
    step["shell"] = (
        f"{shlex.quote(sys.executable)} -m ralph_runner.standin.agent"
        " --url {{ base_url }} --model {{ model }} --timeout 30"
        f" --sleep {{{{ {agent_sleep} }}}} -- {{{{ prompt }}}}"
    )
    path.write_text(yaml.safe_dump(runbook, sort_keys=False), encoding="utf-8")
    return step["name"]
