"""MooncakeTransferEngineConnector: point-to-point payloads over Mooncake's Transfer Engine (TCP or RDMA).

Each instance (a stage process holds one per connector it names) registers ONE pre-allocated pool
with its engine and owns a small ZeroMQ side channel bound to `host`.

    put   plan the frame with the codec and lay it straight into a pool region (no staging copy);
          the metadata names where it lives: engine segment, side-channel endpoint, handle, length.
    get   reserve a region of the same length in the consumer's own pool and ask the producer, over
          the side channel, to WRITE the frame there (one `transfer_sync_write`, the engine's
          well-trodden direction on every transport). The producer frees its region as soon as the
          write has landed; the consumer decodes the frame as views over its region, which goes back
          to the pool when the last view is garbage-collected (or copies it out: `copy_on_get`).

Large leaves (protocol "tcp"): contiguous CPU tensors and numpy arrays of at least
`zero_copy_min_bytes` are not copied at put. The producer keeps a reference to each, registers its
memory with the engine, lays only the frame's head and small leaves into its pool, and at the
consumer's request writes those pieces and each large leaf straight from its own memory to their
frame offsets in the consumer's region (one `batch_transfer_sync_write`; see `_frame_pieces`). The
consumer sees the same frame, byte for byte. The registration is dropped when the payload is freed
(consumed, expired, cleaned up or closed). So a handler MUST NOT mutate a tensor or array after returning it (putting it)
until the payload is consumed or freed: the consumer would receive the mutated bytes. Register and
unregister cost a few microseconds each over TCP (measured: about 1.5 us + 1.2 us, 60 us for the very
first); under RDMA they pin memory, which was not measured, so other protocols keep the put-time copy.

CUDA tensors (`device_transfer`, with Mooncake's CUDA wheel): they stay out of the frame. The producer
registers each tensor's GPU memory and lists the sizes in the metadata; the consumer allocates and
registers receive buffers on its current CUDA device, and the same batch write that delivers the frame
writes them GPU to GPU. See `_device_transfer`.

Reclaim: unconsumed payloads are freed `ttl_s` after their put; `cleanup(request_id)` frees a
request's payloads; `close()` frees everything. A consumer whose request timed out keeps its region
reserved ("quarantined") until the producer's late answer arrives or `ttl_s` passes, so a late write
can never land in memory that was handed out again (the side channel's protocol: `_te_pull`).

Threads: calls block only the calling thread (asyncio code uses `asyncio.to_thread`). The side
channel is the connectors' shared one (a `RouterServer`, asked through a `DealerPool`, started at
construction: with a metadata server its port names the segment); its thread also reaps expired
payloads and quarantined regions. A small pool of transfer threads performs the writes and answers
when each is done, so one large transfer does not hold up the others.

Metadata (msgpack-able): {"segment": engine segment name (`host:rpc_port` with P2PHANDSHAKE),
"endpoint": "tcp://host:port", "session": producer instance id, "handle": int, "addr": producer pool
address, "length": frame bytes, "key": "from->to/put_key"[, "device": [bytes of each device tensor]]}.
The producer checks session, handle, key, length and the device buffers before it writes anything.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import zmq

from omni_mesh import codec
from omni_mesh.connectors import (
    _device_transfer,
    _frame_pieces,
    _growth,
    _pool_outputs,
    _te_outputs,
    _te_pull,
)
from omni_mesh.connectors._addresses import tcp_endpoint
from omni_mesh.connectors._channel_guard import MAX_REQUEST_BYTES, side_channel_keys
from omni_mesh.connectors._checks import check_not_negative, check_port, check_positive
from omni_mesh.connectors._dealers import ChannelClosed, DealerPool, NotConnected
from omni_mesh.connectors._held import Gone, PendingReleases
from omni_mesh.connectors._mooncake_common import (
    PoolErrors,
    RegisteredPool,
    check_protocol,
    close_at_exit,
    import_mooncake,
    payload_name,
    pool_status,
    probe_metadata_server,
    resolve_host,
)
from omni_mesh.connectors._registrations import Registrations
from omni_mesh.connectors._served import GONE, POLL_S, NotThere, producer_endpoint
from omni_mesh.connectors._te_payloads import Payloads
from omni_mesh.connectors._zmq_channel import ERR, OK, Answer, Deferred, Reply, RouterServer
from omni_mesh.connectors.base import (
    ConnectorConfigError,
    ConnectorError,
    Counters,
    OmniConnectorBase,
    edge_key,
)

__all__ = ["MooncakeTransferEngineConfig", "MooncakeTransferEngineConnector"]

OWNER = "MooncakeTransferEngineConnector"
P2P = "P2PHANDSHAKE"
_DEALER_IDLE_S = 60.0  # a side-channel socket unused this long is closed (its producer may be gone)


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


class MooncakeTransferEngineConnector(OmniConnectorBase):
    config_class = MooncakeTransferEngineConfig
    scope = "network"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)  # validates before the backend is looked for
        cfg: MooncakeTransferEngineConfig = self.config
        engine_module = import_mooncake("mooncake.engine", OWNER)
        self.host = resolve_host(cfg.host)
        probe_metadata_server(cfg.metadata_server, cfg.connect_timeout_s, OWNER)
        # With the mesh's keys only mesh members reach the side channel: nobody else can make this
        # producer write anywhere (the pull checks below come on top).
        self._keys = side_channel_keys(OWNER)
        self._session = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._closed = False
        self._handles = itertools.count(1)
        self._payloads: Payloads | None = None
        self._quarantine = PendingReleases()  # regions of timed-out gets, until the late answer or ttl_s
        self._device_leaves = self.device_leaves_policy()
        self._counters = Counters(
            "puts",
            "gets",
            "bytes_put",
            "bytes_got",
            "errors",
            "expired",
            "cleaned",
            "local_gets",
            "device_tensors",
        )
        self._ctx = zmq.Context()
        # Answers are as small as requests: a producer sending more is not one of ours.
        self._dealers = DealerPool(
            self._ctx, self._keys, immediate=True, max_reply_bytes=MAX_REQUEST_BYTES, idle_s=_DEALER_IDLE_S
        )
        self._workers = ThreadPoolExecutor(cfg.transfer_threads, thread_name_prefix="omni-mesh-te-transfer")
        self._server: RouterServer | None = None
        self._engine: Any = None
        self._pool: RegisteredPool | None = None
        self._registrations: Registrations | None = None
        self._outputs: _te_outputs.Outputs | None = None
        self._live_outputs: dict = {}  # the outputs' table where a put of them may skip planning
        try:
            self._server = RouterServer(
                self._ctx,
                self.host,
                cfg.zmq_port,
                {_te_pull.PULL: self._on_pull, _te_pull.LOOKUP: self._on_lookup},
                self._tick,
                OWNER,
                keys=self._keys,
                port_name="zmq_port",
            )
            self._zmq_port = self._server.start()
            self.endpoint = tcp_endpoint(self.host, self._zmq_port)
            self._engine, self.segment = self._start_engine(engine_module)
            self._pool = RegisteredPool(
                cfg.memory_pool_size,
                prefault=cfg.prefault,
                errors=self._pool_errors(),
                ceiling=_growth.ceiling(cfg.memory_pool_size, cfg.max_pool_size, _growth.ram()),
                register=lambda address, size: self._engine.register_memory(address, size) == 0,
                unregister=lambda address: self._engine.unregister_memory(address),
                idle_s=cfg.pool_idle_release_s,
            )
            rc = self._engine.register_memory(self._pool.address, self._pool.size)
            if rc != 0:
                raise ConnectorError(
                    f"{OWNER}: registering the {self._pool.size}-byte pool with the engine failed (rc={rc}); "
                    "lower memory_pool_size or check the RDMA device's memory-lock limit (ulimit -l)"
                )
            self._registrations = Registrations(self._engine, self._pool.contains)
            self._outputs = _te_outputs.Outputs(self._pool)
            self._put_fields = {"segment": self.segment, "endpoint": self.endpoint, "session": self._session}
            if not self._device_leaves.host_min_bytes:  # CPU tensors never take the device path
                self._live_outputs = self._outputs.live
            self._payloads = Payloads(
                OWNER, self._engine, self._pool, self._registrations, self._session, cfg
            )
        except BaseException:
            self._teardown()
            raise
        close_at_exit(self)

    def _start_engine(self, engine_module: Any) -> tuple[Any, str]:
        cfg: MooncakeTransferEngineConfig = self.config
        engine = engine_module.TransferEngine()
        if cfg.metadata_server == P2P:
            local_name = self.host
        else:
            # With a metadata server the segment name is taken verbatim and must be unique; the side
            # channel's port is unique on this host for our lifetime. The engine advertises
            # MC_TCP_BIND_ADDRESS, else its first non-loopback address: make it ours.
            local_name = f"{self.host}:{self._zmq_port}"
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.host)
        rc = engine.initialize(local_name, cfg.metadata_server, cfg.protocol, cfg.device_name)
        if rc != 0:
            raise ConnectorError(
                f"{OWNER}: the transfer engine did not start on {self.host} (rc={rc}, metadata_server="
                f"{cfg.metadata_server!r}, protocol={cfg.protocol!r}, device_name={cfg.device_name!r}); "
                "check that the metadata server is reachable and the device exists"
            )
        segment = f"{self.host}:{engine.get_rpc_port()}" if cfg.metadata_server == P2P else local_name
        return engine, segment

    def _pool_errors(self) -> PoolErrors:
        return PoolErrors(
            OWNER,
            "max_pool_size",  # the ceiling the pool grows to
            "unconsumed payloads or live views",
            "raise max_pool_size, consume payloads sooner, or drop tensors returned by get()",
            lambda: self._counters.add("errors"),
        )

    def device_leaves_policy(self) -> _device_transfer.DeviceLeavesPolicy:
        """Which tensors go device to device beside the frame (asked once, at construction). Tests
        override it to send CPU tensors that way on machines without GPUs."""
        return _device_transfer.default_policy(self.config.device_transfer)

    # ------------------------------------------------------------------ producer side

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor over a region of the registered pool: returned in a put's payload,
        the engine sends it from there (nothing is copied at put; `_te_outputs`). The region goes back
        when the tensor and the payloads holding it are gone. Do not write into it after the put."""
        shape = tuple(int(n) for n in shape)
        nbytes = _pool_outputs.nbytes_of(shape, dtype)
        self._open_pool("empty()")
        min_bytes = self.config.zero_copy_min_bytes  # 0: nothing is sent from its own memory
        if not min_bytes or nbytes < max(_pool_outputs.MIN_BYTES, min_bytes):
            return torch.empty(shape, dtype=dtype)
        tensor = self._outputs.empty(shape, dtype)
        # The pool is full: an ordinary tensor, copied at put as any other.
        return tensor if tensor is not None else torch.empty(shape, dtype=dtype)

    def _count_put_error(self) -> None:
        self._counters.add("errors")

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        if self._live_outputs and type(data) is dict:
            planned = self._outputs.plan(data)  # a dict of empty() outputs alone: laid out in place
            if planned is not None:
                return self._put_planned(from_stage, to_stage, put_key, planned)
        where = payload_name(from_stage, to_stage, put_key)
        pool = self._open_pool(f"put of {where}")
        device = self._device_leaves.split()
        try:
            frame = codec.plan(data, device=device)
        except codec.UnsupportedTypeError as exc:
            raise ConnectorError(f"{OWNER}: cannot put {where}: {exc}") from None
        size = frame.nbytes
        pool.check_fits(size, f"put of {where}")
        handle, key = next(self._handles), edge_key(from_stage, to_stage, put_key)
        device_tensors = device.tensors if device else []
        payload = self._payloads.put(frame, device_tensors, (key, put_key, handle), f"put of {where}")
        if self._closed:  # close() may have emptied the table before this payload went in
            self._payloads.finish(payload, consumed=True)
            raise ConnectorError(f"{OWNER} is closed (put of {where})")
        self._counters.add_many(puts=1, bytes_put=size, device_tensors=len(device_tensors))
        metadata = {
            "segment": self.segment,
            "endpoint": self.endpoint,
            "session": self._session,
            "handle": handle,
            "addr": payload.address,
            "length": size,
            "key": key,
        }
        if device_tensors:
            metadata["device"] = [t.nbytes for t in device_tensors]
        return True, size, metadata

    def _put_planned(self, from_stage: str, to_stage: str, put_key: str, planned: _te_outputs.Planned) -> tuple:
        size, headroom = planned[0], planned[3]
        handle, key = next(self._handles), edge_key(from_stage, to_stage, put_key)
        try:
            pool = self._open_pool("put")
            if size > pool.ceiling:  # the consumer could never receive it (its pool grows alike)
                pool.check_fits(size, f"put of {payload_name(from_stage, to_stage, put_key)}")
            address = self._payloads.put_planned(planned, (key, put_key, handle))
        except BaseException:
            headroom.give_back()
            raise
        if self._closed:  # close() may have emptied the table before this payload went in
            self._payloads.close()
            raise ConnectorError(f"{OWNER} is closed (put of {payload_name(from_stage, to_stage, put_key)})")
        self._counters.add_pair("puts", "bytes_put", size)
        return True, size, {**self._put_fields, "handle": handle, "addr": address, "length": size, "key": key}

    def _on_pull(self, args: list[bytes]) -> Deferred:
        """PULL key request (server thread): checked here, written and answered by a transfer thread."""
        request = _te_pull.parse_request(args)
        return Deferred(lambda answer: self._workers.submit(self._serve_pull, args[0], request, answer))

    def _serve_pull(self, key: bytes, request: dict, answer: Answer) -> None:
        """Transfer thread: write one payload into the requesting consumer's pool, then answer."""
        try:
            if request["session"] != self._session:
                error = f"the producer at {self.endpoint} restarted since the put; the payload is gone"
            else:
                error = self._payloads.write(request, closing=lambda: self._closed)
        except Exception as exc:  # the answer must always go back, whatever failed
            error = f"{type(exc).__name__}: {exc}"
        if error is None:
            answer([OK, key])
        else:  # a payload not (or no more) there: the consumer's get() answers None
            answer([GONE if isinstance(error, Gone) else ERR, key, error.encode()])

    def _on_lookup(self, args: list[bytes]) -> Reply:
        """LOOKUP key (server thread): what a consumer holding only the key needs to pull it."""
        if len(args) != 1:
            raise ValueError("malformed lookup request")
        payload = self._payloads.find(args[0].decode())
        if payload is None:
            return [GONE, args[0], b"no payload under this key"], None
        handle = int(payload.key.rsplit("#", 1)[1])
        found = {"session": self._session, "handle": handle, "length": payload.size}
        if payload.device:
            found["device"] = [t.nbytes for t in payload.device]
        return [OK, args[0], msgpack.packb(found)], None

    # ------------------------------------------------------------------ consumer side

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None
    ) -> tuple[Any, int] | None:
        """A poll: None when the producer has no such payload (any more) or, by key alone, cannot be
        reached within a second. A transfer under way is waited for (transfer_timeout_s)."""
        return self._get(from_stage, to_stage, get_key, metadata, poll=True)

    def _wait_once(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None, deadline: float
    ) -> tuple[Any, int] | None:
        return self._get(from_stage, to_stage, get_key, metadata, poll=False)

    def _get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: Any, *, poll: bool
    ) -> tuple[Any, int] | None:
        where = payload_name(from_stage, to_stage, get_key)
        pool = self._open_pool(f"get of {where}")
        key = edge_key(from_stage, to_stage, get_key)
        if not _te_pull.complete(metadata):
            metadata = self._lookup(metadata, key, where, poll)
            if metadata is None:
                return None
        meta = _te_pull.check_metadata(OWNER, metadata, key, where)
        try:
            if meta["session"] == self._session:
                return self._get_local(meta, where)
            return self._get_remote(pool, meta, where)
        except NotThere:
            return None

    def _lookup(self, metadata: Any, key: str, where: str, poll: bool) -> dict | None:
        """Full metadata for a get by key alone, from the producer named by partial metadata or the
        config's sender fields; None when it has no such payload (or, polling, does not answer)."""
        fields = metadata if isinstance(metadata, dict) else {}
        if fields.get("key", key) != key:
            raise ConnectorError(f"{OWNER}: metadata for {where} was made for {fields['key']!r}")
        endpoint = fields.get("endpoint") if isinstance(fields.get("endpoint"), str) else None
        endpoint = endpoint or producer_endpoint(fields, self.config)
        if endpoint is None:
            if self._payloads is not None and self._payloads.find(key) is not None:
                endpoint = self.endpoint  # put here: this instance is the producer
            else:
                return None
        wait = min(POLL_S, self.config.connect_timeout_s)
        try:
            reply = self._dealers.request(endpoint, [_te_pull.LOOKUP, key.encode()], wait, connect_timeout_s=wait)
        except (TimeoutError, zmq.ZMQError, NotConnected) as exc:
            if poll:
                return None
            raise ConnectorError(f"{OWNER}: get of {where}: the producer {endpoint} did not answer: {exc}") from None
        except ChannelClosed:
            raise ConnectorError(f"{OWNER} is closed (get of {where})") from None
        if reply[0].bytes == GONE:
            return None
        if reply[0].bytes != OK or len(reply) != 3:
            raise ConnectorError(f"{OWNER}: get of {where}: the producer {endpoint} refused the lookup")
        found = msgpack.unpackb(reply[2].bytes, raw=False)
        if not isinstance(found, dict):
            raise ConnectorError(f"{OWNER}: get of {where}: malformed lookup answer from {endpoint}")
        return {"segment": "", "endpoint": endpoint, "addr": 0, "key": key, **found}

    def _get_remote(self, pool: RegisteredPool, meta: dict, where: str) -> tuple[Any, int]:
        length = meta["length"]
        offset = pool.reserve(length, self.config.pool_wait_s, f"get of {where}")
        device: list[torch.Tensor] = []
        receiving: list[int] = []

        def release() -> None:  # nothing can land in the region and buffers any more
            pool.free(offset)
            self._registrations.release(receiving)
            device.clear()

        try:
            device += self._receive_buffers(meta, where, receiving)
            request = {"segment": self.segment, "addr": pool.address_of(offset)}
            if device:
                request["device_addrs"] = [buffer.data_ptr() for buffer in device]
            _te_pull.pull(OWNER, self.config, self._dealers, self._quarantine, meta, request, where, release)
        except _te_pull.PullTimedOut:
            self._counters.add("errors")
            raise  # `release` runs at the late answer or ttl_s
        except NotThere:
            release()
            raise
        except BaseException:
            release()
            self._counters.add("errors")
            raise
        self._registrations.release(receiving)
        data = pool.decode(offset, length, where, copy=self.config.copy_on_get, device=device)
        self._counters.add_many(gets=1, bytes_got=length, device_tensors=len(device))
        return data, length

    def _receive_buffers(self, meta: dict, where: str, registered: list[int]) -> list[torch.Tensor]:
        """Buffers for the payload's device tensors, if it has any, registered into `registered`."""
        sizes = meta.get("device", [])
        if not sizes:
            return []
        try:
            buffers = self._device_leaves.receive_buffers(sizes)
        except RuntimeError as exc:  # out of device memory
            raise ConnectorError(
                f"{OWNER}: get of {where}: no memory for {sum(sizes)} device bytes: {exc}"
            ) from None
        addresses = self._registrations.receive(buffers)
        if addresses is None:
            raise ConnectorError(
                f"{OWNER}: get of {where}: the engine refused to register a receive buffer on "
                f"{buffers[0].device}"
            )
        registered += addresses
        return buffers

    def _get_local(self, meta: dict, where: str) -> tuple[Any, int]:
        """Producer and consumer are this instance: hand the producer's region over, no transfer."""
        payload = self._payloads.claim(meta["key"], meta["handle"], meta["length"])
        if isinstance(payload, Gone):
            raise NotThere(payload)
        if isinstance(payload, str):
            self._counters.add("errors")
            raise ConnectorError(f"{OWNER}: get of {where}: {payload}")
        length, offset, pool = payload.size, payload.offset, self._pool
        # The producer's own device tensors are handed over as they are (copy_on_get clones them).
        device = [t.reshape(-1).view(torch.uint8) for t in payload.device]
        if payload.pieces is not None:  # assemble the frame from its pieces in a fresh region
            try:
                offset = pool.reserve(length, self.config.pool_wait_s, f"get of {where}")
                _frame_pieces.assemble(payload.pieces, pool.address_of(offset))
            finally:
                self._payloads.finish(payload, consumed=True)
        else:
            self._payloads.hand_over(payload)
        data = pool.decode(offset, length, where, copy=self.config.copy_on_get, device=device)
        self._counters.add_many(gets=1, bytes_got=length, local_gets=1, device_tensors=len(device))
        return data, length

    # ------------------------------------------------------------------ housekeeping and lifecycle

    def _tick(self) -> None:
        """On the server thread: expire payloads, end quarantines, close long-idle sockets."""
        expired = self._payloads.expire() if self._payloads is not None else 0
        if expired:
            self._counters.add("expired", expired)
        self._quarantine.reap()
        self._dealers.reap_idle()

    def _open_pool(self, what: str) -> RegisteredPool:
        pool = self._pool
        if self._closed or pool is None:
            raise ConnectorError(f"{OWNER} is closed ({what})")
        return pool

    def reap_consumed(self) -> None:
        """Expire payloads past ttl_s and end quarantines whose late answer came (the server thread
        does this every tick; a caller may do it now)."""
        self._tick()

    def cleanup(self, key: str) -> None:
        """Free the payloads this process put under `key` or `key/...` that nobody consumed yet (one
        being written is freed when its write ends)."""
        freed = self._payloads.clean(key) if not self._closed else 0
        if freed:
            self._counters.add("cleaned", freed)

    def health(self) -> dict:
        counters = self._counters.snapshot()
        server, registrations, quarantined = self._server, self._registrations, len(self._quarantine)
        up = not self._closed and server is not None and server.alive
        status, in_use, size = pool_status(self._pool, up=up, strained=bool(quarantined))
        return {
            "status": status,
            **counters,
            **self._put_health(),
            "pending_payloads": len(self._payloads) if self._payloads is not None else 0,
            "quarantined_regions": quarantined,
            "pool_size": size,
            "pool_in_use": in_use,
            "pool_grown": self._pool.grown if self._pool is not None else 0,
            "pool_released": self._pool.released if self._pool is not None else 0,
            "registered_leaves": len(registrations) if registrations is not None else 0,
            "segment": getattr(self, "segment", ""),
            "endpoint": getattr(self, "endpoint", ""),
            "protocol": self.config.protocol,
            "curve": self._keys is not None,
            "refused_peers": server.guard.refused.count if server is not None else 0,
            "malformed_requests": server.guard.malformed.count if server is not None else 0,
        }

    def close(self) -> None:
        with self._lock:
            closed, self._closed = self._closed, True
        if not closed:
            self._teardown()

    def _teardown(self) -> None:
        """Release everything, in order; also used when __init__ fails half-way."""
        if self._server is not None:
            self._server.stop()  # answers still due are dropped: their consumers time out
        self._workers.shutdown(wait=True)  # in-flight writes finish before the pool goes away
        if self._payloads is not None:
            self._payloads.close()
        self._quarantine.release_all()
        self._dealers.close()
        engine, pool, registrations = self._engine, self._pool, self._registrations
        self._engine = self._pool = None
        if registrations is not None:
            registrations.close()
        if engine is not None and pool is not None:
            engine.unregister_memory(pool.address)
        if pool is not None:
            pool.close()
        del engine  # the engine's own teardown takes about a second
        self._ctx.destroy(linger=0)
