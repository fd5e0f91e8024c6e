"""The TCP sockets a process listens on, read from /proc (psutil is not a dependency).

A socket is the process's when one of its file descriptors is that socket's inode; /proc/PID/net/tcp
and tcp6 list every socket of the process's network namespace with its inode and state.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column

#: Addresses that reach no further than this machine.
LOOPBACK = ("127.0.0.1", "::1")
#: Addresses that bind every interface.
EVERY_INTERFACE = ("0.0.0.0", "::")


@dataclass(frozen=True, order=True)
class Listener:
    address: str
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _address(hex_address: str, family: socket.AddressFamily) -> str:
    raw = bytes.fromhex(hex_address)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def listening(pid: int) -> set[Listener]:
    """The TCP sockets process `pid` listens on (empty once it is gone)."""
    try:
        inodes = _socket_inodes(pid)
        tables = [
            (Path(f"/proc/{pid}/net/{name}").read_text(), family)
            for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6))
        ]
    except FileNotFoundError:
        return set()
    found = set()
    for table, family in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[9]) in inodes:
                address, port = fields[1].split(":")
                found.add(Listener(_address(address, family), int(port, 16)))
    return found
