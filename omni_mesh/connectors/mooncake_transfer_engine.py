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
frame offsets in the consumer's region (one `batch_transfer_sync_write`). The consumer sees the same
frame, byte for byte. The registration is dropped when the payload is freed (consumed, expired,
cleaned up or closed). So a handler MUST NOT mutate a tensor or array after returning it (putting it)
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
can never land in memory that was handed out again.

Threads: calls block only the calling thread (asyncio code uses `asyncio.to_thread`). One agent
thread per instance serves the side channel, reaps expired payloads and quarantined regions; a small
pool of transfer threads performs the writes, so one large transfer does not hold up the others.

Metadata (msgpack-able): {"segment": engine segment name (`host:rpc_port` with P2PHANDSHAKE),
"endpoint": "tcp://host:port", "session": producer instance id, "handle": int, "addr": producer pool
address, "length": frame bytes, "key": "from->to/put_key"[, "device": [bytes of each device tensor]]}.
The producer checks session, handle, key, length and the device buffers before it writes anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from omni_mesh import codec
from omni_mesh.connectors import _device_transfer
from omni_mesh.connectors._checks import check_not_negative, check_port, check_positive
from omni_mesh.connectors._mooncake_common import (
    RegisteredPool,
    check_protocol,
    close_at_exit,
    import_mooncake,
    payload_name,
    probe_metadata_server,
    resolve_host,
)
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
_AGENT_TICK_MS = 50
_MAX_MESSAGE = 64 * 1024  # side-channel messages are a few hundred bytes
_DEALER_IDLE_S = 60.0  # a side-channel socket unused this long is closed (its producer may be gone)
_MAX_DEVICE_TENSORS = 4096  # per payload
_MAX_DEVICE_BYTES = 1 << 40


@dataclass(frozen=True)
class MooncakeTransferEngineConfig:
    #: Address to advertise and bind; "auto" picks the interface that routes outside (see _mooncake_common).
    host: str = "auto"
    #: "tcp" or "rdma" (the engine falls back to TCP where no RDMA device is found).
    protocol: str = "tcp"
    #: RDMA device(s), e.g. "mlx5_0" or "mlx5_0,mlx5_1"; "" lets the engine choose.
    device_name: str = ""
    #: "P2PHANDSHAKE" (nothing to deploy) or an "http://host:port/metadata" / etcd metadata server.
    metadata_server: str = P2P
    #: The registered pool of this process; the largest payload (frame) must fit in it.
    memory_pool_size: int = 512 * 1024 * 1024
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

    def __post_init__(self) -> None:
        check_protocol(OWNER, self.protocol)
        check_positive(
            OWNER,
            memory_pool_size=self.memory_pool_size,
            ttl_s=self.ttl_s,
            connect_timeout_s=self.connect_timeout_s,
            transfer_timeout_s=self.transfer_timeout_s,
            transfer_threads=self.transfer_threads,
        )
        check_not_negative(OWNER, zero_copy_min_bytes=self.zero_copy_min_bytes, pool_wait_s=self.pool_wait_s)
        check_port(OWNER, "zmq_port", self.zmq_port)
        if not self.host.strip():
            raise ConnectorConfigError(f"{OWNER}: host must be an address or 'auto'")


@dataclass
class _Payload:
    put_key: str
    key: str
    offset: int  # its pool region: the whole frame, or only head and small leaves (see `writes`)
    length: int  # frame bytes
    expires: float
    claimed: bool = False  # a transfer of it is in flight
    cancelled: bool = False  # cleanup()/close() asked for it while in flight
    #: None: the frame lies whole at `offset`. Else the pieces making up the frame, in frame order:
    #: (source address, offset in the frame, bytes); sources are pool pieces or large leaves.
    writes: list[tuple[int, int, int]] | None = None
    sources: list[Any] = field(default_factory=list)  # large leaves, kept alive and unchanged
    registered: list[int] = field(default_factory=list)  # their engine registrations (addresses)
    #: Device tensors sent beside the frame (DeviceLeaves), in frame order: contiguous, registered.
    device: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Quarantined:
    socket: zmq.Socket
    request_id: int
    offset: int
    until: float
    device: list[torch.Tensor] = field(default_factory=list)  # receive buffers a late write may still fill


