"""A replica's work loop: the requests the coordinator routed to it, each in a task of its own.

For each request: its inputs are fetched through the inbound edges' connectors (or, streamed, as the
chunks arrive), the handler runs under the request's deadline, each output (or streamed chunk) is
put on every outbound edge and its metadata sent to the coordinator; a final stage also sends the
output itself. A request that fails, times out or is aborted has everything it holds in connectors
cleaned up (aborted ones again for ABORT_SWEEP_S: a consumer holding a payload lets go of it
moments later). Every connector call runs in the I/O thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack

from omni_mesh import control, ingress, logs
from omni_mesh.connectors import ConnectorError, OmniConnectorBase
from omni_mesh.connectors.errors import ConnectorClosed, ConnectorFull, ConnectorUnavailable, PayloadMissing
from omni_mesh.control import Chunk, Error, FailureKind, Output, Work
from omni_mesh.errors import InvalidInput
from omni_mesh.handlers import Handler, HandlerHooks
from omni_mesh.stage.client_frame import client_frame
from omni_mesh.stage.context import ChunkStream, StageContext, StageInputError
from omni_mesh.stage.overdue import cancel_overdue
from omni_mesh.stage.sent import SentLog
from omni_mesh.topology import EdgeSpec

log = logging.getLogger("omni_mesh.stage")

#: How long a replica keeps releasing what it put for an aborted request: a consumer still holding
#: a payload when the abort arrives (its handler is being cancelled) lets go of it moments later.
ABORT_SWEEP_S = 10.0
SWEEP_S = 0.5  # how often aborted requests are cleaned up again
#: An error message longer than this is cut (a handler's exception may quote a whole input): the error
#: message must fit in a control message, or the request would wait for its deadline.
MAX_ERROR_CHARS = 4096


@dataclass
class _Work:
    rid: str
    ctx: StageContext
    task: asyncio.Task | None = None
    stream: ChunkStream | None = None
    finished: bool = False  # its outputs all went out (not failed, not cancelled)
    transfer_s: float = 0.0
    edges: dict[str, dict[str, float]] = field(default_factory=dict)  # dst -> {bytes, put_s} put so far
    started: float = field(default_factory=time.perf_counter)

    @property
    def deadline(self) -> float:
        return self.ctx.deadline


def connector_failure(exc: ConnectorError) -> FailureKind:
    """How a connector failed a request: it had no room (the same request may pass later), the data
    plane failed (a payload gone or cut short, a peer unreachable, the connector closed), or it refused
    what the handler gave it (an output it cannot carry)."""
    if isinstance(exc, ConnectorFull):
        return FailureKind.CONNECTOR_FULL
    if isinstance(exc, (PayloadMissing, ConnectorUnavailable, ConnectorClosed)):
        return FailureKind.CONNECTOR_FAILED
    return FailureKind.CONNECTOR_REFUSED


class Runner:
    """The requests one replica works on (module docstring)."""

    def __init__(
        self,
        stage: str,
        replica_id: str,
        handler: Handler,
        hooks: HandlerHooks,
        connectors: dict[str, OmniConnectorBase],
        *,
        in_edges: dict[str, EdgeSpec],
        out_edges: dict[str, EdgeSpec],
        is_final: bool,
        executor: ThreadPoolExecutor,
        send: Callable[..., Awaitable[None]],
        released: Callable[[], Awaitable[None]] | None = None,
        freed: Callable[[], None] | None = None,
    ) -> None:
        self.stage = stage
        self.replica_id = replica_id
        self.handler = handler
        self.hooks = hooks  # found and checked at load (omni_mesh.handlers.hooks_of)
        self.connectors = connectors  # by connector ref
        self.in_edges, self.out_edges = in_edges, out_edges  # by the other stage's name
        self.is_final = is_final
        self.executor = executor
        self.sent = SentLog(stage, replica_id, send)  # outputs and errors, kept to send again after a drop
        self._released = released  # says at once that a request which ended unfinished has let go
        self._freed = freed  # told whenever a request ends here (a slot is free)
        self.ingress: OmniConnectorBase | None = None  # fetches request inputs too large to ride inline
        self.work: dict[str, _Work] = {}
        self.aborted: dict[str, float] = {}  # rid -> until when (loop time) to sweep what we put for it
        self.processed = 0
        self.errors = 0

    # ------------------------------------------------------------------ the coordinator's messages

    def start(self, message: Work) -> None:
        rid = message.rid
        loop = asyncio.get_running_loop()
        ctx = StageContext(
            rid,
            message.params,
            self.stage,
            self.replica_id,
            loop.time() + message.remaining_s,
            message.stream,
            allocate=self._output_allocator(),
        )
        work = _Work(rid, ctx)
        self.aborted.pop(rid, None)  # sent again (after a dropped connection): no longer ours to sweep
        self.sent.forget(rid)  # what an earlier run of it sent is not its answer any more
        if message.stream_from:
            work.stream = ChunkStream(lambda item: self._fetch(work, message.stream_from, item))
        self.work[rid] = work
        work.task = loop.create_task(self._run(work, message))
        # Not a `finally` in _run: a task cancelled before its first step (an Abort read in the same
        # batch as its Work, as after a reconnect) never runs its body, and its slot would stay taken.
        work.task.add_done_callback(lambda _task, work=work: self._ended(work))

    def feed(self, message: Chunk) -> None:
        work = self.work.get(message.rid)
        if work is not None and work.stream is not None:
            work.stream.feed(message)

    def holding(self) -> tuple[list[str], dict[str, int]]:
        """The requests still worked on, and per streamed one the seq of the next chunk it lacks."""
        chunks = {rid: w.stream.expected for rid, w in self.work.items() if w.stream is not None}
        return list(self.work), chunks

    def abort(self, rid: str) -> None:
        work = self.work.get(rid)
        if work is not None and work.task is not None:
            work.task.cancel()
        loop = asyncio.get_running_loop()
        self.aborted[rid] = loop.time() + ABORT_SWEEP_S
        self.sent.forget(rid)
        loop.create_task(self._cleanup(rid))

    def _output_allocator(self) -> Callable[[tuple[int, ...], Any], Any] | None:
        """ctx.empty's allocator: the connector of the first outgoing edge (a final stage has none)."""
        for edge in self.out_edges.values():
            return self.connectors[edge.connector.ref].empty
        return None

    # ------------------------------------------------------------------ cleaning up

    async def sweep_loop(self) -> None:
        """Clean up aborted requests again (connectors skip payloads a consumer held at the abort);
        cancel again what outlived its deadline (`overdue`)."""
        loop = asyncio.get_running_loop()
        while True:
            self.sent.expire(loop.time())  # what it keeps to send again, for requests past their deadline
            await asyncio.sleep(SWEEP_S)
            cancel_overdue(self.stage, list(self.work.values()), loop.time())
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
                    try:
                        async for chunk in result:
                            await self._emit(work, chunk, seq, streaming=True)
                            seq += 1
                    finally:  # its cleanup runs now, while the request still counts as in flight here
                        await result.aclose()
                    await self._emit(work, None, seq, streaming=True, end=True)
                else:
                    if inspect.isawaitable(result):
                        result = await result
                    await self._emit(work, result, 0, streaming=False)
            self.processed += 1
            work.finished = True
            log.debug(
                "stage %s finished request %s in %.1f ms",
                self.stage,
                work.rid,
                (time.perf_counter() - work.started) * 1000,
            )
        except asyncio.CancelledError:
            pass  # aborted by the coordinator, which already answered the client
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():  # not a handler's own timeout
                await self._fail(work, f"deadline exceeded in stage {self.stage!r}", FailureKind.DEADLINE)
            elif isinstance(exc, InvalidInput):  # the request is at fault, not the stage
                log.info("stage %s refused request %s: %s", self.stage, work.rid, exc)
                await self._fail(work, str(exc), FailureKind.INVALID_INPUT)
            elif isinstance(exc, (ConnectorError, StageInputError)):  # it names the edge: no type to add
                log.warning("stage %s failed request %s: %s", self.stage, work.rid, exc)
                kind = exc.kind if isinstance(exc, StageInputError) else connector_failure(exc)
                await self._fail(work, str(exc), kind)
            else:
                log.exception("stage %s failed request %s", self.stage, work.rid)
                await self._fail(work, f"{type(exc).__name__}: {exc}", FailureKind.HANDLER_FAILED)

    def _ended(self, work: _Work) -> None:
        """A request's task is done, however it ended: its slot is free."""
        if self.work.get(work.rid) is work:  # not a later run of the same request, sent again
            del self.work[work.rid]
        if not work.finished and self._released is not None:  # the coordinator may count it busy here
            asyncio.ensure_future(self._released())  # until a heartbeat no longer names it
        if self._freed is not None:
            self._freed()

    async def _fail(self, work: _Work, error: str, kind: FailureKind) -> None:
        self.errors += 1
        if len(error) > MAX_ERROR_CHARS:
            error = f"{error[:MAX_ERROR_CHARS]}... ({len(error) - MAX_ERROR_CHARS} more characters)"
        await self._cleanup(work.rid)
        message = Error(work.rid, self.stage, self.replica_id, error, kind)
        await self.sent.send(message, deadline=work.ctx.deadline)

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
            raise StageInputError(f"stage {self.stage!r}: the work's inputs_ref names no key")
        if self.ingress is None:
            self.ingress = ingress.consumer()
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self.executor, self._get_until, self.ingress, ingress.SOURCE, key, meta, work.ctx.remaining()
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
        return connector.get_with_deadline(src, self.stage, key, meta, deadline=time.monotonic() + wait)

    async def _fetch(self, work: _Work, src: str, item: dict | Chunk) -> Any:
        edge = self.in_edges.get(src)
        if edge is None:
            raise StageInputError(f"stage {self.stage!r} has no inbound edge from {src!r}")
        key, meta = (item.key, item.meta) if isinstance(item, Chunk) else (item.get("key"), item.get("meta"))
        if not isinstance(key, str):
            raise StageInputError(
                f"stage {self.stage!r}: the work for edge {edge.label} names no payload key"
            )
        connector = self.connectors[edge.connector.ref]
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self.executor, self._get_until, connector, src, key, meta, work.ctx.remaining()
            )
        except ConnectorError as exc:  # it names stage names and key; add the edge as the graph has it
            raise StageInputError(
                f"stage {self.stage!r}: payload {key!r} on edge {edge.label} ({edge.connector.name}): {exc}",
                FailureKind.CONNECTOR_FULL if isinstance(exc, ConnectorFull) else FailureKind.CONNECTOR_FAILED,
            ) from None
        finally:
            work.transfer_s += time.perf_counter() - started
        return result[0]

    async def _emit(self, work: _Work, data: Any, seq: int, *, streaming: bool, end: bool = False) -> None:
        """Send one output (or, streaming, one chunk or the end marker) down every outbound edge."""
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
            # A handler may keep what only its downstream stages need out of the client's answer
            # (an engine's hidden states): its `client_output` hook.
            extra.append(await client_frame(self.stage, self.hooks.client_output(data), self.executor))
        work.transfer_s += time.perf_counter() - started
        last = end or not streaming
        message = Output(
            work.rid,
            self.stage,
            self.replica_id,
            edges,
            seq,
            last,
            end=end,
            final=bool(extra),
            timings=self._timings(work) if last else {},
        )
        try:
            # Packing it checks it against the control plane's limit.
            await self.sent.send(message, *extra, deadline=work.ctx.deadline)
        except control.MessageTooLarge as exc:  # sent, the coordinator would drop it: fail the request
            raise RuntimeError(
                f"stage {self.stage!r} did not send output {seq}: {exc}; connector metadata by edge: "
                f"{self._metadata_sizes(edges)}. Outputs travel as payloads; a connector's metadata must stay small"
            ) from None

    def _metadata_sizes(self, edges: dict[str, dict]) -> str:
        """What each outbound edge's metadata adds to an output message, for the error that says it is too large."""
        sizes = []
        for dst, item in edges.items():
            edge = self.out_edges[dst]
            size = len(msgpack.packb(item, use_bin_type=True))
            sizes.append(f"{edge.label} ({edge.connector.name}) {size} bytes")
        return ", ".join(sizes) or "none"

    async def _put(self, edge: EdgeSpec, dst: str, key: str, data: Any) -> tuple[Any, int]:
        """Put `data` on `edge`: (the metadata the consumer needs, the payload's size)."""
        connector = self.connectors[edge.connector.ref]
        loop = asyncio.get_running_loop()
        # A failure raises a typed ConnectorError that names the connector, the edge and the key.
        size, meta = await loop.run_in_executor(
            self.executor, connector.put_or_raise, self.stage, dst, key, data
        )
        return meta, size

    def _timings(self, work: _Work) -> dict[str, Any]:
        total = time.perf_counter() - work.started
        timings: dict[str, Any] = {
            "transfer_s": work.transfer_s,
            "handler_s": max(0.0, total - work.transfer_s),
            "total_s": total,
        }
        if work.edges:
            timings["edges"] = work.edges
        return timings
