"""`tcp: {host, port}`: something accepts connections there (for services that speak no HTTP)."""

from __future__ import annotations

import socket
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ralph_runner.plugins.fields import Templated
from ralph_runner.plugins.network_errors import classify
from ralph_runner.probes import ProbeContext, Verdict

KIND = "tcp"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"  # the host connected to, from this machine
    port: Templated[Annotated[int, Field(ge=1, le=65535)]]  # the TCP port


def check(params: Params, ctx: ProbeContext) -> Verdict:
    address = f"{params.host}:{params.port}"
    try:
        with socket.create_connection((params.host, params.port), timeout=ctx.timeout):
            pass
    except OSError as exc:
        reason, detail = classify(exc, ctx.timeout)
        return Verdict(False, reason, f"{address}: {detail}")
    return Verdict(True, None, f"{address}: connected")
