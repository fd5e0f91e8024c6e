"""SharedMemoryConnector: payloads between processes on one host, through a pre-faulted pool.

Producer side (`shm.producer`): each frame is laid straight into a slot of this process's pool of
pre-faulted segments (`shm.pool`), tiny payloads ride in their metadata (`shm.tiny`), `empty()`
outputs are sent where they lie (`shm.outputs`). Consumer side (`shm.reader`): a get maps the
producer's segment once and decodes views over the slot, no copy; the slot is released in its header
(`shm.slots`, the protocol) when the last view dies, or found by key alone (`shm.lookup`). Stale or
foreign metadata makes `get` return None, never another request's data. Segments live in
OMNI_MESH_SHM_DIR (`omni-mesh up` gives each mesh a directory of its own, `shm.meshdir`), else /dev/shm.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from omni_mesh.connectors.base import OmniConnectorBase
from omni_mesh.connectors.config import SharedMemoryConfig
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError
from omni_mesh.connectors.keys import payload_name as where
from omni_mesh.connectors.pools.growth import AUTO_CEILING_MAX, GROW_STEP
from omni_mesh.connectors.shm.lifecycle import SharedMemoryLifecycle
from omni_mesh.connectors.shm.producer import ShmProducer
from omni_mesh.connectors.shm.reader import ShmReader
from omni_mesh.connectors.shm.segments import ProcessIdentity
from omni_mesh.connectors.shm.slots import names_a_payload

if TYPE_CHECKING:
    import torch

__all__ = ["AUTO_CEILING_MAX", "GROW_STEP", "SharedMemoryConfig", "SharedMemoryConnector"]

# health() counters (the pool counts fallbacks, growth and errors; shm_outputs zero_copy_leaves).
_COUNTERS = ("puts", "gets", "bytes_put", "bytes_got", "inline_puts", "fallbacks", "stale_gets", "errors")
_COUNTERS += ("cuda_ipc_tensors", "unindexed_puts", "pool_grown", "pool_released", "zero_copy_leaves")


class SharedMemoryConnector(OmniConnectorBase):
    config_class = SharedMemoryConfig
    scope = "host"
    lifecycle = SharedMemoryLifecycle

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._counters = Counters(*_COUNTERS)
        identity = ProcessIdentity.current()
        self._producer = ShmProducer(self.config, identity, self._counters)
        self._pool = self._producer.pool
        self._put_with_exports = self._producer.put_with_exports  # a put of exported CUDA tensors
        self._reader = ShmReader(
            self.config,
            identity,
            self._counters,
            self._producer.maps,
            self._producer.own_exports,
            lambda: first.name if (first := self._pool.first) is not None else None,
        )

    # ------------------------------------------------------------------ producer side

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict]:
        return self._producer.put(from_stage, to_stage, put_key, data)

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in a pool slot of its own: returned in a put's payload, it is sent
        where it lies (shm_outputs). Do not write into it after the put."""
        return self._producer.outputs.empty(tuple(int(n) for n in shape), dtype)

    def warm_up(self) -> None:
        with self._pool.lock:
            self._pool.first_locked()

    def reap_consumed(self) -> None:
        """Free the slots consumers have released (and those taken by consumers that died) now, rather
        than at the next put that needs room."""
        with self._pool.lock:
            if not self._pool.closed and self._pool.slots:
                self._pool.reclaim_locked(check_takers=True)

    def cleanup(self, key: str) -> None:
        """Free what this process put under `key` (or `key/...`) that no consumer holds."""
        self._producer.cleanup(key)

    # ------------------------------------------------------------------ consumer side

    def _poll(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None
    ) -> tuple[Any, int] | None:
        if self._pool.closed:
            raise ConnectorClosed(
                f"SharedMemoryConnector is closed (get of {where(from_stage, to_stage, get_key)})"
            )
        return self._reader.get(from_stage, to_stage, get_key, metadata)

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        result = self.get(from_stage, to_stage, get_key, metadata)
        if result is None and names_a_payload(metadata):
            # What put() returned names its slots: once they are gone, waiting cannot bring them back.
            raise ConnectorError(
                f"SharedMemoryConnector: {where(from_stage, to_stage, get_key)} is gone: stale, already "
                "consumed, cleaned up, or its producer died"
            )
        return result

    # ------------------------------------------------------------------ lifecycle

    def health(self) -> dict:
        pool, producer = self._pool, self._producer
        with pool.lock:
            if not pool.closed:
                producer.outputs.drain_locked()
                pool.release_idle_locked()
                producer.maps.forget_unlinked_locked()  # a consumer lets go of segments their producer gave back
            pool_size, in_use, segments, live, near_ceiling = pool.usage_locked()
            tiny_copies = producer.tiny.waiting_locked()
            live += tiny_copies
        status = "unhealthy" if pool.closed else "degraded" if near_ceiling else "healthy"
        return {
            "status": status,
            **self._counters.snapshot(),  # after the release above, which it counts
            **self._put_health(),
            "pool_size": pool_size,
            "pool_in_use": in_use,
            "pool_segments": segments,
            "max_pool_size": pool.ceiling,
            "live_payloads": live,
            # Of those, tiny payloads copied into the pool for a get by key (a get by key in any
            # process sharing the directory asks for them; untaken copies go after 30 s).
            "tiny_copies": tiny_copies,
        }

    def close(self) -> None:
        if not self._pool.close():
            return  # a put is stuck mid-copy: leave the mappings to process exit rather than crash
        with self._pool.lock:
            self._producer.tiny.close_locked()
            self._producer.maps.clear_locked()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
