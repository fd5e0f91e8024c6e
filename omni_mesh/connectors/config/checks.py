"""Value checks for a connector's parsed config; each error names the connector and the key."""

from __future__ import annotations

from typing import Any

from omni_mesh.connectors.config.parse import ConnectorConfigError

PROTOCOLS = ("tcp", "rdma")  # Mooncake's transports


def check_port(owner: str, name: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise ConnectorConfigError(f"{owner}: {name} must be 0 (any free port) or 1-65535, got {port}")


def check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConnectorConfigError(f"{owner}: {name} must be positive, got {value!r}")


def check_not_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ConnectorConfigError(f"{owner}: {name} must not be negative, got {value!r}")


def check_served(owner: str, port_name: str, port: int, *, get_timeout_s: float, ttl_s: float) -> None:
    """What every producer-served connector (ServedConnector's subclasses) checks."""
    check_port(owner, port_name, port)
    check_positive(owner, get_timeout_s=get_timeout_s)
    check_not_negative(owner, ttl_s=ttl_s)


def check_engine_pull(owner: str, cfg: Any) -> None:
    """check_served for the transfer-engine connectors (EnginePullConnector), plus their pool size."""
    check_served(owner, "zmq_port", cfg.zmq_port, get_timeout_s=cfg.get_timeout_s, ttl_s=cfg.ttl_s)
    check_positive(owner, memory_pool_size=cfg.memory_pool_size)


def check_protocol(owner: str, protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ConnectorConfigError(
            f"{owner}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}"
        )


def split_address(address: str, owner: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectorConfigError(f"{owner}: {what} must look like HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)
