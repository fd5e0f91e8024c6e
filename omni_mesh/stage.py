"""Stage runtime: one replica of one stage, as an asyncio service.

The replica registers with the coordinator, heartbeats, and runs the stage handler for each piece of
work the coordinator routes to it (never more than `max_inflight` at once: the coordinator holds the
rest). Inputs come through the inbound edge's connector, outputs go out through each outbound edge's
connector, and only the connector metadata travels back to the coordinator. Every connector call runs
in a thread pool so the event loop never blocks. A request that fails, times out or is aborted has
everything it holds in connectors cleaned up.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from omni_mesh import aio, codec, control, ingress, logs
from omni_mesh.connectors import ConnectorError, OmniConnectorBase, create_connector, creation_rank
from omni_mesh.control import (
    Abort,
    Chunk,
    Deregister,
    Drained,
    Error,
    Heartbeat,
    Message,
    Output,
    Register,
    Registered,
    Rejected,
    Work,
)
from omni_mesh.errors import InvalidInput
from omni_mesh.hostinfo import namespace, process_info
from omni_mesh.security import mesh_keys, secure_client
from omni_mesh.topology import EdgeSpec, StageSpec, Topology, add_to_sys_path

log = logging.getLogger("omni_mesh.stage")

HEARTBEAT_S = 0.5  # until the coordinator announces its interval at registration
HEALTH_WAIT_S = 0.25  # longest a heartbeat waits for connector health (a backend RPC) before sending
#: How long a replica keeps releasing what it put for an aborted request: a consumer still holding
#: a payload when the abort arrives (its handler is being cancelled) lets go of it moments later.
ABORT_SWEEP_S = 10.0


@dataclass
class StageContext:
    """What a handler knows about the request it is working on."""

    request_id: str
    params: dict
    stage: str
    replica: str
    deadline: float  # event-loop time
    stream: bool = False  # the client reads the final output as a stream
    #: Allocates output tensors where the outgoing edge keeps memory (`empty`); None: ordinary tensors.
    allocate: Callable[[tuple[int, ...], Any], Any] | None = field(default=None, repr=False)

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def empty(self, shape: tuple[int, ...] | list[int], dtype: Any) -> Any:
        """An uninitialized output tensor already in the memory of this stage's FIRST outgoing edge (in
        topology order): returned in the output, its put there copies nothing; other edges get a copy,
        as for any tensor. Do not write into it after returning it. Synchronous (the pool may grow):
        call it where the output is computed, e.g. in the handler's worker thread."""
        if self.allocate is None:
            import torch  # handlers that never ask for an output tensor do not need it here

            return torch.empty(tuple(shape), dtype=dtype)
        return self.allocate(tuple(shape), dtype)


class StageInputError(RuntimeError):
    """An input payload could not be fetched (gone, stale, or the connector failed)."""


#: The initial PID namespace (the kernel's PROC_PID_INIT_INO): a process outside any container.
_INITIAL_PID_NAMESPACE = "pid:[4026531836]"


def default_replica_id(stage: str, host: str) -> str:
    """`stage-host-pid`, plus the PID namespace inside a container: pids there repeat from one
    container to the next, and containers on the host network all carry the host's name, so
    `--scale` would otherwise give every replica the same id."""
    pidns = namespace("pid")
    suffix = f"-{pidns.removeprefix('pid:[').rstrip(']')}" if pidns not in ("", _INITIAL_PID_NAMESPACE) else ""
    return f"{stage}-{host}-{os.getpid()}{suffix}"


def load_handler(topology: Topology, stage: StageSpec) -> Callable[..., Any]:
    if not stage.handler:
        raise ValueError(f"stage {stage.name!r} ({stage.stage_id}) has no handler: set `handler: module:callable`")
    module_name, _, attr = stage.handler.partition(":")
    if not module_name or not attr:
        raise ValueError(f"stage {stage.name!r}: handler {stage.handler!r} must look like 'module:callable'")
    add_to_sys_path(topology)
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"stage {stage.name!r}: cannot load handler {stage.handler!r}: {exc}") from exc
    if not callable(handler):
        raise ValueError(f"stage {stage.name!r}: handler {stage.handler!r} is not callable")
    return handler


_END = object()


class _ChunkStream:
    """The async iterator a handler reads a streamed input from; fetches each chunk as it is read."""

    def __init__(self, fetch: Callable[[dict], Any]) -> None:
        self._fetch = fetch
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def feed(self, chunk_message: Chunk) -> None:
        self._queue.put_nowait(_END if chunk_message.end else chunk_message)

    def fail(self, error: BaseException) -> None:
        self._queue.put_nowait(error)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return await self._fetch(item)