class MooncakeTransferEngineConnector(OmniConnectorBase):
    config_class = MooncakeTransferEngineConfig
    scope = "network"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)  # validates before the backend is looked for
        cfg: MooncakeTransferEngineConfig = self.config
        engine_module = import_mooncake("mooncake.engine", OWNER)
        self.host = resolve_host(cfg.host)
        probe_metadata_server(cfg.metadata_server, cfg.connect_timeout_s, OWNER)
        self._session = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._payloads: dict[int, _Payload] = {}
        self._handles = itertools.count(1)
        self._request_ids = itertools.count(1)
        # Idle DEALER sockets per producer endpoint (a socket is used by one thread at a time) and
        # when each endpoint was last used: sockets to producers long gone are closed by the agent.
        self._idle_dealers: dict[str, list[zmq.Socket]] = {}
        self._dealer_used: dict[str, float] = {}
        self._quarantine: list[_Quarantined] = []
        self._handoff: list[_Quarantined] = []  # filled by callers, taken over by the agent thread
        self._counters = Counters(
            "puts", "gets", "bytes_put", "bytes_got", "errors", "expired", "cleaned", "local_gets", "device_tensors"
        )
        self._ctx = zmq.Context()
        self._engine: Any = None
        self._pool: RegisteredPool | None = None
        # Memory of large leaves registered with the engine: address -> [length, payloads using it].
        # The engine refuses overlapping registrations, so a second payload of the same leaf shares one.
        self._registrations: dict[int, list[int]] = {}
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            # Requests are tiny: a peer sending more is not one of ours and gets disconnected.
            self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
            self._zmq_port = self._bind_router(cfg.zmq_port)
            self.endpoint = f"tcp://{_url_host(self.host)}:{self._zmq_port}"
            self._results_address = f"inproc://omni-mesh-te-{self._session}"
            self._results = self._ctx.socket(zmq.PULL)
            self._results.bind(self._results_address)
            self._engine, self.segment = self._start_engine(engine_module)
            self._pool = RegisteredPool(cfg.memory_pool_size, prefault=cfg.prefault)
            rc = self._engine.register_memory(self._pool.address, self._pool.size)
            if rc != 0:
                raise ConnectorError(
                    f"{OWNER}: registering the {self._pool.size}-byte pool with the engine failed (rc={rc}); "
                    "lower memory_pool_size or check the RDMA device's memory-lock limit (ulimit -l)"
                )
        except BaseException:
            self._teardown_partial()
            raise
        self._workers = ThreadPoolExecutor(cfg.transfer_threads, thread_name_prefix="omni-mesh-te-transfer")
        self._worker_state = threading.local()
        self._push_sockets: list[zmq.Socket] = []
        self._agent = threading.Thread(target=self._agent_loop, name="omni-mesh-te-agent", daemon=True)
        self._agent.start()
        close_at_exit(self)

    # ------------------------------------------------------------------ setup

    def _bind_router(self, port: int) -> int:
        address = f"tcp://{_url_host(self.host)}"
        try:
            if port:
                self._router.bind(f"{address}:{port}")
                return port
            return self._router.bind_to_random_port(address)
        except zmq.ZMQError as exc:
            raise ConnectorError(
                f"{OWNER}: cannot bind the side channel on {self.host}:{port or 'any port'} ({exc}); "
                "set `host` to an address of this machine, or pick another zmq_port"
            ) from None

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

    # ------------------------------------------------------------------ producer side

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict | None]:
        where = payload_name(from_stage, to_stage, put_key)
        pool = self._open_pool(f"put of {where}")
        device = _device_transfer.policy(self.config.device_transfer)
        try:
            frame = codec.plan(data, device=device)
        except codec.UnsupportedTypeError as exc:
            self._counters.add("errors")
            raise ConnectorError(f"{OWNER}: cannot put {where}: {exc}") from None
        size = frame.nbytes
        self._check_fits(pool, size, f"put of {where}")
        device_tensors = device.tensors if device else []
        large, registered = self._pick_large_leaves(frame, where)
        try:
            if device_tensors:
                self._register_device(device_tensors, registered, where)
            if large:
                offset, writes = self._write_pieces(pool, frame, large, where)
            else:
                offset, writes = self._allocate(pool, size, f"put of {where}"), None
                try:
                    frame.write_into(pool.array, offset)
                except BaseException:
                    pool.free(offset)
                    raise
        except BaseException:
            with self._lock:
                self._unregister_locked(registered)
            raise
        handle = next(self._handles)
        key = edge_key(from_stage, to_stage, put_key)
        payload = _Payload(
            put_key,
            key,
            offset,
            size,
            time.monotonic() + self.config.ttl_s,
            writes=writes,
            sources=[frame.leaves[i] for i, _ in large],
            registered=registered,
            device=device_tensors,
        )
        with self._lock:
            if self._closed:
                self._release_locked(payload)
                raise ConnectorError(f"{OWNER} is closed (put of {where})")
            self._payloads[handle] = payload
        self._counters.add_many(puts=1, bytes_put=size, device_tensors=len(device_tensors))
        metadata = {
            "segment": self.segment,
            "endpoint": self.endpoint,
            "session": self._session,
            "handle": handle,
            "addr": pool.address + offset,
            "length": size,
            "key": key,
        }
        if device_tensors:
            metadata["device"] = [t.nbytes for t in device_tensors]
        return True, size, metadata

    def _register_device(self, tensors: list[torch.Tensor], registered: list[int], where: str) -> None:
        """Register the memory of the tensors sent device to device (after their kernels are done)."""
        _device_transfer.settle(tensors)
        with self._lock:
            if self._closed:
                raise ConnectorError(f"{OWNER} is closed (put of {where})")
            for tensor in tensors:
                if tensor.nbytes and not self._register_locked(tensor.data_ptr(), tensor.nbytes, registered):
                    self._counters.add("errors")
                    raise ConnectorError(
                        f"{OWNER}: put of {where}: the engine refused to register {tensor.nbytes} bytes of "
                        f"{tensor.device} memory; set device_transfer: false to send CUDA tensors through host memory"
                    )

    def _pick_large_leaves(
        self, frame: codec.FramePlan, where: str
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """The leaves to send from their own memory, as (index, address), and the registrations made."""
        cfg: MooncakeTransferEngineConfig = self.config
        if cfg.protocol != "tcp" or not cfg.zero_copy_min_bytes:
            return [], []
        candidates = []
        for index, (leaf, length) in enumerate(zip(frame.leaves, frame.lengths, strict=True)):
            if length >= cfg.zero_copy_min_bytes:
                address = _leaf_address(leaf)
                if address is not None:
                    candidates.append((index, address))
        if not candidates:
            return [], []
        large: list[tuple[int, int]] = []
        registered: list[int] = []
        with self._lock:
            if self._closed:
                raise ConnectorError(f"{OWNER} is closed (put of {where})")
            for index, address in candidates:
                if self._register_locked(address, frame.lengths[index], registered):
                    large.append((index, address))
                # else: it overlaps memory registered otherwise; it is copied into the pool instead
        return large, registered

    def _register_locked(self, address: int, length: int, registered: list[int]) -> bool:
        pool = self._pool
        if pool.address <= address and address + length <= pool.address + pool.size:
            return True  # a view over our own pool (a get() result put again): registered already
        entry = self._registrations.get(address)
        if entry is not None:
            if entry[0] != length:
                return False
            entry[1] += 1
        else:
            if self._engine.register_memory(address, length) != 0:
                return False
            self._registrations[address] = [length, 1]
        registered.append(address)
        return True

    def _unregister_locked(self, registered: list[int]) -> None:
        for address in registered:
            entry = self._registrations.get(address)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del self._registrations[address]
                if self._engine is not None:
                    self._engine.unregister_memory(address)
        registered.clear()

    def _release_locked(self, payload: _Payload) -> None:
        """Give a payload's pool region, registrations and leaf references back."""
        pool = self._pool
        if pool is not None:  # None once close() has torn everything down
            pool.free(payload.offset)
        self._unregister_locked(payload.registered)
        payload.sources.clear()
        payload.device.clear()

    def _write_pieces(
        self, pool: RegisteredPool, frame: codec.FramePlan, large: list[tuple[int, int]], where: str
    ) -> tuple[int, list[tuple[int, int, int]]]:
        """Lay the frame minus its large leaves (and unreferenced padding) into a pool region.

        Returns the region's offset and the frame's pieces in frame order: (source address, frame
        offset, bytes). Pool pieces keep their frame offset modulo 64, so small leaves stay aligned.
        """
        offsets, lengths, leaves = frame.offsets, frame.lengths, frame.leaves
        large_at = dict(large)
        skipped = [
            (offsets[i], offsets[i] + lengths[i])
            for i, leaf in enumerate(leaves)
            if lengths[i] and (i in large_at or type(leaf) is codec._PagePad)
        ]
        runs: list[tuple[int, int, int]] = []  # (frame start, frame end, offset in the region)
        pos = start = 0
        for skip_start, skip_end in [*skipped, (frame.nbytes, frame.nbytes)]:
            if skip_start > start:
                at = codec.align(pos) + start % codec.ALIGN
                runs.append((start, skip_start, at))
                pos = at + skip_start - start
            start = skip_end
        offset = self._allocate(pool, pos, f"put of {where}")
        try:
            base = pool.address + offset
            head = frame.head
            ctypes.memmove(base, head, len(head))  # the first run starts at 0 and holds the head
            with memoryview(pool.array) as whole, whole[offset : offset + pos] as view:
                run = 0
                for i, leaf in enumerate(leaves):
                    if not lengths[i] or i in large_at or type(leaf) is codec._PagePad:
                        continue
                    while runs[run][1] <= offsets[i]:
                        run += 1
                    frame_start, _, at = runs[run]
                    codec._copy_leaf(leaf, view, base, at + offsets[i] - frame_start, lengths[i])
        except BaseException:
            pool.free(offset)
            raise
        writes = [(base + at, s, e - s) for s, e, at in runs]
        writes += [(address, offsets[i], lengths[i]) for i, address in large]
        writes.sort(key=lambda piece: piece[1])
        return offset, writes

    def _check_fits(self, pool: RegisteredPool, size: int, what: str) -> None:
        """A frame larger than the pool can never be received (consumers size their pool alike)."""
        if size > pool.size:
            self._counters.add("errors")
            raise ConnectorError(
                f"{OWNER}: {what} needs {size} bytes but memory_pool_size is {pool.size} bytes; "
                f"raise memory_pool_size in the connector's extra to at least '{_mib(size)}MiB' "
                "on both producer and consumer"
            )

    def _allocate(self, pool: RegisteredPool, size: int, what: str) -> int:
        self._check_fits(pool, size, what)
        offset = pool.allocate(size, self.config.pool_wait_s)
        if offset is None:
            self._counters.add("errors")
            raise ConnectorError(
                f"{OWNER}: {what} waited {self.config.pool_wait_s}s for {size} free bytes in the pool "
                f"({pool.in_use} of {pool.size} bytes held by unconsumed payloads or live views); raise "
                "memory_pool_size, consume payloads sooner, or drop tensors returned by get()"
            )
        return offset

    def _serve_pull(self, identity: bytes, request: dict) -> None:
        """Transfer thread: write one payload into the requesting consumer's pool, then answer."""
        reply = {"id": request.get("id"), "ok": False, "error": ""}
        try:
            reply.update(self._pull(request))
        except Exception as exc:  # the answer must always go back, whatever failed
            reply["error"] = f"{type(exc).__name__}: {exc}"
        self._reply(identity, reply)

    def _pull(self, request: dict) -> dict:
        handle, key, length = request.get("handle"), request.get("key"), request.get("length")
        segment, addr, timeout_ms = request.get("segment"), request.get("addr"), request.get("timeout_ms")
        if not (
            type(handle) is int
            and isinstance(key, str)
            and type(length) is int
            and isinstance(segment, str)
            and type(addr) is int
            and type(timeout_ms) is int
        ):
            return {"error": "malformed pull request"}
        deadline = time.monotonic() + timeout_ms / 1000
        if request.get("session") != self._session:
            return {"error": f"the producer at {self.endpoint} restarted since the put; the payload is gone"}
        with self._lock:
            payload = self._payloads.get(handle)
            if payload is None or payload.claimed or self._closed:
                return {
                    "error": "no such payload here (already consumed, expired after ttl_s, or cleaned up)"
                }
            if payload.key != key or payload.length != length:
                return {"error": f"metadata does not match the payload put under handle {handle}"}
            device_addrs = request.get("device_addrs", [])
            if not _device_addrs_match(device_addrs, payload.device):
                return {"error": f"the consumer's device buffers do not match the {len(payload.device)} device tensors"}
            payload.claimed = True
        rc = -1
        try:
            if time.monotonic() < deadline:  # the consumer has not given up on it yet
                if payload.device:
                    pieces = payload.writes or [(self._pool.address + payload.offset, 0, length)]
                    sent = [(t.data_ptr(), target, t.nbytes) for t, target in zip(payload.device, device_addrs, strict=True)]
                    sent = [piece for piece in sent if piece[2]]
                    rc = self._engine.batch_transfer_sync_write(
                        segment,
                        [source for source, _, _ in pieces] + [source for source, _, _ in sent],
                        [addr + at for _, at, _ in pieces] + [target for _, target, _ in sent],
                        [size for _, _, size in pieces] + [size for _, _, size in sent],
                    )
                elif payload.writes is None:
                    rc = self._engine.transfer_sync_write(
                        segment, self._pool.address + payload.offset, addr, length
                    )
                else:
                    rc = self._engine.batch_transfer_sync_write(
                        segment,
                        [source for source, _, _ in payload.writes],
                        [addr + at for _, at, _ in payload.writes],
                        [size for _, _, size in payload.writes],
                    )
        finally:
            with self._lock:
                payload.claimed = False
                if rc == 0 or payload.cancelled or self._closed:
                    self._payloads.pop(handle, None)
                    self._release_locked(payload)
        if rc != 0:
            call = "transfer_sync_write" if payload.writes is None else "batch_transfer_sync_write"
            return {"error": f"{call} to segment {segment} failed (rc={rc})"}
        return {"ok": True}

    def _reply(self, identity: bytes, reply: dict) -> None:
        push = getattr(self._worker_state, "push", None)
        if push is None:
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self._results_address)
            self._worker_state.push = push
            with self._lock:
                self._push_sockets.append(push)
        push.send_multipart([identity, msgpack.packb(reply)])

    # ------------------------------------------------------------------ consumer side

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict | None = None
    ) -> tuple[Any, int] | None:
        where = payload_name(from_stage, to_stage, get_key)
        pool = self._open_pool(f"get of {where}")
        meta = self._check_metadata(metadata, edge_key(from_stage, to_stage, get_key), where)
        if meta["session"] == self._session:
            return self._get_local(meta, where)
        length = meta["length"]
        offset = self._allocate(pool, length, f"get of {where}")
        device, device_registered = self._receive_buffers(meta, where)
        try:
            self._pull_into(meta, pool, offset, where, device)
        except _PullTimedOut:
            self._counters.add("errors")
            raise  # the buffers stay registered and referenced until the quarantine ends
        except BaseException:
            pool.free(offset)  # nothing can land there any more: the producer answered or was never asked
            self._unregister_receive(device_registered)
            self._counters.add("errors")
            raise
        self._unregister_receive(device_registered)
        data = self._decode(pool.view(offset, length), length, where, device)
        self._counters.add_many(gets=1, bytes_got=length, device_tensors=len(device))
        return data, length

    def _receive_buffers(self, meta: dict, where: str) -> tuple[list[torch.Tensor], list[int]]:
        """Registered buffers for the payload's device tensors, if it has any."""
        sizes = meta.get("device", [])
        if not sizes:
            return [], []
        try:
            buffers = _device_transfer.receive_buffers(sizes)
        except RuntimeError as exc:  # out of device memory
            self._counters.add("errors")
            raise ConnectorError(f"{OWNER}: get of {where}: no memory for {sum(sizes)} device bytes: {exc}") from None
        registered: list[int] = []
        for buffer in buffers:
            if not buffer.nbytes:
                continue
            if self._engine.register_memory(buffer.data_ptr(), buffer.nbytes) != 0:
                self._unregister_receive(registered)
                self._counters.add("errors")
                raise ConnectorError(
                    f"{OWNER}: get of {where}: the engine refused to register a {buffer.nbytes}-byte receive "
                    f"buffer on {buffer.device}"
                )
            registered.append(buffer.data_ptr())
        return buffers, registered

    def _unregister_receive(self, registered: list[int]) -> None:
        engine = self._engine
        if engine is not None:
            for address in registered:
                engine.unregister_memory(address)

    def _check_metadata(self, metadata: dict | None, key: str, where: str) -> dict:
        self._check_device_sizes(metadata, where)
        if not isinstance(metadata, dict):
            raise ConnectorError(f"{OWNER}: get of {where} needs the metadata that put() returned")
        kinds = {
            "segment": str,
            "endpoint": str,
            "session": str,
            "handle": int,
            "addr": int,
            "length": int,
            "key": str,
        }
        for name, kind in kinds.items():
            if type(metadata.get(name)) is not kind:
                raise ConnectorError(f"{OWNER}: metadata for {where} lacks a valid {name!r}: {metadata!r}")
        if metadata["key"] != key:
            raise ConnectorError(f"{OWNER}: metadata for {where} was made for {metadata['key']!r}")
        if not metadata["endpoint"].startswith("tcp://") or metadata["length"] <= 0:
            raise ConnectorError(f"{OWNER}: malformed metadata for {where}: {metadata!r}")
        return metadata

    def _check_device_sizes(self, metadata: Any, where: str) -> None:
        sizes = metadata.get("device", []) if isinstance(metadata, dict) else []
        if not (
            isinstance(sizes, list)
            and len(sizes) <= _MAX_DEVICE_TENSORS
            and all(type(n) is int and n >= 0 for n in sizes)
            and sum(sizes) <= _MAX_DEVICE_BYTES  # a hostile list must not make us allocate without bound
        ):
            raise ConnectorError(f"{OWNER}: metadata for {where} has a bad 'device' list: {sizes!r}"[:300])

    def _pull_into(
        self, meta: dict, pool: RegisteredPool, offset: int, where: str, device: list[torch.Tensor] | None = None
    ) -> None:
        """Ask the producer to write the payload at `offset` of our pool; raise on any failure."""
        cfg: MooncakeTransferEngineConfig = self.config
        endpoint = meta["endpoint"]
        sock = self._dealer(endpoint)
        if not sock.poll(int(cfg.connect_timeout_s * 1000), zmq.POLLOUT):
            sock.close(linger=0)  # nothing was sent, so nothing can be written late: the region is free
            raise ConnectorError(
                f"{OWNER}: get of {where}: the producer's side channel {endpoint} did not accept a "
                f"connection within {cfg.connect_timeout_s}s; is the producer process alive and reachable?"
            )
        request_id = next(self._request_ids)
        request = {
            "op": "pull",
            "id": request_id,
            "session": meta["session"],
            "handle": meta["handle"],
            "key": meta["key"],
            "length": meta["length"],
            "segment": self.segment,
            "addr": pool.address + offset,
            "timeout_ms": int(cfg.transfer_timeout_s * 1000),
        }
        if device:
            request["device_addrs"] = [buffer.data_ptr() for buffer in device]
        sock.send(msgpack.packb(request))
        deadline = time.monotonic() + cfg.transfer_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                self._quarantine_region(sock, request_id, offset, device or [])
                raise _PullTimedOut(
                    f"{OWNER}: get of {where}: the producer at {endpoint} did not deliver "
                    f"{meta['length']} bytes within transfer_timeout_s={cfg.transfer_timeout_s}s"
                )
            reply = _unpack(sock.recv())
            if reply.get("id") == request_id:
                break  # an older id is the late answer to a request that timed out on this socket
        self._release_dealer(endpoint, sock)
        if not reply.get("ok"):
            raise ConnectorError(
                f"{OWNER}: get of {where} failed at the producer {endpoint}: {reply.get('error')}"
            )

    def _get_local(self, meta: dict, where: str) -> tuple[Any, int]:
        """Producer and consumer are this instance: hand the producer's region over, no transfer."""
        with self._lock:
            payload = self._payloads.get(meta["handle"])
            if payload is None or payload.claimed or payload.length != meta["length"]:
                self._counters.add("errors")
                raise ConnectorError(
                    f"{OWNER}: get of {where}: no such payload (already consumed, expired after ttl_s, or cleaned up)"
                )
            del self._payloads[meta["handle"]]
        length = payload.length
        offset = payload.offset
        # The producer's own device tensors are handed over as they are (copy_on_get clones them).
        device = [t.reshape(-1).view(torch.uint8) for t in payload.device]
        if payload.writes is not None:  # assemble the frame from its pieces in a fresh region
            try:
                offset = self._allocate(self._pool, length, f"get of {where}")
                base = self._pool.address + offset
                for source, at, size in payload.writes:
                    ctypes.memmove(base + at, source, size)
            finally:
                with self._lock:
                    self._release_locked(payload)
        if payload.writes is None and payload.device:
            with self._lock:
                self._unregister_locked(payload.registered)
        data = self._decode(self._pool.view(offset, length), length, where, device)
        self._counters.add_many(gets=1, bytes_got=length, local_gets=1, device_tensors=len(device))
        return data, length

    def _decode(self, region: Any, length: int, where: str, device: list[torch.Tensor] | None = None) -> Any:
        try:
            if codec.frame_length(region) != length:
                raise codec.FrameError(f"frame length differs from the {length} bytes announced")
            return codec.decode(region, copy=self.config.copy_on_get, device_buffers=device)
        except codec.FrameError as exc:
            self._counters.add("errors")
            raise ConnectorError(f"{OWNER}: bad frame for {where}: {exc}") from None

    def _dealer(self, endpoint: str) -> zmq.Socket:
        with self._lock:
            idle = self._idle_dealers.get(endpoint)
            if idle:
                return idle.pop()
            sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
        sock.connect(endpoint)
        return sock

    def _release_dealer(self, endpoint: str, sock: zmq.Socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle_dealers.setdefault(endpoint, []).append(sock)
                self._dealer_used[endpoint] = time.monotonic()
                return
        sock.close(linger=0)

    def _quarantine_region(
        self, sock: zmq.Socket, request_id: int, offset: int, device: list[torch.Tensor]
    ) -> None:
        until = time.monotonic() + self.config.ttl_s
        with self._lock:
            self._handoff.append(_Quarantined(sock, request_id, offset, until, device))

    # ------------------------------------------------------------------ agent thread

    def _agent_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._results, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_AGENT_TICK_MS))
            if self._router in events:
                self._accept_requests()
            if self._results in events:
                self._send_results()
            self._reap_expired()
            self._reap_quarantine()
            self._reap_idle_dealers()

    def _accept_requests(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # not ours: a probe or a stray client
            identity, body = frames
            request = _unpack(body)
            if request.get("op") != "pull":
                self._router.send_multipart(
                    [
                        identity,
                        msgpack.packb({"id": request.get("id"), "ok": False, "error": "unknown request"}),
                    ]
                )
                continue
            try:
                self._workers.submit(self._serve_pull, identity, request)
            except RuntimeError:  # shutting down
                return

    def _send_results(self) -> None:
        while True:
            try:
                identity, body = self._results.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with contextlib.suppress(zmq.ZMQError):  # the consumer went away: nothing to tell
                self._router.send_multipart([identity, body], zmq.NOBLOCK)

    def _reap_expired(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [h for h, p in self._payloads.items() if p.expires <= now and not p.claimed]
            for handle in expired:
                self._release_locked(self._payloads.pop(handle))
        if expired:
            self._counters.add("expired", len(expired))

    def _reap_quarantine(self) -> None:
        with self._lock:
            self._quarantine.extend(self._handoff)
            self._handoff.clear()
        if not self._quarantine:
            return
        now = time.monotonic()
        keep = []
        for entry in self._quarantine:
            if self._late_answer(entry) or entry.until <= now:
                entry.socket.close(linger=0)
                self._pool.free(entry.offset)
                self._unregister_receive([b.data_ptr() for b in entry.device if b.nbytes])
            else:
                keep.append(entry)
        self._quarantine = keep

    def _reap_idle_dealers(self) -> None:
        stale_before = time.monotonic() - _DEALER_IDLE_S
        with self._lock:
            stale = [e for e, used in self._dealer_used.items() if used < stale_before]
            sockets = [sock for e in stale for sock in self._idle_dealers.pop(e, [])]
            for endpoint in stale:
                del self._dealer_used[endpoint]
        for sock in sockets:  # idle: no other thread holds them
            sock.close(linger=0)

    @staticmethod
    def _late_answer(entry: _Quarantined) -> bool:
        while entry.socket.poll(0, zmq.POLLIN):
            if _unpack(entry.socket.recv()).get("id") == entry.request_id:
                return True
        return False

    # ------------------------------------------------------------------ lifecycle

    def _open_pool(self, what: str) -> RegisteredPool:
        pool = self._pool
        if self._closed or pool is None:
            raise ConnectorError(f"{OWNER} is closed ({what})")
        return pool

    def cleanup(self, key: str) -> None:
        """Free the payloads this process put under `key` or `key/...` that nobody consumed yet."""
        prefix = key + "/"
        freed = 0
        with self._lock:
            if self._closed:
                return
            for handle, payload in list(self._payloads.items()):
                if payload.put_key == key or payload.put_key.startswith(prefix):
                    if payload.claimed:
                        payload.cancelled = True  # freed by the transfer thread when it is done
                    else:
                        del self._payloads[handle]
                        self._release_locked(payload)
                        freed += 1
        if freed:
            self._counters.add("cleaned", freed)

    def health(self) -> dict:
        counters = self._counters.snapshot()
        pool = self._pool
        with self._lock:
            pending = len(self._payloads)
            quarantined = len(self._quarantine) + len(self._handoff)
            registered = len(self._registrations)
        in_use = pool.in_use if pool is not None else 0
        size = pool.size if pool is not None else 0
        if self._closed or not self._agent.is_alive():
            status = "unhealthy"
        elif quarantined or in_use > 0.9 * size:
            status = "degraded"
        else:
            status = "healthy"
        return {
            "status": status,
            **counters,
            "pending_payloads": pending,
            "quarantined_regions": quarantined,
            "pool_size": size,
            "pool_in_use": in_use,
            "registered_leaves": registered,
            "segment": getattr(self, "segment", ""),
            "endpoint": getattr(self, "endpoint", ""),
            "protocol": self.config.protocol,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._agent.join()
        self._workers.shutdown(wait=True)  # in-flight writes finish before the pool goes away
        with self._lock:
            sockets = [s for idle in self._idle_dealers.values() for s in idle]
            sockets += [q.socket for q in self._quarantine + self._handoff] + self._push_sockets
            self._idle_dealers.clear()
            for payload in self._payloads.values():
                self._release_locked(payload)
            self._payloads.clear()
            self._quarantine.clear()
            self._handoff.clear()
        for sock in sockets:
            sock.close(linger=0)
        self._teardown_partial()

    def _teardown_partial(self) -> None:
        """Release engine, pool and sockets; also used when __init__ fails half-way."""
        with self._lock:  # a put racing close() may be releasing its registrations
            engine, pool = self._engine, self._pool
            self._engine = self._pool = None
            registrations, self._registrations = self._registrations, {}
        if engine is not None:
            for address in registrations:
                engine.unregister_memory(address)
        if engine is not None and pool is not None:
            engine.unregister_memory(pool.address)
        if pool is not None:
            pool.close()
        del engine  # the engine's own teardown takes about a second
        with contextlib.suppress(AttributeError):
            self._router.close(linger=0)
        with contextlib.suppress(AttributeError):
            self._results.close(linger=0)
        self._ctx.destroy(linger=0)


class _PullTimedOut(ConnectorError):
    """A pull timed out: its region stays reserved until the late answer or ttl_s."""


def _device_addrs_match(addrs: Any, tensors: list[torch.Tensor]) -> bool:
    """The consumer sent one receive address per device tensor (0 only for an empty one)."""
    if not isinstance(addrs, list) or len(addrs) != len(tensors):
        return False
    return all(type(a) is int and (a > 0 or not t.nbytes) for a, t in zip(addrs, tensors, strict=True))


def _leaf_address(leaf: Any) -> int | None:
    """Where a leaf's bytes lie, if they are one contiguous CPU run that can be sent as is."""
    if isinstance(leaf, torch.Tensor):
        return leaf.data_ptr() if leaf.is_cpu and leaf.is_contiguous() else None
    if isinstance(leaf, np.ndarray):
        return leaf.__array_interface__["data"][0] if leaf.flags.c_contiguous else None
    return None


def _unpack(body: bytes) -> dict:
    try:
        value = msgpack.unpackb(body, raw=False)
    except Exception:  # untrusted bytes: anything malformed is simply not a request
        return {}
    return value if isinstance(value, dict) else {}


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _mib(size: int) -> int:
    return -(-size // (1 << 20))
