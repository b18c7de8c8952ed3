"""One recovery per service per host, however many loops watch it.

Several loops on one GPU box (one repo each) share one vLLM. When it dies, every loop sees the
death; if each ran its recovery, they would start the server twice at once (`bind failed`), and
a start script that stops a server that is "up but not healthy" lets one loop kill the server
another is starting. So recovery runs under a host-wide lock, one per service: an flock on a
file under the user's runtime directory, which the kernel releases when its holder dies (a loop
killed mid-recovery never blocks the others). The holder writes who it is into the file; a loop
that finds the lock taken waits for it (bounded by the recovery's own limits), then looks at
the service again before it runs any step of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ralph_runner.errors import FatalError
from ralph_runner.process.private_dir import private_directory

POLL = 0.2  # seconds between two tries of a taken lock
URL = re.compile(r"https?://[^\s'\",)]+")


@dataclass
class Waited:
    """The lock was taken when we came: by whom, and how long we waited for it."""

    holder: dict
    seconds: float

    def text(self) -> str:
        pid, workdir = self.holder.get("pid", "?"), self.holder.get("workdir", "?")
        return f"the loop of pid {pid} in {workdir}"


def directory() -> Path:
    """Where the locks live: RALPH_LOCK_DIR, else the user's runtime directory, else /tmp."""
    chosen = os.environ.get("RALPH_LOCK_DIR")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"ralph-run-{os.getuid()}"


def prepare() -> Path:
    """The locks' directory, made if missing; FatalError when it is not ours alone. RALPH_LOCK_DIR
    is the operator's choice, made as given; the default one's name is predictable (in /tmp
    without XDG_RUNTIME_DIR, as under the shipped systemd unit), so another user could have made
    it, or planted a symlink for a lock file to be written through: it must be a real directory
    of ours, 0700 (process/private_dir.py). Lock files are opened with O_NOFOLLOW besides."""
    path = directory()
    if os.environ.get("RALPH_LOCK_DIR"):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path
    try:
        return private_directory(path)
    except OSError as exc:
        raise FatalError(
            f"the recovery lock's directory: {exc}; remove it, or set RALPH_LOCK_DIR to a"
            " directory of your own"
        ) from exc


def key_for(name: str | None, probe_params: list[str]) -> str:
    """The service's name: `recovery.lock` when the runbook names one, else the URLs its
    probes ask (two loops on one base URL share the lock, whatever else their probes say)."""
    if name:
        return name
    urls = sorted({url.rstrip("/") for text in probe_params for url in URL.findall(text)})
    return " ".join(urls) or "service"


def in_progress(key: str) -> dict | None:
    """Who holds the service's lock now (a recovery under way, by another loop), or None.
    A death found then is one that loop already captured, at its moment: our diagnostics
    show its recovery, not the death, and the record says so."""
    try:
        fd = os.open(_path(key), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _path(key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return directory() / f"recovery-{digest}.lock"


@contextlib.contextmanager
def held(key: str, me: dict, wait: float, cancel: threading.Event) -> Iterator[Waited | None]:
    """Hold the service's lock. Yields None when it was free, else who held it (we waited);
    past `wait` seconds (or cancelled) it is taken over anyway: a holder that hangs must not
    stop every loop, and the recovery's own limits bound what the holder does."""
    prepare()
    fd = os.open(_path(key), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        waited = _take(fd, wait, cancel)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**me, "key": key, "since": time.time()}).encode(), 0)
        try:
            yield waited
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _take(fd: int, wait: float, cancel: threading.Event) -> Waited | None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        pass
    holder = _holder(fd)
    started = time.monotonic()
    deadline = started + wait
    while time.monotonic() < deadline and not cancel.wait(POLL):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            # Who held it when we came (read again only while its record was being written):
            # a loop that takes it after that holder, only to find the service back, did not
            # bring it back (it named one of the waiters as who did: tests/liveness/test_blame).
            holder = holder or _holder(fd)
    # Past the wait (or cancelled) we go on without the lock: the holder hangs or is slow.
    return Waited(holder, time.monotonic() - started)


def _holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # being written: the next poll reads it whole
        return {}
    return data if isinstance(data, dict) else {}
