"""The `extra:` keys of every built-in connector (light on purpose: the package docstring says why):
their config dataclasses, defaults and checks (`parse_config` runs `check`). Each connector module
re-exports its own (`from omni_mesh.connectors.zmq import ZmqConfig`)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from omni_mesh.connectors.config.checks import check_mooncake, split_address
from omni_mesh.connectors.config.fields import STRICT as _STRICT
from omni_mesh.connectors.config.fields import (
    AtLeastOne,
    Int,
    NonNegative,
    NonNegativeInt,
    Port,
    Positive,
    PositiveInt,
    PositiveSize,
    Size,
    vllm_omni,
)
from omni_mesh.connectors.errors import ConnectorConfigError
from omni_mesh.control import MAX_MESSAGE_BYTES

# Typed models (pydantic dataclasses: still dataclasses, so `dataclasses.fields` reads them). Int, Float
# and Size read what vllm-omni's files write ("50051", "256MiB") where parse_config reads a user's
# extra:; vllm_omni(...) names a field's vllm-omni alias.

ENCRYPTIONS = ("auto", "aes-256-gcm", "chacha20-poly1305", "none")  # ZmqConfig.encryption (served.seal)
P2P = "P2PHANDSHAKE"  # the metadata_server value with nothing to deploy: peers exchange it point to point


# ---------------------------------------------------------------------- SharedMemoryConnector


def _inline_bound(value: int) -> int:
    """An inline frame rides a control message, which takes at most MAX_MESSAGE_BYTES: a larger
    setting would only turn every payload in between into a failed request (and each replica keeps
    up to shm.recent.RECENT_MAX such frames)."""
    if value > MAX_MESSAGE_BYTES:
        raise PydanticCustomError(
            "phrase",
            f"must be at most {MAX_MESSAGE_BYTES} (1 MiB): inline payloads ride a control message, which "
            "carries at most that; larger payloads belong in shared memory",
        )
    return value


@dataclass(frozen=True, config=_STRICT)
class SharedMemoryConfig:
    #: The pool maps min(this, 4 MiB) up front and grows by segments as payloads need (up to max_pool_size).
    memory_pool_size: Size = 256 * 1024 * 1024
    #: Frames up to this size travel inside the metadata instead of through shared memory.
    #: At most 1 MiB (control.MAX_MESSAGE_BYTES), the whole control message they ride in.
    inline_max_bytes: Annotated[
        Size, AfterValidator(_inline_bound), vllm_omni("shm_threshold_bytes")
    ] = 16 * 1024
    #: Copy tensors out on get (releasing the slot at once) instead of returning views over it.
    copy_on_get: bool = False
    #: Fault the pool's pages in when it is created, so no put pays for them.
    prefault: bool = True
    #: Pass CUDA tensors by CUDA IPC handle (the consumer maps them on the same device: no copy through
    #: host memory). False copies them to host memory at put, like every other connector.
    cuda_ipc: bool = True
    #: Ceiling of the pool in bytes: it grows by segments sized for payloads that fit no free space, up
    #: to this much in all; past it, payloads take one-off segments (counted as fallbacks).
    #: 0: min(half of /dev/shm, 8 GiB), and never less than memory_pool_size.
    max_pool_size: Size = 0
    #: Segments the pool grew by are returned to the system once unused for this long (seconds).
    pool_idle_release_s: NonNegative = 30.0


# ---------------------------------------------------------------------- ZmqConnector

@dataclass(config=_STRICT)
class ZmqConfig:
    host: str = "auto"  # address to bind and advertise ("auto": rule in omni_mesh.connectors._addresses)
    port: Port = 0  # 0: any free port
    memory_pool_size: Size = 1 << 30  # virtual until used; reused slots stay faulted in
    #: The pool grows by pre-faulted regions for payloads that fit no free space, up to this many bytes
    #: in all; past it a payload takes a one-off buffer (counted). 0: min(half of RAM, 8 GiB), never
    #: less than memory_pool_size.
    max_pool_size: Size = 0
    pool_idle_release_s: NonNegative = 30.0  # regions the pool grew by go back once unused this long
    ttl_s: NonNegative = 300.0  # unconsumed payloads are freed after this; 0 keeps them until cleanup()
    get_timeout_s: Positive = 30.0  # deadline of get() when the caller gives none
    #: With mesh keys, payloads of 256 KiB and up travel sealed with this AEAD on a bulk socket, off
    #: CURVE: auto (AES-256-GCM where the CPU has AES instructions, else ChaCha20-Poly1305),
    #: aes-256-gcm, chacha20-poly1305, or none: peers still authenticated, but the payload bytes
    #: cross the network IN CLEAR (anyone on the path reads them) - only for networks you trust.
    encryption: Literal[ENCRYPTIONS] = "auto"  # type: ignore[valid-type]
    bulk_port: Port = 0  # with mesh keys: the port sealed payloads leave from (0: any free port)


# ---------------------------------------------------------------------- MooncakeTransferEngineConnector

@dataclass(frozen=True, config=_STRICT)
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
    memory_pool_size: PositiveSize = 512 * 1024 * 1024
    #: Ceiling of the pool (the largest payload must fit under it, on both sides); 0: min(half of
    #: RAM, 8 GiB), never less than memory_pool_size.
    max_pool_size: Size = 0
    #: Regions the pool grew by are unregistered and dropped once unused this long (seconds).
    pool_idle_release_s: NonNegative = 30.0
    #: Fault the pool's pages in at start, so no transfer pays for first-touch page faults.
    prefault: bool = True
    #: Unconsumed payloads are freed this long after their put.
    ttl_s: Annotated[Positive, vllm_omni("buffer_ttl_seconds")] = 300.0
    #: TCP port of the ZeroMQ side channel consumers ask for payloads on; 0 picks a free one.
    zmq_port: Port = 0
    #: How long get() waits for the producer's side channel to accept a connection.
    connect_timeout_s: Positive = 5.0
    #: How long get() waits for the producer to write a payload into this process's pool.
    transfer_timeout_s: Positive = 60.0
    #: How long put()/get() wait for pool space held by unconsumed payloads or live views.
    pool_wait_s: NonNegative = 10.0
    #: Copy tensors out of the pool on get (region freed at once) instead of returning views over it.
    copy_on_get: bool = False
    #: Concurrent outgoing transfers of this process.
    transfer_threads: PositiveInt = 4
    #: Contiguous CPU tensors/arrays at least this large are sent from their own memory instead of
    #: being copied into the pool at put (protocol "tcp" only); they must not be mutated until consumed.
    #: 0 turns this off.
    zero_copy_min_bytes: Size = 1024 * 1024
    #: CUDA tensors go GPU to GPU, outside the frame, when the installed Mooncake wheel is the CUDA
    #: build (extra `mooncake-cuda`); false, or the non-CUDA wheel, sends them through host memory.
    device_transfer: bool = True

    def check(self, owner: str) -> None:
        check_mooncake(owner, self.protocol, self.host)


# ---------------------------------------------------------------------- MooncakeStoreConnector

@dataclass(frozen=True, config=_STRICT)
class MooncakeStoreConfig:
    #: Address this client advertises; "auto" picks the interface that routes outside (see _addresses).
    host: str = "auto"
    #: "P2PHANDSHAKE" (nothing to deploy) or an "http://host:port/metadata" / etcd metadata server.
    metadata_server: str = P2P
    #: HOST:PORT of the mooncake_master RPC service.
    master: str = "127.0.0.1:50051"
    #: Bytes this process contributes to the store ("512MiB"); 0 makes it a pure client.
    segment: Size = 512 * 1024 * 1024
    #: Registered local buffer puts are staged in and gets land in ("256MiB"); the largest frame must fit.
    localbuf: PositiveSize = 256 * 1024 * 1024
    #: "tcp" or "rdma".
    protocol: Annotated[str, vllm_omni("proto")] = "tcp"
    #: RDMA device(s), e.g. "mlx5_0"; "" lets the store choose.
    device_name: Annotated[str, vllm_omni("rdma")] = ""
    #: How long to wait for the master to accept a TCP connection before giving up.
    master_connect_timeout_s: Positive = 3.0
    #: How long the stage runtime waits (get_with_deadline) for a key that is not in the store yet.
    get_timeout_s: Positive = 10.0
    #: Keys nobody consumed are removed this long after their put.
    ttl_s: Positive = 300.0
    #: Copies of each payload the store keeps (on distinct segments).
    replica_num: PositiveInt = 1
    #: Prepended to every store key, keeping omni-mesh's keys apart from other users of the master.
    key_prefix: str = "omni-mesh/"
    #: How long put()/get() wait for local buffer space held by live views.
    pool_wait_s: NonNegative = 10.0
    #: Copy tensors out on get (region freed at once) instead of returning views over it.
    copy_on_get: bool = False
    #: Fault the local buffer's pages in at start, so no transfer pays for first-touch page faults.
    prefault: bool = True

    def check(self, owner: str) -> None:
        check_mooncake(owner, self.protocol, self.host)
        split_address(self.master, owner, "master")


# ---------------------------------------------------------------------- YuanrongConnector

WRITE_MODES = ("NONE_L2_CACHE", "WRITE_THROUGH_L2_CACHE", "WRITE_BACK_L2_CACHE", "NONE_L2_CACHE_EVICT")
_PREFIX = re.compile(r"^[A-Za-z0-9_\-]{0,64}$")


@dataclass(config=_STRICT)
class YuanrongConfig:
    host: str = "127.0.0.1"  # the datasystem worker on this host
    port: Int = 31501
    connect_timeout_ms: PositiveInt = 3000  # an unreachable worker is reported after this
    req_timeout_ms: NonNegativeInt = 0  # per-request limit; 0: same as connect_timeout_ms
    get_sub_timeout_ms: PositiveInt = 20  # longest single blocking call while get() waits (it holds the GIL)
    get_timeout_s: Positive = 30.0  # deadline of get() when the caller gives none
    ttl_s: NonNegative = 300.0  # the worker deletes unconsumed payloads after this; 0 keeps them until cleanup()
    write_mode: str = "NONE_L2_CACHE"  # or WRITE_THROUGH_L2_CACHE / WRITE_BACK_L2_CACHE / NONE_L2_CACHE_EVICT
    key_prefix: str = "omni"  # namespace for pipelines sharing one worker cluster
    token: str = ""
    access_key: str = ""
    secret_key: str = ""
    tenant_id: str = ""

    def check(self, owner: str) -> None:
        if not 0 < self.port < 65536:
            raise ConnectorConfigError(f"{owner}: port must be the worker's port (1-65535), got {self.port}")
        if self.write_mode not in WRITE_MODES:
            raise ConnectorConfigError(
                f"{owner}: write_mode must be one of {', '.join(WRITE_MODES)}, got {self.write_mode!r}"
            )
        if not _PREFIX.match(self.key_prefix):
            raise ConnectorConfigError(
                f"{owner}: key_prefix may hold letters, digits, '-' and '_' (up to 64), got {self.key_prefix!r}"
            )


# ---------------------------------------------------------------------- YuanrongTransferEngineConnector

@dataclass(config=_STRICT)
class YuanrongTransferEngineConfig:
    host: str = "auto"  # address to bind and advertise (rule in omni_mesh.connectors._addresses)
    zmq_port: Port = 0  # side channel; 0 picks a free port
    rpc_port: Port = 0  # the transfer engine's RPC port; 0 picks a free port
    protocol: str = "ascend"
    device_name: str = "auto"  # "npu:N"; auto: npu:$LOCAL_RANK (0 without it)
    memory_pool_size: PositiveSize = 1 << 30
    memory_pool_device: str = "auto"  # "npu:N"; auto: the device_name's NPU
    ttl_s: Annotated[NonNegative, vllm_omni("buffer_ttl_seconds")] = 300.0  # unconsumed payloads are freed after this; 0 keeps them until cleanup()
    get_timeout_s: Positive = 30.0  # deadline of get() when the caller gives none

    def check(self, owner: str) -> None:
        for name in ("device_name", "memory_pool_device"):
            value = getattr(self, name)
            if value != "auto" and not (value == "npu" or value.startswith("npu:")):
                raise ConnectorConfigError(f"{owner}: {name} must be 'auto' or 'npu:N', got {value!r}")
        if not self.protocol:
            raise ConnectorConfigError(f"{owner}: protocol must not be empty")


# ---------------------------------------------------------------------- MoriTransferEngineConnector

BACKENDS = ("rdma", "xgmi")
POLL_MODES = ("polling", "event")


@dataclass(config=_STRICT)
class MoriConfig:
    host: str = "auto"  # address to bind and advertise (rule in omni_mesh.connectors._addresses)
    port: Port = 0  # the IOEngine's own port (IOEngineConfig.port); 0 lets MORI pick
    zmq_port: Port = 0  # side channel; 0 picks a free port
    backend_type: str = "rdma"  # rdma (NICs) | xgmi (GPU to GPU, needs a GPU pool)
    # RDMA NIC(s), e.g. "mlx5_0" or "mlx5_0,mlx5_1" (exported as MORI_RDMA_DEVICES); "": MORI's choice
    device_name: str = ""
    memory_pool_size: PositiveSize = 1 << 30
    memory_pool_device: str = "cpu"  # cpu | cuda | cuda:N (ROCm GPUs are "cuda" in torch)
    qp_per_transfer: AtLeastOne = 1
    post_batch_size: Int = -1  # work requests per post; -1: MORI's
    num_worker_threads: AtLeastOne = 1
    poll_cq_mode: str = "polling"  # polling | event
    xgmi_num_streams: AtLeastOne = 64
    xgmi_num_events: AtLeastOne = 64
    ttl_s: Annotated[NonNegative, vllm_omni("buffer_ttl_seconds")] = 300.0  # unconsumed payloads are freed after this; 0 keeps them until cleanup()
    get_timeout_s: Positive = 30.0  # deadline of get() when the caller gives none

    def check(self, owner: str) -> None:
        if self.backend_type not in BACKENDS:
            raise ConnectorConfigError(
                f"{owner}: backend_type must be one of {', '.join(BACKENDS)}, got {self.backend_type!r}"
            )
        if self.poll_cq_mode not in POLL_MODES:
            raise ConnectorConfigError(
                f"{owner}: poll_cq_mode must be one of {', '.join(POLL_MODES)}, got {self.poll_cq_mode!r}"
            )
        device = self.memory_pool_device
        if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
            raise ConnectorConfigError(f"{owner}: memory_pool_device must be cpu, cuda or cuda:N, got {device!r}")
        if self.backend_type == "xgmi" and device == "cpu":
            raise ConnectorConfigError(
                f"{owner}: backend_type xgmi links GPUs; set memory_pool_device to cuda or cuda:N"
            )
        if self.post_batch_size == 0 or self.post_batch_size < -1:
            raise ConnectorConfigError(f"{owner}: post_batch_size must be -1 (MORI's default) or positive")


# ---------------------------------------------------------------------- InProcessConnector

@dataclass(frozen=True, config=_STRICT)
class InProcessConfig:
    namespace: str = "default"  # connectors of one namespace in a process share their payloads
    memory_limit: PositiveInt = 1 << 30  # bytes one namespace holds at most; a put beyond it fails

    def check(self, owner: str) -> None:
        if not self.namespace:
            raise ConnectorConfigError(f"{owner}: namespace must not be empty")