@dataclass
class _Work:
    rid: str
    ctx: StageContext
    task: asyncio.Task | None = None
    stream: _ChunkStream | None = None
    transfer_s: float = 0.0
    edges: dict[str, dict[str, float]] = field(default_factory=dict)  # dst -> {bytes, put_s} put so far
    started: float = field(default_factory=time.perf_counter)


class StageReplica:
    def __init__(
        self,
        topology: Topology,
        stage: StageSpec,
        coordinator: str,
        replica_id: str | None = None,
        *,
        host: str | None = None,
        drain_grace_s: float = 30.0,
        health_file: str | None = None,
    ) -> None:
        self.topology = topology
        self.stage = stage
        self.coordinator = coordinator
        self.host = host or socket.gethostname()
        self.replica_id = replica_id or default_replica_id(stage.name, self.host)
        self.drain_grace_s = drain_grace_s
        self.health_file = Path(health_file) if health_file else None
        self.handler = load_handler(topology, stage)
        self.in_edges = {topology.stage(e.src).name: e for e in topology.inputs_of(stage.stage_id)}
        self.out_edges = {topology.stage(e.dst).name: e for e in topology.outputs_of(stage.stage_id)}
        self.is_final = any(s.stage_id == stage.stage_id for s in topology.final_stages)
        self.connectors: dict[str, OmniConnectorBase] = {}
        self._ingress: OmniConnectorBase | None = None  # fetches request inputs too large to ride inline
        specs = {e.connector.ref: e.connector for e in [*self.in_edges.values(), *self.out_edges.values()]}
        for spec in sorted(specs.values(), key=lambda s: creation_rank(s.name)):  # the registry's load order
            self.connectors[spec.ref] = create_connector(spec.name, spec.extra)
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{stage.name}-io")
        # Health has its own thread: heartbeats must not wait behind long transfers in the I/O pool.
        self.health_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{stage.name}-health")
        # The latest connector health, refreshed beside the heartbeats: a heartbeat never waits for it
        # (a backend RPC can stall behind busy transfers, and a late heartbeat reads as a dead replica).
        self._health: dict[str, dict] = {}
        self._health_refresh: asyncio.Task | None = None
        self.work: dict[str, _Work] = {}
        self.aborted: dict[str, float] = {}  # rid -> until when (loop time) to sweep what we put for it
        self.processed = 0
        self.errors = 0
        self.malformed = 0
        self.draining = False
        self.heartbeat_s = HEARTBEAT_S
        self._registered = asyncio.Event()
        self._drained = asyncio.Event()  # the coordinator says no running request needs us any more
        self._stopped = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, control.MAX_MESSAGE_BYTES)  # the coordinator sends metadata only
        secure_client(self._socket, mesh_keys())
        self._socket.connect(coordinator)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_drain)
        receiver = asyncio.create_task(self._receive_loop())
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        sweeper = asyncio.create_task(self._sweep_loop())
        try:
            producers = {self.connectors[e.connector.ref] for e in self.out_edges.values()}
            for connector in producers:
                await loop.run_in_executor(self.executor, connector.warm_up)
            await self._register()
            log.info("replica %s of stage %s ready", self.replica_id, self.stage.name)
            await self._stopped.wait()
        finally:
            for task in (receiver, heartbeat, sweeper, self._health_refresh):
                if task is not None:
                    task.cancel()
            with contextlib.suppress(Exception):
                await self._send(Deregister(self.replica_id))
            self.close()

    def request_drain(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("replica %s draining: finishing %d in-flight request(s)", self.replica_id, len(self.work))
            asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        await self._heartbeat()  # tell the coordinator at once so no new work arrives
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_grace_s
        # Finishing our own work is not enough: what we put may still wait for a downstream replica
        # to fetch it, and exiting takes it along. The coordinator answers our (draining) heartbeats
        # with `drained` once every request we took part in has ended (and tells every replica so
        # when it shuts down). Unregistered, we hold nothing anybody waits for.
        while loop.time() < deadline and (
            self.work or (self._registered.is_set() and not self._drained.is_set())
        ):
            await asyncio.sleep(0.05)
        self._stopped.set()

    def close(self) -> None:
        for connector in [*self.connectors.values(), *([self._ingress] if self._ingress else [])]:
            with contextlib.suppress(Exception):
                connector.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.health_executor.shutdown(wait=False, cancel_futures=True)
        self._socket.close(0)
        self._ctx.term()

    async def _register(self) -> None:
        message = Register(
            **{**process_info(), "host": self.host},
            stage=self.stage.name,
            replica=self.replica_id,
            max_inflight=self.stage.max_inflight,
            edges={e.label: e.connector.name for e in [*self.in_edges.values(), *self.out_edges.values()]},
            connectors=await self._connector_health(),  # the first read may take long: it is waited for
        )
        while not self._registered.is_set():
            await self._send(message)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._registered.wait(), timeout=1.0)
            if not self._registered.is_set():
                log.info("replica %s waiting for the coordinator at %s", self.replica_id, self.coordinator)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self._registered.is_set():
                await self._heartbeat()

    async def _heartbeat(self) -> None:
        await self._send(
            Heartbeat(
                self.replica_id,
                len(self.work),
                processed=self.processed,
                errors=self.errors,
                malformed=self.malformed,
                draining=self.draining,
                connectors=await self._latest_health(),
            )
        )
        if self.health_file is not None and not self.draining:
            self.health_file.touch()  # container health checks look at its age

    async def _latest_health(self) -> dict[str, dict]:
        """Fresh connector health, or the last one read if the read stalls: a heartbeat waits for it
        HEALTH_WAIT_S at most (the read goes on, and the next heartbeat does not start another)."""
        if self._health_refresh is None or self._health_refresh.done():
            self._health_refresh = asyncio.ensure_future(self._refresh_health())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._health_refresh), timeout=HEALTH_WAIT_S)
        return self._health

    async def _refresh_health(self) -> None:
        try:
            self._health = await self._connector_health()
        except Exception as exc:  # a connector's health() failing must not take the heartbeats along
            log.warning("replica %s: reading connector health failed: %s", self.replica_id, exc)

    async def _connector_health(self) -> dict[str, dict]:
        """In the thread pool: some connectors ask their backend (a datasystem worker RPC)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.health_executor, lambda: {ref: c.health() for ref, c in self.connectors.items()}
        )

    async def _send(self, message: Message, *extra: Any) -> None:
        await self._socket.send_multipart([control.pack(message), *extra], copy=False)

    # ------------------------------------------------------------------ messages

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                message = control.unpack(frames[0])
            except control.MalformedMessage as exc:
                self.malformed += 1
                log.warning("replica %s dropped a control message: %s", self.replica_id, exc)
                if exc.rid is not None:  # say so, or that request would wait for its deadline
                    await self._send(Error(exc.rid, self.stage.name, self.replica_id, str(exc), status=400))
                continue
            if isinstance(message, Registered):
                self.heartbeat_s = min(max(float(message.heartbeat_s), 0.05), 5.0)
                self._registered.set()
            elif isinstance(message, Rejected):
                self._rejected(message)
            elif isinstance(message, Work):
                self._accept(message)
            elif isinstance(message, Chunk):
                work = self.work.get(message.rid)
                if work is not None and work.stream is not None:
                    work.stream.feed(message)
            elif isinstance(message, Drained):
                self._drained.set()
            elif isinstance(message, Abort):
                self._abort(message.rid, message.reason)
            else:
                self.malformed += 1

    def _rejected(self, message: Rejected) -> None:
        if not message.reregister:
            log.error("coordinator rejected replica %s: %s", self.replica_id, message.error)
            self._stopped.set()
            return
        log.warning("coordinator asks replica %s to register again: %s", self.replica_id, message.error)
        if self._registered.is_set():
            self._registered.clear()
            asyncio.get_running_loop().create_task(self._register())

    def _output_allocator(self) -> Callable[[tuple[int, ...], Any], Any] | None:
        """ctx.empty's allocator: the connector of the first outgoing edge (a final stage has none)."""
        for edge in self.out_edges.values():
            return self.connectors[edge.connector.ref].empty
        return None

    def _accept(self, message: Work) -> None:
        rid = message.rid
        loop = asyncio.get_running_loop()
        ctx = StageContext(
            rid,
            message.params,
            self.stage.name,
            self.replica_id,
            loop.time() + message.remaining_s,
            message.stream,
            allocate=self._output_allocator(),
        )
        work = _Work(rid, ctx)
        if message.stream_from:
            work.stream = _ChunkStream(lambda item: self._fetch(work, message.stream_from, item))
        self.work[rid] = work
        self._drained.clear()  # a new request may need what we put for it
        work.task = loop.create_task(self._run(work, message))

    def _abort(self, rid: str, reason: str) -> None:
        work = self.work.get(rid)
        if work is not None and work.task is not None:
            work.task.cancel()
        loop = asyncio.get_running_loop()
        self.aborted[rid] = loop.time() + ABORT_SWEEP_S
        loop.create_task(self._cleanup(rid))

    async def _sweep_loop(self) -> None:
        """Clean up aborted requests again: connectors skip payloads a consumer held at the abort."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if not self.aborted:
                continue
            rids = list(self.aborted)
            with contextlib.suppress(Exception):
                await loop.run_in_executor(self.executor, self._cleanup_all, rids)
            now = loop.time()
            for rid in rids:
                if self.aborted.get(rid, now) <= now:
                    self.aborted.pop(rid, None)

    def _cleanup_all(self, rids: list[str]) -> None:
        """In the thread pool: release what every connector holds for each of `rids`."""
        for connector in self.connectors.values():
            for rid in rids:
                with contextlib.suppress(Exception):
                    connector.cleanup(rid)

    async def _cleanup(self, rid: str) -> None:
        loop = asyncio.get_running_loop()
        for connector in self.connectors.values():
            with contextlib.suppress(Exception):
                await loop.run_in_executor(self.executor, connector.cleanup, rid)

    # ------------------------------------------------------------------ running one request

    async def _run(self, work: _Work, message: Work) -> None:
        logs.request_id.set(work.rid)  # this task's own context: every line logged for it names the request
        deadline = asyncio.timeout_at(work.ctx.deadline)
        try:
            async with deadline:
                inputs = await self._inputs(work, message)
                result = self.handler(inputs, work.ctx)
                if inspect.isasyncgen(result):
                    seq = 0
                    async for chunk in result:
                        await self._emit(work, chunk, seq, streaming=True)
                        seq += 1
                    await self._emit(work, None, seq, streaming=True, end=True)
                else:
                    if inspect.isawaitable(result):
                        result = await result
                    await self._emit(work, result, 0, streaming=False)
            self.processed += 1
            log.debug("stage %s finished request %s in %.1f ms", self.stage.name, work.rid,
                      (time.perf_counter() - work.started) * 1000)
        except asyncio.CancelledError:
            pass  # aborted by the coordinator, which already answered the client
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():  # not a handler's own timeout
                await self._fail(work, f"deadline exceeded in stage {self.stage.name!r}", timeout=True)
            elif isinstance(exc, InvalidInput):  # the request is at fault, not the stage: 422
                log.info("stage %s refused request %s: %s", self.stage.name, work.rid, exc)
                await self._fail(work, str(exc), status=422)
            else:
                log.exception("stage %s failed request %s", self.stage.name, work.rid)
                await self._fail(work, f"{type(exc).__name__}: {exc}")
        finally:
            self.work.pop(work.rid, None)

    async def _fail(self, work: _Work, error: str, *, timeout: bool = False, status: int = 500) -> None:
        self.errors += 1
        await self._cleanup(work.rid)
        await self._send(Error(work.rid, self.stage.name, self.replica_id, error, timeout=timeout, status=status))

    async def _inputs(self, work: _Work, message: Work) -> Any:
        if message.inputs_ref is not None:  # request inputs too large for a control message
            return await self._fetch_large_inputs(work, message.inputs_ref)
        if message.is_entry:  # an entry stage: the request's own inputs
            return message.inputs
        streamed = set(message.streamed)
        values: dict[str, Any] = {}
        for src, items in (message.sources or {}).items():
            objects = [await self._fetch(work, src, item) for item in items]
            values[src] = objects if src in streamed else objects[0]
        if message.stream_from:
            values[message.stream_from] = work.stream
        if len(self.in_edges) == 1 and len(values) == 1:
            return next(iter(values.values()))
        return values

    async def _fetch_large_inputs(self, work: _Work, ref: dict) -> Any:
        key, meta = ref.get("key"), ref.get("meta")
        if not isinstance(key, str):
            raise StageInputError(f"stage {self.stage.name!r}: the work's inputs_ref names no key")
        if self._ingress is None:
            self._ingress = ingress.consumer()
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self.executor, self._get_until, self._ingress, ingress.SOURCE, key, meta, work.ctx.remaining()
            )
        finally:
            work.transfer_s += time.perf_counter() - started
        return result[0]

    def _get_until(
        self, connector: OmniConnectorBase, src: str, key: str, meta: Any, remaining_s: float
    ) -> tuple[Any, int]:
        """In the thread pool: the payload, waiting until the request's deadline (or the connector's own
        get_timeout_s, when that comes first); ConnectorError naming edge and key past it."""
        limit = getattr(connector.config, "get_timeout_s", None)
        wait = remaining_s if limit is None else min(remaining_s, limit)
        return connector.get_with_deadline(src, self.stage.name, key, meta, deadline=time.monotonic() + wait)

    async def _fetch(self, work: _Work, src: str, item: dict | Chunk) -> Any:
        edge = self.in_edges.get(src)
        if edge is None:
            raise StageInputError(f"stage {self.stage.name!r} has no inbound edge from {src!r}")
        key, meta = (item.key, item.meta) if isinstance(item, Chunk) else (item.get("key"), item.get("meta"))
        if not isinstance(key, str):
            raise StageInputError(f"stage {self.stage.name!r}: the work for edge {edge.label} names no payload key")
        connector = self.connectors[edge.connector.ref]
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self.executor, self._get_until, connector, src, key, meta, work.ctx.remaining()
            )
        except ConnectorError as exc:  # the connector names stage names and key; add the edge as the graph has it
            raise StageInputError(
                f"stage {self.stage.name!r}: payload {key!r} on edge {edge.label} ({edge.connector.name}): {exc}"
            ) from None
        finally:
            work.transfer_s += time.perf_counter() - started
        return result[0]

    async def _emit(self, work: _Work, data: Any, seq: int, *, streaming: bool, end: bool = False) -> None:
        """Send one output (or, streaming, one chunk or the end marker) down every outbound edge."""
        loop = asyncio.get_running_loop()
        edges: dict[str, dict] = {}
        started = time.perf_counter()
        key = f"{work.rid}/{seq}"
        if not end:
            for dst, edge in self.out_edges.items():
                put_started = time.perf_counter()
                meta, size = await self._put(edge, dst, key, data)
                edges[dst] = {"key": key, "meta": meta}
                sent = work.edges.setdefault(dst, {"bytes": 0, "put_s": 0.0})
                sent["bytes"] += size
                sent["put_s"] += time.perf_counter() - put_started
        extra: list[Any] = []
        if self.is_final and not end:
            frame = await loop.run_in_executor(self.executor, codec.encode, data)
            if len(frame) > control.MAX_FRAME_BYTES:  # the coordinator would drop our connection for it
                raise RuntimeError(
                    f"final output of {len(frame)} bytes exceeds the control plane's limit of {control.MAX_FRAME_BYTES} "
                    "bytes: return a smaller result (or a reference to where the data is stored)"
                )
            extra.append(frame)
        work.transfer_s += time.perf_counter() - started
        last = end or not streaming
        message = Output(
            work.rid, self.stage.name, self.replica_id, edges, seq, last,
            end=end, final=bool(extra), timings=self._timings(work) if last else {},
        )
        await self._send(message, *extra)

    async def _put(self, edge: EdgeSpec, dst: str, key: str, data: Any) -> tuple[Any, int]:
        """Put `data` on `edge`: (the metadata the consumer needs, the payload's size)."""
        connector = self.connectors[edge.connector.ref]
        loop = asyncio.get_running_loop()
        try:
            ok, size, meta = await loop.run_in_executor(self.executor, connector.put, self.stage.name, dst, key, data)
        except Exception as exc:
            raise RuntimeError(f"put of {key!r} on edge {edge.label} ({edge.connector.name}) failed: {exc}") from exc
        if not ok:
            reason = connector.put_error(self.stage.name, dst, key) or "the connector gave no reason"
            raise RuntimeError(f"put of {key!r} on edge {edge.label} ({edge.connector.name}) failed: {reason}")
        return meta, size

    def _timings(self, work: _Work) -> dict[str, Any]:
        total = time.perf_counter() - work.started
        timings: dict[str, Any] = {
            "transfer_s": work.transfer_s, "handler_s": max(0.0, total - work.transfer_s), "total_s": total,
        }
        if work.edges:
            timings["edges"] = work.edges
        return timings


async def serve_stage(topology: Topology, stage_name: str, coordinator: str, **options: Any) -> None:
    replica = StageReplica(topology, topology.stage(stage_name), coordinator, **options)
    await replica.run()


def main_stage(topology: Topology, stage_name: str, coordinator: str, **options: Any) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {stage_name} %(levelname)s %(message)s", stream=sys.stderr)
    aio.run(serve_stage(topology, stage_name, coordinator, **options))
    return 0
