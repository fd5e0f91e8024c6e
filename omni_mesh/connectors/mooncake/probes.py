"""Fast probes of a Mooncake master or metadata server: fail in seconds, naming the address, where
the backend would retry for minutes."""

from __future__ import annotations

import socket
import threading
import time
import urllib.parse

from omni_mesh.connectors.config.checks import split_address
from omni_mesh.connectors.errors import ConnectorUnavailable
from omni_mesh.connectors.mooncake.errors import MASTER_UNREACHABLE


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


class MasterWatch:
    """Once the master has failed to answer (RPC_FAIL, RPC_TIMEOUT), each later call first knocks on its
    port: the store client spends about 4.4 s in its own retries on every call to a gone master, and a
    refused connect takes microseconds. The first knock that is answered lets calls through again."""

    def __init__(self, address: str, owner: str, timeout_s: float) -> None:
        self.address, self._owner, self._timeout_s = address, owner, timeout_s
        self._lock = threading.Lock()
        self._failed: tuple[float, str] | None = None  # when the master last failed to answer, and how

    def failed(self, rc: int) -> None:
        """A call answered `rc`: the knocks start when it says the master did not answer."""
        if rc in MASTER_UNREACHABLE:
            with self._lock:
                self._failed = (time.monotonic(), MASTER_UNREACHABLE[rc])

    def check(self, what: str) -> None:
        """Raise ConnectorUnavailable naming `what` while the failed master's port stays closed."""
        failed = self._failed
        if failed is None:
            return
        try:
            probe_tcp(self.address, self._timeout_s, self._owner, "Mooncake master", "is it running?")
        except ConnectorUnavailable as exc:
            raise ConnectorUnavailable(
                f"{what}: {exc} ({failed[1]} {time.monotonic() - failed[0]:.1f}s ago)"
            ) from None
        with self._lock:
            if self._failed is failed:  # no newer failure came meanwhile
                self._failed = None
