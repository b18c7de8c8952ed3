"""Real coding agents (opencode, codex, aider, claude) in a real `ralph-run` loop on the stand-in.

Each agent is the binary `ci/install-agents.sh` put under `.cache/`; a test that finds it absent
skips with one line. The loop's agent step is the shipped recipe (`runbooks/agents/NAME.yaml`,
included as an operator includes it); the stand-in runs with a script (`SCRIPT` for its start
script) that makes its "model" answer with the tool calls or the whole files that tick the item
and commit. Every agent gets a HOME of its own under the test's tmp directory (its databases,
logs, config and caches land there), with the agents' bin directories first on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from support.e2e import Scenario, make_workspace, runbook
from support.standin import ROOT, wait_for

CACHE = ROOT / ".cache"
NODE_BIN = CACHE / "agents" / "node_modules" / ".bin"
AIDER_BIN = CACHE / "aider-venv" / "bin"
RECIPES = ROOT / "runbooks" / "agents"
BINARIES = {
    "opencode": NODE_BIN / "opencode",
    "codex": NODE_BIN / "codex",
    "aider": AIDER_BIN / "aider",
    "claude": NODE_BIN / "claude",
}
STEP_NAMES = {
    "opencode": "run opencode",
    "codex": "run codex",
    "aider": "run aider",
    "claude": "run claude",
}
PROMPT = "Read PLAN.md. Do exactly this item, tick it in CHECKLIST.md, commit: {{ item.text }}\n"


def require(agent: str) -> Path:
    """The agent's binary, or the test skips naming the agent first (CI excuses a skip by what
    its reason names before its first ": ", tests/support/tiers.py), then what the install said."""
    binary = BINARIES[agent]
    if not binary.exists():
        said = CACHE / "install-agents.out"
        lines = said.read_text(errors="replace").splitlines() if said.exists() else []
        why = lines[-1].strip() if lines else "run ci/install-agents.sh"
        pytest.skip(f"{agent} not installed at {binary.relative_to(ROOT)}: {why}")
    return binary


def isolate_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME and the XDG directories in `home`, the agents first on PATH: what ralph-run and
    the agents it starts inherit."""
    for name, sub in (
        ("XDG_CONFIG_HOME", ".config"),
        ("XDG_DATA_HOME", ".local/share"),
        ("XDG_CACHE_HOME", ".cache"),
        ("XDG_STATE_HOME", ".local/state"),
    ):
        (home / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(name, str(home / sub))
    monkeypatch.setenv("HOME", str(home))
    # opencode npm-installs its plugin SDK into every config dir at start (a failure is only a
    # warning): offline, so that the tests' network stays on loopback
    monkeypatch.setenv("npm_config_offline", "true")
    monkeypatch.delenv("CODEX_HOME", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(NODE_BIN), str(AIDER_BIN), os.environ["PATH"]]))


