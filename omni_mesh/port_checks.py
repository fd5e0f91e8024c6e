"""The ports `up` and `serve` are asked for, checked before anything starts: each a TCP port
(1-65535), REST and control distinct, and each free to bind now. One line each, naming the flag."""

from __future__ import annotations

import os
import socket

from omni_mesh.ports import WILDCARDS


def other_port() -> str:
    """How to pick another REST port: `PORT=N` under make (which sets MAKELEVEL: `make run` passes
    $(PORT) on), else `--port N`."""
    return "run make with PORT=N" if os.environ.get("MAKELEVEL") else "pass --port N"


def check_ports(host: str, port: int, control_port: int | None) -> None:
    """ValueError saying which flag's port cannot be used, and why; None when all can."""
    ports = {"--port": (host, port)}
    if control_port is not None:
        ports["--control-port"] = ("127.0.0.1", control_port)  # the control plane binds loopback
    for flag, (_, number) in ports.items():
        if not 0 < number < 65536:
            raise ValueError(f"{flag} {number}: not a TCP port (1-65535)")
    if control_port is not None and control_port == port and _overlap(host, "127.0.0.1"):
        raise ValueError(f"--port and --control-port are both {port}: REST and the control plane need a port each")
    remedies = {"--port": other_port(), "--control-port": "pass --control-port N (or leave it out)"}
    for flag, (address, number) in ports.items():
        if not _bindable(address, number):
            named = "port" if flag == "--port" and os.environ.get("MAKELEVEL") else flag  # make's users set PORT
            raise ValueError(
                f"{named} {number}: already in use on {address} ({address}:{number}: another mesh or service may be "
                f"running there); stop it, or {remedies[flag]}"
            )


def _overlap(host: str, other: str) -> bool:
    return host == other or host in WILDCARDS or host in ("localhost", "::1")


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            probe.bind(("" if host in WILDCARDS else host, port))
        except socket.gaierror as exc:
            raise ValueError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
        except OSError:
            return False
    return True
