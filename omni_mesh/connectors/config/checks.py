"""Value checks for a connector's parsed config that its fields' types do not say; each error names the
connector and the key."""

from __future__ import annotations

from omni_mesh.connectors.config.parse import ConnectorConfigError

PROTOCOLS = ("tcp", "rdma")  # Mooncake's transports


def check_mooncake(owner: str, protocol: str, host: str) -> None:
    """What both Mooncake configs check: the transport, and an address (or "auto") to advertise."""
    if protocol not in PROTOCOLS:
        raise ConnectorConfigError(
            f"{owner}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}"
        )
    if not host.strip():
        raise ConnectorConfigError(f"{owner}: host must be an address or 'auto'")


def split_address(address: str, owner: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectorConfigError(f"{owner}: {what} must look like HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)
