"""First contact with an ssh host, said aloud.

ralph-run's ssh runs with `StrictHostKeyChecking=accept-new` (a fleet of new GPU boxes must
not stop at a prompt no one answers) and `LogLevel=ERROR` (ssh's own notices would be mixed
into every command's output). So ssh adds a host it never met to known_hosts without a word:
whoever answers at that address the first time is trusted from then on. ralph-run says so
instead: before its first command to a host it asks known_hosts (`ssh -G` for the files and
the name ssh uses, `ssh-keygen -F` to look), and when that command added the key it prints a
warning naming the host and the key's fingerprint, to compare with the host's own
(`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on it). Once per host and process.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

from ralph_runner.process import execute

ASK_TIMEOUT = 5.0  # seconds for `ssh -G` and `ssh-keygen`: local, no network
_asked: set[tuple[str, ...]] = set()  # the client lines already looked up in this process
_lock = threading.Lock()


@dataclass(frozen=True)
class Unknown:
    """A host known_hosts did not know before the command: where ssh would add it."""

    name: str  # as known_hosts writes it: "host" or "[host]:port"
    files: tuple[str, ...]


def before(destination: list[str]) -> Unknown | None:
    """Looked up once per `destination` (ssh's options, port, user, host: no command): the
    host's entry to watch for when known_hosts lacks it; None when it is known (or cannot be
    told, or was asked already)."""
    key = tuple(destination)
    with _lock:
        if key in _asked:
            return None
        _asked.add(key)
    settings = _settings(destination)
    if settings.get("stricthostkeychecking") != "accept-new":
        return None  # the operator's own setting: ssh asks or refuses, as they chose
    host = settings.get("hostkeyalias") or settings.get("hostname", "")
    port = settings.get("port", "22")
    name = host if port == "22" else f"[{host}]:{port}"
    files = tuple(
        os.path.expanduser(f) for f in settings.get("userknownhostsfile", "").split() if f
    )
    if not host or not files or _fingerprints(name, files):
        return None
    return Unknown(name, files)


def after(destination: list[str], unknown: Unknown) -> None:
    """After the first command: warn when ssh added the host's key; else look again next time
    (the command did not reach it)."""
    found = _fingerprints(unknown.name, unknown.files)
    if not found:
        with _lock:
            _asked.discard(tuple(destination))
        return
    keys = "; ".join(found)
    message = (
        f"ralph-run: warning: first contact with ssh host {unknown.name}: its key was added to "
        f"{unknown.files[0]} without asking (StrictHostKeyChecking=accept-new): {keys}. Compare "
        "it with the host's own key (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub on the host)"
    )
    # stderr, as ssh's own warnings: this layer has no event bus (process/ is below output/)
    print(message, file=sys.stderr, flush=True)


def _settings(destination: list[str]) -> dict[str, str]:
    """`ssh -G`'s answer for the destination: the options ssh would use, lower-case keys."""
    result = execute.run(["ssh", "-G", *destination], timeout=ASK_TIMEOUT)
    if result.exit_code != 0:
        return {}
    settings: dict[str, str] = {}
    for line in result.output.splitlines():
        key, _, value = line.partition(" ")
        settings.setdefault(key.lower(), value.strip())
    return settings


def _fingerprints(name: str, files: tuple[str, ...]) -> list[str]:
    """The fingerprints known_hosts has for `name` ("SHA256:... (ED25519)"), none when absent."""
    found = []
    for path in files:
        if not os.path.exists(path):
            continue
        result = execute.run(["ssh-keygen", "-l", "-F", name, "-f", path], timeout=ASK_TIMEOUT)
        for line in result.output.splitlines() if result.exit_code == 0 else []:
            words = line.split()  # "[host]:port ED25519 SHA256:..." (after a "# Host" line)
            if line.startswith("#") or len(words) < 3:
                continue
            found.append(f"{words[2]} ({words[1]})")
    return found
