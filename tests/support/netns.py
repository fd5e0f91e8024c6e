"""Two hosts on one machine: network namespaces joined by a veth pair (root and iproute2 needed).

    with TwoHosts() as hosts:
        hosts.a.ip, hosts.b.ip            # addresses on the shared link
        hosts.a.popen([...])              # a process "on" host a (ip netns exec)
        hosts.cut(); hosts.restore()      # take the link down and up again
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@dataclass
class Host:
    netns: str
    device: str
    ip: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)


class TwoHosts:
    """Namespaces `om<id>a`/`om<id>b` with 10.<x>.<y>.1 and .2 on a veth pair; removed on exit."""

    def __init__(self) -> None:
        token = uuid.uuid4().hex[:6]
        octet = int(token[:2], 16) % 200 + 20
        subnet = f"10.{octet}.{int(token[2:4], 16)}"
        self.a = Host(f"om{token}a", f"om{token}a", f"{subnet}.1")
        self.b = Host(f"om{token}b", f"om{token}b", f"{subnet}.2")

    def __enter__(self) -> TwoHosts:
        if not netns_available():
            pytest.fail("multi-host tests need root and iproute2 (`apt-get install iproute2`)")
        for host in (self.a, self.b):
            _ip("netns", "add", host.netns)
        _ip("link", "add", self.a.device, "type", "veth", "peer", "name", self.b.device)
        for host in (self.a, self.b):
            _ip("link", "set", host.device, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", host.device)
            _ip("-n", host.netns, "link", "set", host.device, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        return self

    def cut(self) -> None:
        _ip("-n", self.a.netns, "link", "set", self.a.device, "down")

    def restore(self) -> None:
        _ip("-n", self.a.netns, "link", "set", self.a.device, "up")

    def __exit__(self, *exc: object) -> None:
        for host in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
