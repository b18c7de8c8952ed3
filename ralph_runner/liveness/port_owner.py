"""Is the server that answers the probes ours? A loopback port is anyone's to take.

After a crash, another local user who binds the server's port first answers as a healthy
server: the start scripts said "already running", the probes passed, and every prompt went to
that user, whose answers carry the tool calls the agent runs (issue 37, High 1). So a server on
a loopback port is trusted only when its listening socket is ours: the probes' loopback ports are
looked up in the kernel's tables (process/listener.py) at every ensure_alive that finds the
service alive and whenever a recovery or a start says it is back. Root's socket counts as ours:
root can act as us anyway, and docker's port proxy (`docker-proxy`) listens as root for a
published port; so do the runbook's `health.trusted_users` (a service account that runs the
server). A port nobody is seen to hold (docker's NAT without its proxy) is not refused:
another user's server would have to listen there to be reached.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import BaseModel

from ralph_runner.liveness.health import ProbeSpec
from ralph_runner.probes import ProbeResult
from ralph_runner.process import listener

REASON = "foreign"  # a probe's reason when another user holds its port (faults.FOREIGN)
ROOT = 0
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Owners:
    """What the kernel says of the probes' loopback ports: a failed result for each probe whose
    port another user holds, and why they could not be looked up (None: they were)."""

    foreign: tuple[ProbeResult, ...]
    unknown: str | None = None


def check(
    specs: Sequence[ProbeSpec], trusted: Iterable[str | int] = (), me: int | None = None
) -> Owners:
    """Who holds each probe's loopback ports; `trusted`: other users (names or uids) whose
    socket counts as ours; `me`: our uid (the effective one)."""
    me = os.geteuid() if me is None else me
    ours = {me, ROOT, *uids(trusted)}
    wanted = [(spec, loopback_ports(spec.params)) for spec in specs]
    if not any(ports for _, ports in wanted):
        return Owners(())
    found = listener.listeners()
    foreign = []
    for spec, ports in wanted:
        held = [
            f"port {port} is held by {_uids(theirs)}, not by us (uid {me})"
            for port in ports
            if (theirs := sorted({s.uid for s in found.on_loopback(port)} - ours))
        ]
        if held:
            foreign.append(ProbeResult(spec.name, spec.kind, False, REASON, "; ".join(held), 0.0))
    return Owners(tuple(foreign), found.unknown)


def uids(users: Iterable[str | int]) -> set[int]:
    """The uids of users given by name or number; a name no user has trusts no one."""
    found = set()
    for user in users:
        if isinstance(user, int) or user.isdigit():
            found.add(int(user))
            continue
        try:
            found.add(pwd.getpwnam(user).pw_uid)
        except KeyError:
            continue
    return found


def loopback_ports(params: object) -> list[int]:
    """The ports of this machine's loopback that a probe reaches: its http(s) URLs (nested
    params too: progress's completion) and a `host`/`port` pair (tcp), by their host."""
    if not isinstance(params, BaseModel):
        return []
    ports: list[int] = []
    host, port = getattr(params, "host", None), getattr(params, "port", None)
    if isinstance(host, str) and isinstance(port, int) and is_loopback(host):
        ports.append(port)
    for name in type(params).model_fields:
        value = getattr(params, name)
        if isinstance(value, BaseModel):
            ports += loopback_ports(value)
        elif isinstance(value, str) and (url_port := _url_port(value)) is not None:
            ports.append(url_port)
    return sorted(set(ports))


def is_loopback(host: str) -> bool:
    """localhost, or an address of the loopback (127.0.0.0/8, ::1), or none (0.0.0.0, :::
    a connection to it reaches this machine). Other names are not resolved here."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _url_port(text: str) -> int | None:
    parts = urlsplit(text.strip())
    if parts.scheme.lower() not in DEFAULT_PORTS or not parts.hostname:
        return None
    if not is_loopback(parts.hostname):
        return None
    try:
        return parts.port or DEFAULT_PORTS[parts.scheme.lower()]
    except ValueError:  # a port that is no number: the probe itself says what is wrong
        return None


def _uids(uids: list[int]) -> str:
    return ("uid " if len(uids) == 1 else "uids ") + ", ".join(str(uid) for uid in uids)
