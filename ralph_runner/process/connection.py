"""Where a command runs: on this machine, or on an inventory host over OpenSSH.

Chosen from a host's Ansible variables, so an operator's existing inventory works unchanged.
Every connection runs its commands through execute.py; ssh is just a local `ssh` process.

Killing a remote command: killing the local ssh client does not, by itself, stop the remote
command (without a TTY sshd sends it no SIGHUP). So the remote side runs the command under a
small bash wrapper that watches its stdin, which we hold open for as long as the ssh client runs:
when the connection goes away (timeout, cancel, kill_all, ralph-run killed), stdin reaches EOF and
the wrapper kills the command's process group, TERM then KILL after 2 s. A remote descendant that
moved to its own process group or session is not reached.
"""

from __future__ import annotations

import os
import shlex
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ralph_runner.errors import FatalError, Problem
from ralph_runner.process import execute, host_keys
from ralph_runner.process.private_dir import private_directory

CONNECTION_KINDS = ("local", "ssh")
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_CONNECT_TIMEOUT = 10

# Runs "$@" as the leader of a new session (setsid, util-linux: so its process group can be
# killed), with stdin from /dev/null, and kills that group once the wrapper's own stdin (the ssh
# channel, kept on fd 3) reaches EOF. Exits with the command's status. No job control: `set -m`
# would print job notices into the output; without it, bash starts the background command with
# SIGINT ignored, which does not matter because the watchdog sends TERM and KILL.
_REMOTE_WRAPPER = """\
while IFS= read -r -d '' pair && [ -n "$pair" ]; do export "$pair"; done
exec 3<&0 </dev/null
setsid "$@" 3<&- &
command=$!
( while read -r -u 3 _; do :; done
  kill -TERM -- -"$command"; sleep 2; kill -KILL -- -"$command" ) >/dev/null 2>&1 &
watchdog=$!
exec 3<&-
wait "$command"; code=$?
kill "$watchdog" 2>/dev/null
exit "$code"
"""


class Connection(Protocol):
    """Runs a command on one host; never raises for a command that fails."""

    @property
    def name(self) -> str:  # "local" or "ssh user@host:port"
        ...

    def shell(
        self,
        command: str,
        *,
        cwd: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_output: int = execute.DEFAULT_MAX_OUTPUT,
        cancel: threading.Event | None = None,
        on_output: Callable[[str], None] | None = None,
        idle: execute.IdleWatch | None = None,
    ) -> execute.Result: ...

    def argv(
        self,
        argv: list[str],
        *,
        cwd: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_output: int = execute.DEFAULT_MAX_OUTPUT,
        cancel: threading.Event | None = None,
        on_output: Callable[[str], None] | None = None,
        idle: execute.IdleWatch | None = None,
    ) -> execute.Result: ...


@dataclass(frozen=True)
class Local:
    """Commands run here, as children of ralph-run."""

    name: str = "local"

    def shell(self, command: str, **options) -> execute.Result:
        return execute.shell(command, **options)

    def argv(self, argv: list[str], **options) -> execute.Result:
        return execute.run(argv, **options)


SSH_UNREACHABLE = 255  # ssh's own exit code: no connection, or the login was refused
CONTROL_PERSIST = "60s"  # how long an idle master connection stays open


@dataclass(frozen=True)
class Ssh:
    """Commands run on `host` through the OpenSSH client (keys and agent; never a password).

    Exit code 255 is ssh's own: the host could not be reached or refused the login.
    """

    host: str
    user: str | None = None
    port: int | None = None
    key_file: str | None = None
    options: tuple[str, ...] = ()  # ansible_ssh_common_args + ansible_ssh_extra_args
    connect_timeout: int = DEFAULT_CONNECT_TIMEOUT

    @property
    def name(self) -> str:
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"ssh {user}{self.host}{port}"

    def shell(self, command: str, **options) -> execute.Result:
        return self._run(["bash", "-c", command], command, **options)

    def argv(self, argv: list[str], **options) -> execute.Result:
        return self._run(argv, shlex.join(argv), **options)

    def _run(
        self,
        argv: list[str],
        display: str,
        *,
        cwd: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        **options,
    ) -> execute.Result:
        client = self.client_argv(remote_command(argv, cwd=cwd))
        destination = client[1:-1]  # the options and the host, without the remote line
        unknown = host_keys.before(destination)  # a first contact is said (accept-new)
        result = execute.run(
            client,
            hold_stdin=True,  # the remote wrapper's lifeline
            stdin_first=environment_of(env),  # never on a command line: `ps` shows those
            display=f"{self.name}: {display}",
            **options,
        )
        if unknown is not None:
            host_keys.after(destination, unknown)
        return result

    def client_argv(self, remote: str) -> list[str]:
        """The local ssh command line. The operator's own options come first: ssh keeps the
        first value it sees for an option, so they can override ours."""
        argv = ["ssh", *self.options]
        for option in (
            "BatchMode=yes",  # never prompt: a password prompt would hang a collector
            "StrictHostKeyChecking=accept-new",  # a new host's key is taken, and said: host_keys
            f"ConnectTimeout={self.connect_timeout}",
            "LogLevel=ERROR",  # no "Permanently added ..." warnings in a command's output
            *reuse_options(),
        ):
            argv += ["-o", option]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.key_file:
            argv += ["-i", self.key_file]
        if self.user:
            argv += ["-l", self.user]
        return [*argv, "--", self.host, remote]


