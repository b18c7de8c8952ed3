"""Files that survive crashes: atomic replacement and durable appends; ralph-run's own
directory (`.ralph/`), private to its user, whose files are never opened through a symlink.

Readers and a kill -9 see a replaced file's old or new bytes, never half of them; an append is
one O_APPEND write, fsynced, that a full disk cuts back instead of leaving torn. Files ralph-run
creates are 0600: they hold server logs, prompts and the output of agents.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from pathlib import Path

from ralph_runner.errors import FatalError, Problem

TEMP_SUFFIX = ".ralph-tmp"
_write_lock = threading.Lock()  # one fixed temp name per target: writers in one process take turns
PRIVATE_FILE = 0o600  # the mode of a file ralph-run creates
PRIVATE_DIRECTORY = 0o700  # the mode of .ralph/


def state_directory(path: Path) -> Path:
    """`path` (the workdir's `.ralph/`) made or kept private: created 0700, an existing one of
    ours narrowed to 0700; FatalError when it is a symlink, not a directory, or another user's
    (whoever can write in it could make the next run kill any pid through running.json)."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, PRIVATE_DIRECTORY)
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            why = "is a symlink or a file, not a directory of ralph-run's own: remove it"
            raise FatalError(Problem(why, str(path)))
        if info.st_uid != os.getuid():
            why = f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
            raise FatalError(Problem(why, str(path)))
        if stat.S_IMODE(info.st_mode) != PRIVATE_DIRECTORY:
            os.chmod(path, PRIVATE_DIRECTORY, follow_symlinks=False)
    except OSError as e:
        raise FatalError(Problem(f"cannot create: {e.strerror}", str(path))) from None
    return path


def write_atomic(path: Path, data: bytes, *, durable: bool = True, follow: bool = True) -> None:
    """Replace `path` with `data` so that readers and crashes see the old or the new bytes only;
    FatalError naming the file when it cannot be written (no space, no permission). `durable`
    also fsyncs, so that the new bytes survive a power loss, not only a crash of ralph-run.

    The temp file's name is fixed per target (`.NAME.ralph-tmp`), so a crash leaves at most one
    behind, the next write reuses it, and `git.exclude_from_git` keeps it out of `git status`.
    A symlink is followed (its target is replaced; `follow=False`, for ralph-run's own files:
    the link itself is replaced), an existing file keeps its mode, a new one is 0600.
    """
    target = Path(os.path.realpath(path)) if follow else Path(os.path.abspath(path))
    temp = target.with_name(f".{target.name}{TEMP_SUFFIX}")
    with _write_lock:
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            fd = os.open(temp, flags, PRIVATE_FILE)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.fchmod(fd, os.stat(target).st_mode & 0o7777)
                write_all(fd, data, durable)
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
    fd = open_own_file(path, os.O_RDWR | os.O_APPEND)
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


class NotOurs(OSError):
    """A file ralph-run would write that is a symlink, not a regular file, another user's, or
    hard-linked elsewhere: written through, it would change a file it does not own."""

    def __init__(self, why: str, path: Path | str) -> None:
        super().__init__(errno.EPERM, why, str(path))


SYMLINK = "is a symlink: ralph-run does not write through one (remove it)"


def not_ours(info: os.stat_result) -> str | None:
    """Why a file (lstat or fstat) is not one ralph-run may write, or None when it may: a
    regular file of this user's with no other name (a hard link to `~/.bashrc` is refused).
    A directory passes: no write goes through one (it fails there, EISDIR, as it always did);
    so does a character device of root's or ours (`/dev/null`: only root makes device nodes)."""
    if stat.S_ISLNK(info.st_mode):
        return SYMLINK
    if stat.S_ISDIR(info.st_mode) or (
        stat.S_ISCHR(info.st_mode) and info.st_uid in (0, os.getuid())
    ):
        return None
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a FIFO, a socket: remove it, or name another)"
    if info.st_uid != os.getuid():
        return f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
    if info.st_nlink > 1:
        return f"has {info.st_nlink} hard links: ralph-run writes only a file of its own"
    return None


def check_own_file(path: Path) -> None:
    """NotOurs when `path` exists and is not a file ralph-run may write (`not_ours`); a path
    that does not exist is fine: it will be created, never followed."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    why = not_ours(info)
    if why is not None:
        raise NotOurs(why, path)


def open_own_file(path: Path, flags: int, mode: int = PRIVATE_FILE) -> int:
    """`path` opened without following a link: an existing one only when it is a regular file
    of ours (checked on the open descriptor: no race), else a new one (O_CREAT|O_EXCL, which a
    link planted in between makes fail). NotOurs when it is none of these."""
    flags |= os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO does not block
    for _ in range(3):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # made since: opened as an existing one
                return os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
            continue
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NotOurs(SYMLINK, path) from None
            raise
        why = not_ours(os.fstat(fd))
        if why is None:
            return fd
        os.close(fd)
        raise NotOurs(why, path)
    raise NotOurs("keeps appearing and vanishing while opened", path)


def replace_own_file(path: Path, data: bytes, mode: int = 0o666, *, durable: bool = True) -> None:
    """Replace `path` with `data` atomically, through a temp file of a random name made in its
    directory (O_EXCL|O_NOFOLLOW: no planted name is followed); `mode` before the umask (the
    report and the textfile are read by others: a browser, node_exporter). NotOurs when the
    file there is not one ralph-run may write; OSError when it cannot be written."""
    check_own_file(path)
    target = Path(os.path.abspath(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    temp = target.with_name(f".{target.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
    fd = os.open(temp, flags, mode)
    try:
        try:
            write_all(fd, data, durable)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if durable:
        with contextlib.suppress(OSError):
            fsync_directory(target.parent)


def write_all(fd: int, data: bytes, durable: bool) -> None:
    """All of `data` to `fd` (a write may take less), then fsync'd when `durable`."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    if durable:
        os.fsync(fd)
