"""process/listener.py reads who listens on a port from the kernel's tables: a socket we bind is
ours (our uid, its inode), another user's (made with `useradd` for the test) is theirs; a
machine without the tables says it cannot tell, and never raises."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.foreign import NEEDS_ROOT, Impostor, another_user
from support.standin import free_port

from ralph_runner.process import listener

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="no /proc/net/tcp: not Linux"
)


@pytest.fixture
def bound() -> Iterator[socket.socket]:
    with socket.socket() as ours:
        ours.bind(("127.0.0.1", 0))
        ours.listen()
        yield ours


def test_a_socket_we_listen_on_is_ours_with_its_inode(bound):
    port = bound.getsockname()[1]

    found = listener.listeners()

    assert found.unknown is None
    (ours,) = found.on_loopback(port)
    assert ours.uid == os.geteuid()
    assert ours.inode == os.fstat(bound.fileno()).st_ino
    assert ours.address == ipaddress.ip_address("127.0.0.1") and ours.loopback


def test_a_socket_on_every_address_and_on_ipv6_loopback_counts(bound):
    if not socket.has_ipv6 or not Path("/proc/net/tcp6").exists():
        pytest.skip("no IPv6 here")
    with socket.socket() as anywhere, socket.socket(socket.AF_INET6) as six:
        anywhere.bind(("0.0.0.0", 0))
        anywhere.listen()
        try:
            six.bind(("::1", 0))
        except OSError as error:
            pytest.skip(f"no IPv6 loopback: {error}")
        six.listen()
        found = listener.listeners()
        for sock in (anywhere, six):
            (entry,) = found.on_loopback(sock.getsockname()[1])
            assert entry.inode == os.fstat(sock.fileno()).st_ino and entry.uid == os.geteuid()


def test_a_connected_socket_is_no_listener(bound):
    port = bound.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)) as client:
        inode = os.fstat(client.fileno()).st_ino
        assert inode not in {s.inode for s in listener.listeners().found}


@NEEDS_ROOT
def test_another_users_listener_is_theirs():
    port = free_port()
    with another_user() as user:
        impostor = Impostor(port, user)
        try:
            impostor.listening()
            (theirs,) = listener.listeners().on_loopback(port)
        finally:
            impostor.stop()
    assert theirs.uid == user.pw_uid != os.geteuid()


def test_no_tables_is_unknown_not_an_error(tmp_path):
    found = listener.listeners(tmp_path)

    assert found.found == () and found.unknown is not None and "not Linux" in found.unknown


def test_a_table_past_its_bound_is_whole_once_the_listeners_were_read(tmp_path, monkeypatch):
    """The kernel prints its listening sockets first: a cut after them loses none; a cut
    among them is unknown, never a partial answer taken as whole."""
    net = tmp_path / "net"
    net.mkdir()
    here = struct.unpack("=I", bytes([127, 0, 0, 1]))[0]
    header = "  sl  local_address rem_address   st tx rx tr tm retr uid timeout inode\n"
    listening = f"   0: {here:08X}:1F40 00000000:0000 0A 0:0 00:0 0 1002 0 4242\n"
    connected = f"   1: {here:08X}:8000 {here:08X}:1F40 01 0:0 00:0 0 0 0 99\n"
    (net / "tcp").write_text(header + listening + connected * 50)
    monkeypatch.setattr(listener, "MAX_BYTES", len(listening) + 10 * len(connected))

    (found,) = listener.listeners(tmp_path).on_loopback(8000)
    assert (found.uid, found.inode) == (1002, 4242)

    (net / "tcp").write_text(header + listening * 50)
    cut = listener.listeners(tmp_path)
    assert cut.unknown is not None and "over" in cut.unknown
