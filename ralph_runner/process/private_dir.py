"""A directory of our own in a shared place such as /tmp, where any user may make the name first.

A name like `/tmp/ralph-run-ssh-<uid>` is predictable: another user who makes it first (or
plants a symlink there) would receive what we put in it (an ssh control socket that forwards
our commands and their secrets; a lock file written through a symlink). So such a directory is
made with mode 0700, and an existing one is trusted only when it is a real directory (not a
symlink) that belongs to us and that no one else may enter or write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from ralph_runner.errors import FatalError, Problem


class UnsafeDirectory(OSError):
    """The directory exists but is not ours alone: its message says what is wrong with it."""


def private_directory(path: Path) -> Path:
    """`path`, made 0700 if it is missing (its parent must exist); UnsafeDirectory when it is
    a symlink or not a directory, belongs to another user, or is open to others."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory of ours (a symlink or a file)")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {info.st_uid}, not to uid {os.getuid()}")
    if info.st_mode & 0o077:
        mode = stat.S_IMODE(info.st_mode)
        raise UnsafeDirectory(f"{path} is open to other users (mode {mode:04o}, not 0700)")
    return path


def open_private(path: Path, flags: int) -> int:
    """os.open of one of ralph-run's own files: never through a symlink (FatalError saying so),
    created 0600, not inherited by children. Other OSErrors are the caller's."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        why = "is a symlink: ralph-run never follows one among its own files; remove it"
        raise FatalError(Problem(why, str(path))) from None
