"""Files that survive crashes: atomic replacement and durable appends.

Readers and a kill -9 see a replaced file's old or new bytes, never half of them; an append is
one O_APPEND write, fsynced, that a full disk cuts back instead of leaving torn.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from ralph_runner.errors import FatalError, Problem

TEMP_SUFFIX = ".ralph-tmp"
_write_lock = threading.Lock()  # one fixed temp name per target: writers in one process take turns


def write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` so that readers and crashes see the old or the new bytes only;
    FatalError naming the file when it cannot be written (no space, no permission). `durable`
    also fsyncs, so that the new bytes survive a power loss, not only a crash of ralph-run.

    The temp file's name is fixed per target (`.NAME.ralph-tmp`), so a crash leaves at most one
    behind, the next write reuses it, and `git.exclude_from_git` keeps it out of `git status`.
    A symlink is followed (its target is replaced) and an existing file keeps its mode.
    """
    target = Path(os.path.realpath(path))
    temp = target.with_name(f".{target.name}{TEMP_SUFFIX}")
    with _write_lock:
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.fchmod(fd, os.stat(target).st_mode & 0o7777)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, target)
            if durable:
                fsync_directory(target.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise FatalError(Problem(f"cannot write: {e.strerror}", str(path))) from None


def fsync_directory(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable; OSError when it cannot be opened or
    synced (a caller to whom that is best effort suppresses it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_durably(path: Path, text: str) -> None:
    """Append with one O_APPEND write and fsync; never rewrites what is there.

    If an earlier write was torn (kill -9), the file ends mid-line: start on a fresh line so the
    new record does not fuse with the torn one. A write the disk cannot hold (ENOSPC half-way
    through) is cut off again, so a full disk leaves no torn record; the caller reports it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        data = text.encode("utf-8")
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
    if created:  # the new file's directory entry too (best effort: some filesystems refuse)
        with contextlib.suppress(OSError):
            fsync_directory(path.parent)
