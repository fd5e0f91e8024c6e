"""Fast probes of a Mooncake master or metadata server: fail in seconds, naming the address, where
the backend would retry for minutes."""

from __future__ import annotations

import socket
import time
import urllib.parse

from omni_mesh.connectors.config.checks import split_address
from omni_mesh.connectors.errors import ConnectorUnavailable


def probe_tcp(address: str, timeout_s: float, owner: str, what: str, fix: str) -> None:
    """Fail in `timeout_s` with the address in the message instead of letting a backend retry for minutes."""
    host, port = split_address(address, owner, what)
    started = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        waited = time.monotonic() - started
        raise ConnectorUnavailable(
            f"{owner}: cannot reach the {what} at {address} (after {waited:.1f}s: {exc or 'timed out'}); {fix}"
        ) from None


def probe_metadata_server(metadata_server: str, timeout_s: float, owner: str) -> None:
    """An http:// metadata server that does not answer would stall the engine; fail fast instead."""
    url = urllib.parse.urlsplit(metadata_server)
    if url.scheme not in ("http", "https") or not url.hostname:
        return  # P2PHANDSHAKE needs no server; etcd endpoint lists are the engine's to dial
    port = url.port or (443 if url.scheme == "https" else 80)
    probe_tcp(
        f"{url.hostname}:{port}",
        timeout_s,
        owner,
        "metadata server",
        f"start it or fix metadata_server ({metadata_server!r}), or use P2PHANDSHAKE",
    )
