"""Who listens on a TCP port of this machine: each listening socket's owner, from the kernel.

A loopback port is anyone's to take: after a crash, another local user may bind the server's port
first, answer as a healthy server, and receive every prompt (issue 37, High 1). The kernel lists
every socket with its uid and inode in /proc/net/tcp and tcp6, which any user may read; psutil's
`net_connections` gives no uid (and no pid for another user's socket), and `ss -ltnpe` is
iproute2's, missing in minimal images. Where there is no /proc/net/tcp (not Linux) or it cannot
be read, the answer says so (`unknown`) rather than guess.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN, as the tables print a socket's state
TABLES = ("tcp", "tcp6")  # under /proc/net; tcp6 is absent where IPv6 is off
MAX_BYTES = 64 * 1024 * 1024  # of each table: a busy box's half a million sockets
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Listener:
    """One listening socket: where it listens, whose it is, and its inode (the number that
    `/proc/PID/fd/N -> socket:[INODE]` names, to tell which process holds it)."""

    address: Address
    port: int
    uid: int
    inode: int

    @property
    def loopback(self) -> bool:
        """It takes connections to 127.0.0.1 or ::1: it listens there, or on every address."""
        address = self.address
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback or address.is_unspecified


@dataclass(frozen=True)
class Listeners:
    """Every listening TCP socket of this machine's network namespace; `unknown` says why
    they could not be read (then `found` may lack some)."""

    found: tuple[Listener, ...]
    unknown: str | None = None

    def on_loopback(self, port: int) -> tuple[Listener, ...]:
        """The sockets that a client of 127.0.0.1:PORT or [::1]:PORT may reach."""
        return tuple(s for s in self.found if s.port == port and s.loopback)


def listeners(proc: Path = Path("/proc")) -> Listeners:
    """The listening sockets in /proc/net/tcp and tcp6; never raises."""
    found: list[Listener] = []
    for table in TABLES:
        path = proc / "net" / table
        try:
            found += _read(path)
        except FileNotFoundError:
            if table == "tcp":
                return Listeners(tuple(found), f"no {path} (not Linux?)")
        except (OSError, ValueError) as error:
            return Listeners(tuple(found), f"{path} unreadable: {error}")
    return Listeners(tuple(found))


def _read(path: Path) -> list[Listener]:
    """One table's listening sockets. The kernel prints its listening sockets before all the
    others, so a table cut at MAX_BYTES is still whole for them once another state was seen."""
    found: list[Listener] = []
    read, past_listeners = 0, False
    with path.open("rb") as table:
        table.readline()  # the header
        for line in table:
            read += len(line)
            if read > MAX_BYTES:
                if past_listeners:
                    break
                raise ValueError(f"over {MAX_BYTES} bytes of listening sockets")
            fields = line.split()
            if len(fields) < 10:
                continue
            if fields[3].decode() != LISTEN:
                past_listeners = True
                continue
            address, port = fields[1].decode().split(":")
            found.append(Listener(_address(address), int(port, 16), int(fields[7]), int(fields[9])))
    return found


def _address(text: str) -> Address:
    """The tables print an address as 32-bit words in the machine's byte order."""
    words = [int(text[i : i + 8], 16) for i in range(0, len(text), 8)]
    packed = struct.pack(f"={len(words)}I", *words)
    return ipaddress.ip_address(packed)
