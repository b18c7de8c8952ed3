"""A running command's output and exit, as run() waits for them: the output pipe and the exit
in one poll, and the last bytes of the output kept."""

from __future__ import annotations

import codecs
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable

from ralph_runner.process.registry import Running

log = logging.getLogger(__name__)

_READ_SIZE = 64 * 1024  # bytes per read from the command's output pipe
_REAP_POLL = 0.05  # seconds between looks at an exit where no pidfd tells it (a thread reaps)


class OutputTail:
    """Receives the output as read from the command's pipe and keeps only the last `limit`
    bytes: raw bytes, so byte counts stay exact and a UTF-8 character split across two reads is
    decoded whole."""

    def __init__(self, limit: int, on_output: Callable[[str], None] | None) -> None:
        self.limit = max(limit, 0)
        self.total = 0
        self._buffer = bytearray()
        self._on_output = on_output
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self._buffer += chunk
        if len(self._buffer) > 2 * self.limit + _READ_SIZE:  # trim in batches, not every chunk
            del self._buffer[: len(self._buffer) - self.limit]
        if self._on_output is not None:
            self._notify(self._decoder.decode(chunk))

    def close(self) -> None:
        if self._on_output is not None:
            self._notify(self._decoder.decode(b"", final=True))

    def _notify(self, text: str) -> None:
        # The callback runs while the command's pipe is read: if it raised, reading would stop
        # and a chatty command would block forever on a full pipe. Report once, stop calling it.
        if not text or self._on_output is None:
            return
        try:
            self._on_output(text)
        except Exception:
            log.exception("on_output callback failed; live output disabled for this command")
            self._on_output = None

    def result(self) -> tuple[str, int]:
        """The kept text and how many bytes were cut from the front."""
        kept = bytes(self._buffer[-self.limit :]) if self.limit else b""
        cut = self.total - len(kept)
        if cut:  # don't start the text with half a character
            skip = 0
            while skip < min(3, len(kept)) and kept[skip] & 0xC0 == 0x80:
                skip += 1
            kept, cut = kept[skip:], cut + skip
        return kept.decode("utf-8", errors="replace"), cut


def exits_within(pid: int, seconds: float) -> bool:
    """Has our child `pid` exited (not reaped: sh does) within `seconds`? A pid already reaped
    (a killed tree guard that a wait elsewhere collected) has exited too."""
    deadline = time.monotonic() + seconds
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd (Linux before 5.3)
        try:
            while not os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_REAP_POLL)
        except ChildProcessError:
            pass
        return True
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)


class Watched:
    """A command's output pipe and its exit in one poll: output is handed on as it comes, the
    exit is seen at once, and nothing wakes in between. The exit comes from the process's pidfd
    (Linux 5.3+), which does not reap it (sh does); on older kernels a thread reaps it."""

    def __init__(self, running: Running, output: int, tail: OutputTail) -> None:
        self.command, self.output, self.tail = running.command, output, tail
        self.poller = select.poll()
        self.poller.register(output, select.POLLIN)
        self.open = True  # the pipe has not reached end-of-file
        self.exited = False
        self.reaped: threading.Event | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(running.pid)
        except OSError:
            self.pidfd = None
            self.reaped = threading.Event()
            threading.Thread(target=self._reap, name=f"reap {running.pid}", daemon=True).start()
        else:
            self.poller.register(self.pidfd, select.POLLIN)

    def _reap(self) -> None:
        assert self.reaped is not None
        try:
            self.command.wait()
        finally:
            self.reaped.set()

    def wait(self, seconds: float) -> None:
        """Hand on what output comes, note the exit; at most `seconds`."""
        if self.reaped is not None:
            seconds = min(seconds, _REAP_POLL)
        for fd, _ in self.poller.poll(math.ceil(seconds * 1000)):
            if fd == self.output:
                self._read()
            elif fd == self.pidfd:
                self.exited = True
                self.poller.unregister(fd)  # readable from now on: stop asking
        if self.reaped is not None and self.reaped.is_set():
            self.exited = True

    def drain(self, seconds: float) -> None:
        """The output still in the pipe, until end-of-file or `seconds` (a grandchild that keeps
        the pipe open after the command ended is not waited for)."""
        if self.pidfd is not None and not self.exited:
            self.poller.unregister(self.pidfd)
        deadline = time.monotonic() + seconds
        while self.open and (left := deadline - time.monotonic()) > 0:
            if not self.poller.poll(math.ceil(left * 1000)):
                return
            self._read()

    def _read(self) -> None:
        chunk = os.read(self.output, _READ_SIZE)
        if chunk:
            self.tail.write(chunk)
        else:
            self.open = False
            self.poller.unregister(self.output)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