def reuse_options() -> tuple[str, ...]:
    """OpenSSH connection reuse, as Ansible does it: the first command to a host opens a master
    connection that later ones share for CONTROL_PERSIST, so a death's collectors and recovery
    steps pay no new handshake each. `-o ControlMaster=no` in ansible_ssh_common_args turns it
    off (the operator's options come first and ssh keeps the first value). The sockets live in
    a directory of our own (process/private_dir.py); where that cannot be had (another user made
    the name first), no socket is shared."""
    directory = Path(tempfile.gettempdir()) / f"ralph-run-ssh-{os.getuid()}"
    try:
        private_directory(directory)  # another user's directory would get our commands
    except OSError:
        return ()  # no safe place for the sockets: every command opens its own connection
    return (
        "ControlMaster=auto",
        f"ControlPath={directory}/%C",  # %C: a hash of host, port and user; short enough
        f"ControlPersist={CONTROL_PERSIST}",
    )


def remote_command(argv: list[str], *, cwd: str | os.PathLike | None) -> str:
    """The line the remote login shell runs: cd, then argv under the wrapper, which first
    reads the environment from its stdin (`environment_of`).

    Everything is shell-quoted, so it reaches the remote program as text. `cwd` is a remote
    path, taken as given, except that a leading `~` means the remote user's home.
    """
    words = ["exec", "bash", "-c", shlex.quote(_REMOTE_WRAPPER), "ralph-run"]
    words += [shlex.quote(word) for word in argv]
    line = " ".join(words)
    return f"cd {remote_path(os.fspath(cwd))} && {line}" if cwd is not None else line


def environment_of(env: Mapping[str, str] | None) -> bytes:
    """A task's `env:` as the remote wrapper reads it from its stdin: NUL-ended KEY=VALUE
    pairs, then an empty one. On the ssh command line (`exec env HF_TOKEN=...`) every local
    and remote user could read them with `ps`."""
    pairs = [f"{key}={value}".encode() + b"\0" for key, value in (env or {}).items()]
    return b"".join(pairs) + b"\0"


def remote_path(path: str) -> str:
    """A path as one word of a remote shell line; a leading `~/` stays the remote user's home
    (`~/'x$(touch /tmp/p)'`: the rest quoted). Every remote line ralph-run builds uses it."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def for_host(hostvars: Mapping[str, object]) -> Connection:
    """The connection Ansible would use for a host, from its variables.

    With no `ansible_connection`, a host is local when it names this machine (localhost,
    127.0.0.1, ::1) and reached over ssh otherwise, as in Ansible.
    """
    inventory_name = str(hostvars.get("inventory_hostname", "localhost"))
    host = str(_first(hostvars, "ansible_host", "ansible_ssh_host") or inventory_name)
    kind = hostvars.get("ansible_connection")
    if kind is None:
        kind = "local" if host in LOCAL_NAMES else "ssh"
    if kind == "smart":  # Ansible's old default: OpenSSH
        kind = "ssh"
    if kind not in CONNECTION_KINDS:
        raise _problem(
            inventory_name,
            "ansible_connection",
            f"connection {kind!r} is not supported; use one of: {', '.join(CONNECTION_KINDS)}",
        )
    if kind == "local":
        return Local()
    key_file = _first(hostvars, "ansible_ssh_private_key_file", "ansible_private_key_file")
    options = [
        *_words(hostvars, inventory_name, "ansible_ssh_common_args"),
        *_words(hostvars, inventory_name, "ansible_ssh_extra_args"),
    ]
    user = _first(hostvars, "ansible_user", "ansible_ssh_user")
    return Ssh(
        host=host,
        user=str(user) if user else None,
        port=_number(hostvars, inventory_name, "ansible_port", "ansible_ssh_port"),
        key_file=os.path.expanduser(str(key_file)) if key_file else None,
        options=tuple(options),
        connect_timeout=_number(hostvars, inventory_name, "ansible_timeout")
        or DEFAULT_CONNECT_TIMEOUT,
    )


def _first(hostvars: Mapping[str, object], *names: str) -> object | None:
    """The first of `names` that is set (Ansible's current name first, then its old alias)."""
    for name in names:
        if hostvars.get(name) not in (None, ""):
            return hostvars[name]
    return None


def _words(hostvars: Mapping[str, object], host: str, name: str) -> list[str]:
    try:
        return shlex.split(str(hostvars.get(name) or ""))
    except ValueError as error:  # unbalanced quotes
        raise _problem(host, name, f"cannot split into ssh arguments: {error}") from None


def _number(hostvars: Mapping[str, object], host: str, *names: str) -> int | None:
    value = _first(hostvars, *names)
    if value is None:
        return None
    if isinstance(value, bool) or not str(value).isdigit() or int(str(value)) == 0:
        raise _problem(host, names[0], f"expected a positive whole number, got {value!r}")
    return int(str(value))


def _problem(host: str, variable: str, message: str) -> FatalError:
    return FatalError(Problem(f"host {host}: {variable}: {message}", path=variable))