def agent_steps(agent: str, recipe: bool = True) -> list[dict[str, Any]]:
    """The loop: the seed's checks around the agent; `recipe`: the shipped recipe (else the
    plain `aider` line an operator might write, for the housekeeping test)."""
    if recipe:
        step: dict[str, Any] = {"include": str(RECIPES / f"{agent}.yaml")}
    else:
        step = {
            "name": STEP_NAMES[agent],
            "shell": "aider --model openai/{{ model }} --openai-api-base {{ base_url }}"
            " --edit-format whole --yes-always --no-check-update --no-analytics"
            " --message {{ prompt }} CHECKLIST.md",
            "env": {"OPENAI_API_KEY": "none", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            "timeout": 300,
        }
    return [
        {"ensure_alive": {"phase": "start"}},
        step,
        {"ensure_alive": {"phase": "post-step"}},
        {"verify": {"checked": True, "committed": True}},
    ]


class AgentScenario(Scenario):
    """A Scenario whose loop runs a real agent against the scripted stand-in."""

    def __init__(self, root: Path, agent: str) -> None:
        super().__init__(root)
        self.agent = agent
        self.step = STEP_NAMES[agent]
        self.script = root / "script.yaml"

    def prepare_agent(
        self,
        items: Sequence[str],
        script: dict[str, Any] | None = None,
        recipe: bool = True,
        **settings: Any,
    ) -> AgentScenario:
        make_workspace(self.workspace, items)
        self.script.write_text(yaml.safe_dump(script or {}, sort_keys=False))
        book = runbook(watch=0.5, probe_timeout=2, interval=0.2, **settings)
        book["prompt"] = PROMPT
        book["vars"]["standin_script"] = str(self.script)
        book["vars"]["opencode_config"] = str(RECIPES / "opencode.json")
        book["recovery"]["steps"][0]["shell"] = (
            "SCRIPT={{ standin_script }} " + book["recovery"]["steps"][0]["shell"]
        )
        book["loop"]["steps"] = agent_steps(self.agent, recipe)
        self.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
        self.standin.start(HEALTH_TIMEOUT="1", SCRIPT=str(self.script))
        return self

    # what the agent did

    def git(self, *args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(self.workspace), *args], capture_output=True, text=True, check=True
        )
        return done.stdout

    def commits(self) -> list[str]:
        return self.git("log", "--format=%s").splitlines()

    def dirty(self) -> str:
        return self.git("status", "--porcelain")

    # its processes

    def agent_tree(self, ralph_pid: int) -> list[psutil.Process]:
        """ralph-run's descendants now but its tree guard (it lives as long as the run): the
        step's shell, the agent and whatever the agent started."""
        try:
            descendants = psutil.Process(ralph_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [
            p for p in descendants if "ralph_runner.process.tree_guard" not in " ".join(_cmdline(p))
        ]

    def working_in(self, command: str) -> list[psutil.Process]:
        """Live processes running `command` with their current directory in the workspace,
        wherever they are in the process table (an agent's background job may leave its tree)."""
        found = []
        for process in psutil.process_iter():
            try:
                if " ".join(process.cmdline()) == command and Path(process.cwd()) == self.workspace:
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def step_session(self, ralph_pid: int) -> list[psutil.Process]:
        """Every live process in the session ralph-run started the agent's step in."""
        sids = {_sid(p) for p in self.agent_tree(ralph_pid) if _ppid(p) == ralph_pid}
        sids.discard(None)
        return [p for p in psutil.process_iter() if _sid(p) in sids]

    def wait_agent_running(self, ralph_pid: int, timeout: float = 60) -> list[psutil.Process]:
        """The step's tree once the agent's own process runs under it."""

        def running() -> list[psutil.Process] | None:
            tree = self.agent_tree(ralph_pid)
            names = " ".join(" ".join(_cmdline(p)) for p in tree)
            return tree if re.search(rf"\b{self.agent}\b", names) else None

        return wait_for(running, timeout, f"{self.agent} running under ralph-run")

    def prompt_tokens(self) -> float:
        """The stand-in's prompt token counter (summed over its label sets)."""
        text = httpx.get(f"{self.standin.root_url}/metrics", timeout=3).text
        total = 0.0
        for line in text.splitlines():
            if line.split("{", 1)[0].split(" ", 1)[0] == "vllm:prompt_tokens_total":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_agent_asked(self, timeout: float = 90) -> None:
        """Until the agent's first request reached the "model": its prompt (hundreds to
        thousands of tokens; a probe's canary has one) moved the prompt counter past 500."""
        wait_for(lambda: self.prompt_tokens() > 500, timeout, f"{self.agent}'s first request")


def _sid(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


def _ppid(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:  # it ended since the tree was read
        return None


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def ended(process: psutil.Process) -> bool:
    """True once the process has ended (a zombie has); never fooled by a recycled pid."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_all_gone(processes: Sequence[psutil.Process], timeout: float) -> float:
    """Seconds until every one of `processes` has ended; fails the test at `timeout`."""
    start = time.monotonic()
    alive: list[str] = []

    def gone() -> bool:
        alive[:] = [f"{p.pid} {' '.join(_cmdline(p))}" for p in processes if not ended(p)]
        return not alive

    try:
        wait_for(gone, timeout, "the agent's tree to end")
    except AssertionError:
        raise AssertionError(f"still running after {timeout} s: {alive}") from None
    return time.monotonic() - start
