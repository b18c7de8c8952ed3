"""Runbook + inventory + `-e` -> a Plan: one host, its variables, paths and connections.

Both the loop and `--check` start from a Plan, so what `--check` shows is what a run does.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ralph_runner import templating
from ralph_runner.durable import redaction
from ralph_runner.errors import FatalError, Problem
from ralph_runner.process import connection
from ralph_runner.runbook import inventory, loader
from ralph_runner.runbook.loader import LoadedRunbook

EXPAND_PASSES = 8


@dataclass
class Plan:
    runbook: LoadedRunbook
    inventory: inventory.Inventory
    host: str
    variables: dict[str, object]
    workdir: Path
    templar: templating.Templar
    extra_vars: dict[str, object]

    @property
    def model(self):
        return self.runbook.model

    def secret_values(self) -> list[str]:
        """What is masked: the values `secrets:` lists and those of variables named like a
        secret (`*key`, `*token*`, `*password*`, `*secret*`: redaction.secret_named), and
        those of environment variables named so (`WANDB_API_KEY`, `GITHUB_PAT`), read or not."""
        listed = [str(self.variables[n]) for n in self.model.secrets if self.variables.get(n)]
        named = [str(v) for n, v in self.variables.items() if redaction.secret_named(n, v)]
        env = self.variables.get("env")
        environ = env.items() if isinstance(env, dict) else ()
        from_env = [str(v) for n, v in environ if redaction.env_secret_named(str(n), v)]
        return listed + named + from_env

    def host_variables(self, host: str) -> dict[str, object]:
        """Variables as seen from `host` (for delegate_to): same runbook vars and -e."""
        if host == self.host:
            return self.variables
        found = self.inventory.select(host)
        return _resolve(self.runbook, self.inventory, found[0], self.extra_vars, self.templar)

    def connection_for(self, host: str | None) -> connection.Connection:
        return connection.for_host(self.host_variables(host or self.host))

    def controller(self) -> connection.Connection:
        """Loop steps (the agent) run on the controller, where the work tree is."""
        return connection.for_host({"ansible_connection": "local"})

    def path(self, key: tuple, template: str) -> Path:
        """A work file (checklist, death log): rendered, relative to the workdir."""
        where = self.runbook.where(key)
        rendered = self.templar.render(template, self.variables, where=where)
        return self.workdir / os.path.expanduser(rendered)


def build(
    runbook_path: str | Path,
    inventory_path: str | Path | None = None,
    limit: str | None = None,
    extra_vars: list[str] | None = None,
    check: bool = False,
) -> list[Plan]:
    """One Plan per selected host (a loop runs one; --check shows them all)."""
    runbook = loader.load(runbook_path)
    inv = inventory.load(inventory_path)
    extra = inventory.parse_extra_vars(extra_vars or [])
    hosts = inv.select(runbook.model.hosts, where=runbook.where(("hosts",)))
    if limit:
        allowed = set(inv.select(limit, where=Problem("", path="--limit")))
        hosts = [h for h in hosts if h in allowed]
    if not hosts:
        raise FatalError(f"no host matches hosts {runbook.model.hosts!r} with --limit {limit!r}")
    return [_plan(runbook, inv, host, extra, check) for host in hosts]


def _plan(
    runbook: LoadedRunbook, inv: inventory.Inventory, host: str, extra: dict, check: bool
) -> Plan:
    """Workdir first (it may use variables), then the variables as seen from the workdir."""
    cwd = Path.cwd()
    here = templating.Templar(cwd, cwd=cwd, check=check)
    base = _resolve(runbook, inv, host, extra, here)
    where = runbook.where(("workdir",))
    workdir = cwd / os.path.expanduser(here.render(runbook.model.workdir, base, where=where))
    templar = templating.Templar(workdir.resolve(), cwd=workdir.resolve(), check=check)
    variables = _resolve(runbook, inv, host, extra, templar)
    for i, name in enumerate(runbook.model.secrets):
        if name not in variables:  # a typo here would leak the secret it meant to hide
            message = f"secrets names {name!r}, which is no variable of host {host!r}"
            raise FatalError(replace(runbook.where(("secrets", i)), message=message))
    return Plan(runbook, inv, host, variables, workdir.resolve(), templar, extra)


def _resolve(
    runbook: LoadedRunbook,
    inv: inventory.Inventory,
    host: str,
    extra: dict,
    templar: templating.Templar,
) -> dict[str, object]:
    merged = inventory.resolve_vars(runbook.model.vars, inv, host, extra)
    merged.setdefault("inventory_hostname", host)
    merged.update(runbook_dir=str(runbook.directory.resolve()), workdir=str(templar.base_dir))
    # the interpreter running ralph-run: `{{ ralph_python }} -m ralph_runner...` works from any
    # folder, in or out of a venv (a bare `python` may be another, or none)
    merged["ralph_python"] = sys.executable
    merged["env"] = dict(os.environ)
    return expand(merged, templar, runbook)


def expand(variables: dict[str, object], templar: templating.Templar, runbook: LoadedRunbook):
    """Render variables that refer to other variables (`url: "{{ base }}/x"`), Ansible-style."""
    pending = {k for k, v in variables.items() if k != "env" and _templated(v)}
    for _ in range(EXPAND_PASSES):
        progress = False
        for name in sorted(pending):
            try:
                variables[name] = templar.render_data(variables[name], variables)
            except FatalError:
                continue
            pending.discard(name)
            progress = True
        if not pending or not progress:
            break
    for name in sorted(pending):  # report the first real error, at the variable's line
        where = runbook.where(("vars", name))
        templar.render_data(variables[name], variables, where=where)
    return variables


def _templated(value: Any) -> bool:
    if isinstance(value, str):
        return templating.has_template(value)
    if isinstance(value, dict):
        return any(_templated(v) for v in value.values())
    if isinstance(value, list):
        return any(_templated(v) for v in value)
    return False
