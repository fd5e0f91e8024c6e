"""Mooncake's library: imported on first use (in the safe order, `connectors/backends.py`) with an
error that says what to install, and its connectors closed at exit while it is still there."""

from __future__ import annotations

import atexit
import contextlib
import weakref
from types import ModuleType
from typing import Any

from omni_mesh.connectors import backends
from omni_mesh.connectors.errors import ConnectorUnavailable

INSTALL_HINT = (
    "install it with `pip install 'omni-mesh[mooncake]'` (the non-CUDA wheel, CPU/TCP) or "
    "`pip install 'omni-mesh[mooncake-cuda]'` on GPU hosts"
)


def import_mooncake(module: str, owner: str) -> ModuleType:
    """Import `mooncake.engine` / `mooncake.store` on first use (in the safe order: backends.py), with an
    error that says what to install."""
    try:
        return backends.load(module, owner)
    except ImportError as exc:
        detail = str(exc)
        if "libibverbs" in detail:
            raise ConnectorUnavailable(
                f"{owner}: the mooncake library cannot load ({detail}); install the RDMA userspace library "
                "with `apt-get install -y libibverbs1` (no RDMA hardware is needed)"
            ) from exc
        raise ConnectorUnavailable(
            f"{owner}: the mooncake library is not available ({detail}); {INSTALL_HINT}"
        ) from exc


def close_at_exit(connector: Any) -> None:
    """Close `connector` at interpreter exit, in order, unless it is gone by then (held weakly)."""
    atexit.register(_close_if_alive, weakref.ref(connector))


def _close_if_alive(ref: weakref.ref) -> None:
    connector = ref()
    if connector is not None:
        with contextlib.suppress(Exception):  # at exit there is nobody left to tell
            connector.close()
