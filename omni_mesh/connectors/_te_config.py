"""The Mooncake TE connector's config: the `extra:` keys of a MooncakeTransferEngineConnector, their
defaults and the checks `parse_config` runs on them (omni_mesh.connectors.mooncake_transfer_engine
re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

from omni_mesh.connectors._checks import check_not_negative, check_port, check_positive
from omni_mesh.connectors._mooncake_common import check_protocol
from omni_mesh.connectors.base import ConnectorConfigError

P2P = "P2PHANDSHAKE"  # the metadata_server value with nothing to deploy: peers exchange it point to point


@dataclass(frozen=True)
class MooncakeTransferEngineConfig:
    #: Address to advertise and bind; "auto" picks the interface that routes outside (see _addresses).
    host: str = "auto"
    #: "tcp" or "rdma" (the engine falls back to TCP where no RDMA device is found).
    protocol: str = "tcp"
    #: RDMA device(s), e.g. "mlx5_0" or "mlx5_0,mlx5_1"; "" lets the engine choose.
    device_name: str = ""
    #: "P2PHANDSHAKE" (nothing to deploy) or an "http://host:port/metadata" / etcd metadata server.
    metadata_server: str = P2P
    #: The registered pool of this process, created at start. Send and receive pools alike grow by
    #: registered, pre-faulted regions for payloads that fit no free space, up to max_pool_size.
    memory_pool_size: int = 512 * 1024 * 1024
    #: Ceiling of the pool (the largest payload must fit under it, on both sides); 0: min(half of
    #: RAM, 8 GiB), never less than memory_pool_size.
    max_pool_size: int = 0
    #: Regions the pool grew by are unregistered and dropped once unused this long (seconds).
    pool_idle_release_s: float = 30.0
    #: Fault the pool's pages in at start, so no transfer pays for first-touch page faults.
    prefault: bool = True
    #: Unconsumed payloads are freed this long after their put.
    ttl_s: float = 300.0
    #: TCP port of the ZeroMQ side channel consumers ask for payloads on; 0 picks a free one.
    zmq_port: int = 0
    #: How long get() waits for the producer's side channel to accept a connection.
    connect_timeout_s: float = 5.0
    #: How long get() waits for the producer to write a payload into this process's pool.
    transfer_timeout_s: float = 60.0
    #: How long put()/get() wait for pool space held by unconsumed payloads or live views.
    pool_wait_s: float = 10.0
    #: Copy tensors out of the pool on get (region freed at once) instead of returning views over it.
    copy_on_get: bool = False
    #: Concurrent outgoing transfers of this process.
    transfer_threads: int = 4
    #: Contiguous CPU tensors/arrays at least this large are sent from their own memory instead of
    #: being copied into the pool at put (protocol "tcp" only); they must not be mutated until consumed.
    #: 0 turns this off.
    zero_copy_min_bytes: int = 1024 * 1024
    #: CUDA tensors go GPU to GPU, outside the frame, when the installed Mooncake wheel is the CUDA
    #: build (extra `mooncake-cuda`); false, or the non-CUDA wheel, sends them through host memory.
    device_transfer: bool = True

    def check(self, owner: str) -> None:
        check_protocol(owner, self.protocol)
        check_positive(
            owner,
            memory_pool_size=self.memory_pool_size,
            ttl_s=self.ttl_s,
            connect_timeout_s=self.connect_timeout_s,
            transfer_timeout_s=self.transfer_timeout_s,
            transfer_threads=self.transfer_threads,
        )
        check_not_negative(
            owner,
            zero_copy_min_bytes=self.zero_copy_min_bytes,
            pool_wait_s=self.pool_wait_s,
            max_pool_size=self.max_pool_size,
            pool_idle_release_s=self.pool_idle_release_s,
        )
        check_port(owner, "zmq_port", self.zmq_port)
        if not self.host.strip():
            raise ConnectorConfigError(f"{owner}: host must be an address or 'auto'")
