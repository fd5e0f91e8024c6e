"""MooncakeTransferEngineConnector's machinery: the engine, its registered pool, the side channel and
the payloads this process holds (the public module's docstring says how a payload travels).

Here: construction and teardown in order, the producer side (put, the side channel's PULL and LOOKUP
answers) and the consumer's entry (`te_receive` does one get). Engine return codes are mapped to the
connectors' exception family in `mooncake.errors`; the pool's own limits raise PayloadTooLarge and
ConnectorFull (`pools.registered.RegisteredPool`).
"""

from __future__ import annotations

import itertools
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import torch
import zmq

from omni_mesh import codec
from omni_mesh.connectors._addresses import resolve_host, tcp_endpoint
from omni_mesh.connectors.config import MooncakeTransferEngineConfig
from omni_mesh.connectors.counters import Counters
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorError
from omni_mesh.connectors.keys import edge_key, payload_name
from omni_mesh.connectors.mooncake import device_transfer, te_engine, te_outputs, te_pull
from omni_mesh.connectors.mooncake.loading import import_mooncake
from omni_mesh.connectors.mooncake.probes import probe_metadata_server
from omni_mesh.connectors.mooncake.registrations import Registrations
from omni_mesh.connectors.mooncake.te_payloads import Payload, Payloads
from omni_mesh.connectors.mooncake.te_receive import Receiver
from omni_mesh.connectors.pools import outputs as _pool_outputs
from omni_mesh.connectors.pools.held import Gone, PendingReleases
from omni_mesh.connectors.pools.registered import PoolErrors, RegisteredPool, pool_status
from omni_mesh.connectors.served.channel import ERR, OK, Answer, Deferred, Reply, RouterServer
from omni_mesh.connectors.served.connector import GONE
from omni_mesh.connectors.served.dealers import DealerPool
from omni_mesh.connectors.served.guard import MAX_REQUEST_BYTES, side_channel_keys

OWNER = "MooncakeTransferEngineConnector"
_DEALER_IDLE_S = 60.0  # a side-channel socket unused this long is closed (its producer may be gone)


