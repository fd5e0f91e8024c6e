"""Value checks for a connector's parsed config; each error names the connector and the key."""

from __future__ import annotations

from omni_mesh.connectors.base import ConnectorConfigError


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
