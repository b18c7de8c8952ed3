"""Run a probe as the loop does: its params validated like the runbook loader's, then run."""

from __future__ import annotations

import httpx

from ralph_runner import probes
from ralph_runner.probes import ProbeContext, ProbeResult, run_probe
from ralph_runner.process.connection import Connection, for_host


def probe(
    kind: str,
    params: object,
    client: httpx.Client,
    connection: Connection | None = None,
    timeout: float = 2.0,
) -> ProbeResult:
    """Validate like the runbook loader does, then run: the probe's whole public path."""
    if kind != "command":
        params = probes.KINDS[kind].Params.model_validate(params)
    ctx = ProbeContext(client=client, connection=connection or for_host({}), timeout=timeout)
    return run_probe(f"{kind} probe", kind, params, ctx)
