"""connection.py: choosing a connection from Ansible variables; local and real ssh runs."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from support.sshd import MISSING_REASON, Sshd, running_sshd, sshd_available

from ralph_runner.errors import FatalError
from ralph_runner.process import connection

NASTY = ["$(touch PWNED)", "`touch PWNED`", "it's", 'say "hi"', "a  b", "; touch PWNED", "*", "\\"]


def wait_until(condition, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- choosing the connection -------------------------------------------------------------------


def test_no_variables_means_local():
    conn = connection.for_host({})
    assert isinstance(conn, connection.Local) and conn.name == "local"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
def test_this_machine_is_local_without_a_connection_variable(host):
    assert isinstance(connection.for_host({"inventory_hostname": host}), connection.Local)


def test_explicit_local_wins_over_a_remote_address():
    hostvars = {
        "inventory_hostname": "gpu",
        "ansible_host": "gpu.lan",
        "ansible_connection": "local",
    }
    assert isinstance(connection.for_host(hostvars), connection.Local)


def test_a_remote_host_defaults_to_ssh_as_in_ansible():
    conn = connection.for_host(
        {"inventory_hostname": "spark-b", "ansible_host": "spark-b.lan", "ansible_user": "ops"}
    )
    assert conn == connection.Ssh(host="spark-b.lan", user="ops")
    assert conn.name == "ssh ops@spark-b.lan"


def test_ssh_variables_become_client_arguments():
    conn = connection.for_host(
        {
            "inventory_hostname": "b",
            "ansible_connection": "ssh",
            "ansible_port": "2222",
            "ansible_ssh_private_key_file": "~/.ssh/ops_key",
            "ansible_ssh_common_args": "-o ProxyJump='jump host'",
            "ansible_ssh_extra_args": "-o Compression=yes",
            "ansible_timeout": 4,
        }
    )
    assert conn.name == "ssh b:2222"
    argv = conn.client_argv("REMOTE")
    assert argv[:5] == ["ssh", "-o", "ProxyJump=jump host", "-o", "Compression=yes"]
    assert "ConnectTimeout=4" in argv and "BatchMode=yes" in argv
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == os.path.expanduser("~/.ssh/ops_key")
    assert "-l" not in argv
    assert argv[-3:] == ["--", "b", "REMOTE"]


def test_old_ansible_ssh_aliases_work():
    conn = connection.for_host(
        {"inventory_hostname": "b", "ansible_ssh_host": "10.0.0.2", "ansible_ssh_user": "ops"}
    )
    assert (conn.host, conn.user) == ("10.0.0.2", "ops")


@pytest.mark.parametrize(
    ("hostvars", "message"),
    [
        ({"ansible_connection": "docker"}, "ansible_connection: connection 'docker' is not"),
        ({"ansible_connection": "ssh", "ansible_port": "twenty"}, "ansible_port: expected a"),
        ({"ansible_connection": "ssh", "ansible_ssh_common_args": "-o 'x"}, "cannot split"),
    ],
)
def test_bad_variables_are_operator_errors(hostvars, message):
    with pytest.raises(FatalError) as caught:
        connection.for_host({"inventory_hostname": "web1", **hostvars})
    assert "host web1: " in str(caught.value) and message in str(caught.value)


# -- local ---------------------------------------------------------------------------------------


def test_local_shell_with_cwd_env_and_exit_code(tmp_path):
    result = connection.Local().shell(
        'pwd; echo "$GREETING"; exit 3', cwd=tmp_path, env={"GREETING": "hello"}
    )
    assert (result.exit_code, result.output) == (3, f"{tmp_path}\nhello\n")


def test_local_argv_is_not_a_shell(tmp_path):
    result = connection.Local().argv(["printf", "%s\\n", *NASTY], cwd=tmp_path)
    assert result.output.splitlines() == NASTY
    assert not (tmp_path / "PWNED").exists()


# -- ssh against a real sshd on 127.0.0.1 ------------------------------------------------------


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> Sshd:
    if not sshd_available():
        pytest.skip(MISSING_REASON)
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture
def ssh(sshd) -> connection.Ssh:
    return connection.for_host(sshd.hostvars())


def test_ssh_runs_remotely_with_cwd_env_and_exit_code(ssh, tmp_path):
    workdir = tmp_path / "dir with 'quotes' and spaces"
    workdir.mkdir()
    result = ssh.shell('pwd; echo "$GREETING"; exit 7', cwd=workdir, env={"GREETING": "hi there"})
    assert (result.exit_code, result.output) == (7, f"{workdir}\nhi there\n")
    assert result.command == f'{ssh.name}: pwd; echo "$GREETING"; exit 7'


def test_ssh_keeps_nasty_strings_as_text(ssh, tmp_path):
    argv_result = ssh.argv(["printf", "%s\\n", *NASTY], cwd=tmp_path)
    env_result = ssh.shell(
        'printf "%s\\n" "$A" "$B"', cwd=tmp_path, env={"A": NASTY[0], "B": NASTY[3]}
    )
    assert argv_result.output.splitlines() == NASTY
    assert env_result.output.splitlines() == [NASTY[0], NASTY[3]]
    assert not (tmp_path / "PWNED").exists()


def test_ssh_tilde_cwd_is_the_remote_home(ssh):
    result = ssh.shell("pwd", cwd="~")
    assert result.ok and result.output == f"{Path('~').expanduser()}\n"


def test_ssh_unreachable_host_is_exit_255(sshd):
    dead_port = connection.for_host(sshd.hostvars(ansible_port=1, ansible_timeout=2))
    result = dead_port.shell("true")
    assert result.exit_code == 255 and "Connection refused" in result.output


def test_cancelling_an_ssh_command_kills_the_remote_command(ssh):
    output: list[str] = []
    cancel = threading.Event()

    def on_output(chunk: str) -> None:
        output.append(chunk)
        if "".join(output).count("\n") == 2:
            cancel.set()

    # The remote host is this machine, so psutil can watch the remote processes die.
    result = ssh.shell(
        "sleep 100 & echo $!; echo $$; wait", cancel=cancel, on_output=on_output, timeout=20
    )
    assert result.cancelled and result.exit_code is None
    remote_pids = [int(word) for word in result.output.split()]
    assert len(remote_pids) == 2
    assert wait_until(lambda: all(gone(pid) for pid in remote_pids), within=5)


def test_an_ssh_tasks_env_is_on_no_command_line_another_user_can_read(ssh, tmp_path):
    """Issue 29, finding 5: a task's `env:` for an ssh host went on the ssh command line
    (`exec env HF_TOKEN=...`), which every local user reads with `ps`. Read as another user
    (`nobody`, through `ps` itself) while the command runs: the secret is on no command line,
    local or remote (the remote host is this machine); the remote command still gets it, and a
    value with a newline too."""
    secret = f"hf_{os.urandom(8).hex()}"
    started, seen = tmp_path / "started", tmp_path / "seen"
    tables: list[str] = []

    def look() -> None:
        if wait_until(started.exists, within=15):
            ps = ["ps", "-ww", "-eo", "args"]  # -ww: whole lines, not 80 columns
            table = subprocess.run(ps, user="nobody", capture_output=True, text=True, check=True)
            tables.append(table.stdout)
        seen.touch()

    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    result = ssh.shell(
        f'touch {started}; while [ ! -e {seen} ]; do sleep 0.05; done; printf "%s|" "$T" "$N"',
        env={"T": secret, "N": "two\nlines"},
        timeout=30,
    )
    looker.join(5)

    assert result.ok and result.output == f"{secret}|two\nlines|", result
    assert tables and "while [ ! -e" in tables[0], "ps did not show the running command"
    assert secret not in tables[0]
