"""The Mooncake TE connector's engine and its registered pool: starting the engine under a segment
name its peers can reach, and the pool every frame is laid into or received in, registered with it.

With P2PHANDSHAKE the segment is `host:rpc_port` (the engine's own handshake port). With a metadata
server the segment name is taken verbatim and must be unique: it is `host:zmq_port`, the side
channel's port, unique on this host for the connector's lifetime (so the side channel starts first).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from omni_mesh.connectors.config import P2P, MooncakeTransferEngineConfig
from omni_mesh.connectors.errors import ConnectorUnavailable
from omni_mesh.connectors.mooncake.errors import engine_error
from omni_mesh.connectors.pools import growth
from omni_mesh.connectors.pools.registered import PoolErrors, RegisteredPool


def start_engine(
    engine_module: ModuleType, owner: str, host: str, zmq_port: int, cfg: MooncakeTransferEngineConfig
) -> tuple[Any, str]:
    """A started TransferEngine and its segment name; ConnectorUnavailable saying what to check otherwise."""
    engine = engine_module.TransferEngine()
    if cfg.metadata_server == P2P:
        local_name = host
    else:
        # The engine advertises MC_TCP_BIND_ADDRESS, else its first non-loopback address: make it ours.
        local_name = f"{host}:{zmq_port}"
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    rc = engine.initialize(local_name, cfg.metadata_server, cfg.protocol, cfg.device_name)
    if rc != 0:
        raise ConnectorUnavailable(
            f"{owner}: the transfer engine did not start on {host} (rc={rc}, metadata_server="
            f"{cfg.metadata_server!r}, protocol={cfg.protocol!r}, device_name={cfg.device_name!r}); "
            "check that the metadata server is reachable and the device exists"
        )
    segment = f"{host}:{engine.get_rpc_port()}" if cfg.metadata_server == P2P else local_name
    return engine, segment


def registered_pool(
    engine_of: Callable[[], Any], owner: str, cfg: MooncakeTransferEngineConfig, pool_errors: PoolErrors
) -> RegisteredPool:
    """The pool, its first part registered with the engine; the regions it grows by register and
    unregister through `engine_of()` (the connector's engine, None once it is closing)."""
    pool = RegisteredPool(
        cfg.memory_pool_size,
        prefault=cfg.prefault,
        errors=pool_errors,
        ceiling=growth.ceiling(cfg.memory_pool_size, cfg.max_pool_size, growth.ram()),
        register=lambda address, size: engine_of().register_memory(address, size) == 0,
        unregister=lambda address: engine_of().unregister_memory(address),
        idle_s=cfg.pool_idle_release_s,
    )
    rc = engine_of().register_memory(pool.address, pool.size)
    if rc != 0:
        pool.close()
        raise engine_error(
            rc,
            f"{owner}: registering the {pool.size}-byte pool with the engine failed; lower memory_pool_size "
            "or check the RDMA device's memory-lock limit (ulimit -l)",
        )
    return pool
