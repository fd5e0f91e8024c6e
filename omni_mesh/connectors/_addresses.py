"""How a connector names this host to its peers: the `host: auto` rule, bind vs advertise, endpoints.

`host: auto` resolves, in order, to:
  0. $OMNI_MESH_CONNECTOR_HOST where it is set: `omni-mesh up` sets it (127.0.0.1 unless
     `--connector-host` says otherwise), as its peers all run on this machine; a deployment may set
     it to name one address for every connector of a process;
  1. the source address the kernel picks for a route to the outside world (a UDP `connect`, which
     sends nothing), so a multi-homed host advertises the interface its default route uses;
  2. else (no default route, e.g. an isolated network namespace) the first IPv4 address of an
     interface that is up and not loopback;
  3. else 127.0.0.1.
Set `host` to an explicit address to override the rule (for example the address of a fast NIC, or
the address peers reach a container by).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct

from omni_mesh.defaults import CONNECTOR_HOST_ENV
from omni_mesh.ports import WILDCARDS as WILDCARDS  # re-exported: the connectors' name for it

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


def outward_address() -> str:
    """This host's address as its peers see it (the `host: auto` rule in the module docstring)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: any routed address works, nothing is sent
        address = probe.getsockname()[0]
        if not address.startswith("127.") and address != "0.0.0.0":
            return address
    for _, name in socket.if_nameindex():
        address = _interface_address(name)
        if address is not None:
            return address
    return "127.0.0.1"


def _interface_address(name: str) -> str | None:
    """IPv4 address of an up, non-loopback interface (Linux ioctls; no extra dependency)."""
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            flags = struct.unpack_from("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request), 16)[0]
            if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                return None
            return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
        except OSError:  # no IPv4 address on it
            return None


def _chosen(value: str) -> str:
    """`value`, or for "auto" the address $OMNI_MESH_CONNECTOR_HOST names (still "auto" without it)."""
    value = value.strip()
    if value.lower() == "auto":
        return os.environ.get(CONNECTOR_HOST_ENV, "").strip() or "auto"
    return value


def resolve_host(value: str) -> str:
    """The one address to bind and advertise: `value` itself unless it is "auto" (module docstring)."""
    return bind_and_advertise(value)[1]


def bind_and_advertise(value: str) -> tuple[str, str]:
    """(address to bind, address to advertise) for a `host` value; a wildcard binds every interface
    and advertises the address `auto` finds without $OMNI_MESH_CONNECTOR_HOST."""
    value = _chosen(value)
    if value in WILDCARDS:
        return value, outward_address()
    address = outward_address() if value.lower() == "auto" else value
    return address, address


def tcp_endpoint(host: str, port: int | str) -> str:
    """A ZeroMQ tcp:// endpoint; IPv6 addresses are bracketed."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