class TransferEngineNode:
    """Engine, pool, side channel and payloads (what MooncakeTransferEngineConnector delegates to)."""

    def __init__(
        self, cfg: MooncakeTransferEngineConfig, device_leaves: device_transfer.DeviceLeavesPolicy
    ) -> None:
        self.config = cfg
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
        self._device_leaves = device_leaves
        self.counters = self._counters = Counters(
            "puts", "gets", "bytes_put", "bytes_got", "errors", "expired", "cleaned", "local_gets", "device_tensors"
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
        self._outputs: te_outputs.Outputs | None = None
        self._live_outputs: dict = {}  # the outputs' table where a put of them may skip planning
        try:
            self._server = RouterServer(
                self._ctx,
                self.host,
                cfg.zmq_port,
                {te_pull.PULL: self._on_pull, te_pull.LOOKUP: self._on_lookup},
                self.reap_consumed,
                OWNER,
                keys=self._keys,
                port_name="zmq_port",
            )
            self._zmq_port = self._server.start()
            self.endpoint = tcp_endpoint(self.host, self._zmq_port)
            self._engine, self.segment = te_engine.start_engine(
                engine_module, OWNER, self.host, self._zmq_port, cfg
            )
            pool_errors = PoolErrors(
                OWNER,
                "max_pool_size",  # the ceiling the pool grows to
                "unconsumed payloads or live views",
                "raise max_pool_size, consume payloads sooner, or drop tensors returned by get()",
                self.error,
            )
            self._pool = te_engine.registered_pool(lambda: self._engine, OWNER, cfg, pool_errors)
            self._registrations = Registrations(self._engine, self._pool.contains)
            self._outputs = te_outputs.Outputs(self._pool)
            self._put_fields = {"segment": self.segment, "endpoint": self.endpoint, "session": self._session}
            if not self._device_leaves.host_min_bytes:  # CPU tensors never take the device path
                self._live_outputs = self._outputs.live
            self._payloads = Payloads(
                OWNER, self._engine, self._pool, self._registrations, self._session, cfg, self._count_put
            )
            self._receiver = Receiver(
                self._payloads,
                device_leaves=self._device_leaves,
                dealers=self._dealers,
                quarantine=self._quarantine,
                counters=self._counters,
                segment=self.segment,
                endpoint=self.endpoint,
            )
        except BaseException:
            self._teardown()
            raise

    def error(self) -> None:
        self._counters.add("errors")

    # ------------------------------------------------------------------ producer side

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(n) for n in shape)
        nbytes = _pool_outputs.nbytes_of(shape, dtype)
        self._open_pool("empty()")
        min_bytes = self.config.zero_copy_min_bytes  # 0: nothing is sent from its own memory
        if not min_bytes or nbytes < max(_pool_outputs.MIN_BYTES, min_bytes):
            return torch.empty(shape, dtype=dtype)
        tensor = self._outputs.empty(shape, dtype)
        # The pool is full: an ordinary tensor, copied at put as any other.
        return tensor if tensor is not None else torch.empty(shape, dtype=dtype)

    def _count_put(self, payload: Payload) -> None:
        self._counters.add_pair("puts", "bytes_put", payload.size)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        if self._live_outputs and type(data) is dict:
            # A dict of empty() outputs alone: laid out in place (at empty(), for one output alone).
            planned = self._outputs.take_ready(data) or self._outputs.plan(data)
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
            raise ConnectorClosed(f"{OWNER} is closed (put of {where})")
        self._counters.add_many(puts=1, bytes_put=size, device_tensors=len(device_tensors))
        metadata = {**self._put_fields, "handle": handle, "addr": payload.address, "length": size, "key": key}
        if device_tensors:
            metadata["device"] = [t.nbytes for t in device_tensors]
        return size, metadata

    def _put_planned(
        self, from_stage: str, to_stage: str, put_key: str, planned: te_outputs.Planned
    ) -> tuple[int, dict]:
        """Hold a payload of empty() outputs laid out in place: its metadata alone, no pool touched
        (`plan` and the layout at empty() keep to the pool's ceiling; a close meanwhile is caught
        after)."""
        size, pieces, _, headroom = planned
        handle, key = next(self._handles), edge_key(from_stage, to_stage, put_key)
        try:
            self._payloads.put_planned(planned, key, put_key, handle)  # counted once stored (_count_put)
        except BaseException:
            headroom.give_back()
            raise
        if self._closed:  # close() may have emptied the table before this payload went in
            self._payloads.close()
            raise ConnectorClosed(f"{OWNER} is closed (put of {payload_name(from_stage, to_stage, put_key)})")
        head_address = pieces[0][0]  # the frame starts with its head, in the headroom
        return size, {**self._put_fields, "handle": handle, "addr": head_address, "length": size, "key": key}

    def _on_pull(self, args: list[bytes]) -> Deferred:
        """PULL key request (server thread): checked here, written and answered by a transfer thread."""
        request = te_pull.parse_request(args)
        return Deferred(lambda answer: self._workers.submit(self._serve_pull, args[0], request, answer))

    def _serve_pull(self, key: bytes, request: dict, answer: Answer) -> None:
        """Transfer thread: write one payload into the requesting consumer's pool, then answer."""
        try:
            if request["session"] != self._session:
                raise ConnectorError(f"the producer at {self.endpoint} restarted since the put; the payload is gone")
            inline = self._payloads.write(request, closing=lambda: self._closed)
        except Gone as exc:  # a payload not (or no more) there: the consumer's get() answers None
            answer([GONE, key, str(exc).encode()])
        except Exception as exc:  # the answer must always go back, whatever failed
            said = str(exc) if isinstance(exc, ConnectorError) else f"{type(exc).__name__}: {exc}"
            answer([ERR, key, said.encode()])
        else:
            answer([OK, key] if inline is None else [OK, key, inline])

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
        self, from_stage: str, to_stage: str, get_key: str, metadata: Any, *, poll: bool, deadline: float | None = None
    ) -> tuple[Any, int] | None:
        where = payload_name(from_stage, to_stage, get_key)
        self._open_pool(f"get of {where}")
        key = edge_key(from_stage, to_stage, get_key)
        return self._receiver.get(key, where, metadata, poll=poll, deadline=deadline)

    # ------------------------------------------------------------------ housekeeping and lifecycle

    def reap_consumed(self) -> None:
        """Expire payloads past ttl_s, end quarantines whose late answer came, close long-idle sockets
        (the server thread does this every tick; a caller may do it now)."""
        expired = self._payloads.expire() if self._payloads is not None else 0
        if expired:
            self._counters.add("expired", expired)
        self._quarantine.reap()
        self._dealers.reap_idle()

    def _open_pool(self, what: str) -> RegisteredPool:
        pool = self._pool
        if self._closed or pool is None:
            raise ConnectorClosed(f"{OWNER} is closed ({what})")
        return pool

    def cleanup(self, key: str) -> None:
        """Free the payloads put under `key` or `key/...` that nobody consumed (one being written
        when its write ends)."""
        freed = self._payloads.clean(key) if not self._closed else 0
        if freed:
            self._counters.add("cleaned", freed)

    def health(self) -> dict:
        # First: it stores (and counts) the puts whose bookkeeping was deferred.
        pending = len(self._payloads) if self._payloads is not None else 0
        counters = self._counters.snapshot()
        server, registrations, quarantined = self._server, self._registrations, len(self._quarantine)
        up = not self._closed and server is not None and server.alive
        status, in_use, size = pool_status(self._pool, up=up, strained=bool(quarantined))
        return {
            "status": status,
            **counters,
            "pending_payloads": pending,
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
