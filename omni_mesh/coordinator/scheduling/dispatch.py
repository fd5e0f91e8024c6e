"""Request dispatch: where each request is, what it waits for, and where it goes next.

The coordinator is the mesh's scheduler. It routes each piece of work to the least-loaded healthy
replica of the next stage (holding it in a per-stage queue while every replica is full), gathers
fan-in inputs, relays streamed chunks to the replica that took the stream, enforces every request's
deadline, and on failure aborts the request on every replica it touched so their connectors release
what they hold. Payloads never pass through here: only connector metadata, and the final output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from omni_mesh import codec
from omni_mesh.control import Abort, Chunk, Error, FailureKind, Message, Output, Work
from omni_mesh.coordinator.scheduling import events
from omni_mesh.coordinator.scheduling.failures import CLIENT_GONE, RequestFailed, stage_failure
from omni_mesh.coordinator.scheduling.large_inputs import LargeInputs
from omni_mesh.coordinator.scheduling.registry import Registry, Replica
from omni_mesh.coordinator.scheduling.request_state import RequestState
from omni_mesh.ingress import Ingress
from omni_mesh.logs import tame_request_id
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.coordinator")

__all__ = ["Dispatcher", "RequestFailed", "RequestState"]


class Dispatcher:
    def __init__(
        self,
        topology: Topology,
        registry: Registry,
        send: Callable[[Replica, Message], None],
        *,
        ingress: Ingress | None = None,
        observer: Callable[[RequestState, int], None] | None = None,
        rid_prefix: str = "",
    ) -> None:
        """`send` puts a message on a replica's control connection; `ingress` holds inputs too large
        for one (None: every request's inputs ride inline); `observer` is told of every request that
        ends, with its status (200 or the failure's): the metrics."""
        self.topology = topology
        self.rid_prefix = rid_prefix  # with several coordinators, ours ("c1."): ids unique in the mesh
        self.registry = registry
        self.send = send
        self.observer = observer
        self.inputs = LargeInputs(ingress, [s.name for s in topology.entry_stages])
        self.requests: dict[str, RequestState] = {}
        self.queues: dict[str, deque[tuple[str, Work]]] = {s.name: deque() for s in topology.stages}
        self.final_names = [s.name for s in topology.final_stages]
        self._inputs_of = {s.name: [topology.stage(e.src).name for e in topology.inputs_of(s.stage_id)] for s in topology.stages}
        self._outputs_of = {s.name: [topology.stage(e.dst).name for e in topology.outputs_of(s.stage_id)] for s in topology.stages}
        #: entry stage -> admitted requests whose large inputs are still going into the ingress
        #: connector (LargeInputs.hold): not queued yet, but they may be, so full_stage counts them.
        self.arriving = self.inputs.arriving
        self.completed = 0
        self.failed = 0

    # ------------------------------------------------------------------ intake

    def new_rid(self, wanted: str | None = None) -> str:
        """The client's request id (X-Request-Id) when it is usable as one, else a fresh one: it names
        the request in every log line and connector key, so it must be unique among running requests."""
        if wanted and tame_request_id(wanted) and self.rid_prefix + wanted not in self.requests:
            return self.rid_prefix + wanted
        return self.rid_prefix + uuid.uuid4().hex

    def submit(
        self,
        inputs: Any,
        params: dict,
        timeout_s: float,
        stream: bool,
        *,
        rid: str | None = None,
        inputs_refs: dict[str, dict] | None = None,
    ) -> RequestState:
        loop = asyncio.get_running_loop()
        state = RequestState(
            rid=rid or uuid.uuid4().hex,
            params=params,
            deadline=loop.time() + timeout_s,
            stream=stream,
            future=loop.create_future(),
            events=asyncio.Queue() if stream else None,
            large_inputs=inputs if inputs_refs else None,
        )
        self.requests[state.rid] = state
        for entry in self.topology.entry_stages:
            if inputs_refs:
                self._route(state, entry.name, inputs_ref=inputs_refs[entry.name])
            else:
                self._route(state, entry.name, inputs=inputs)
        return state

    # ------------------------------------------------------------------ routing

    def _route(self, state: RequestState, stage: str, **body: Any) -> None:
        message = Work(state.rid, stage, state.params, stream=state.stream, **body)
        state.work[stage] = message
        self._place(state, message)

    def _place(self, state: RequestState, message: Work) -> None:
        """Dispatch to a replica with a free slot, or queue until one frees up."""
        replica = self.registry.pick(message.stage)
        if replica is None:
            state.queued[message.stage] = time.perf_counter()
            self.queues[message.stage].append((state.rid, message))
        else:
            self._dispatch(state, replica, message)

    def _dispatch(self, state: RequestState, replica: Replica, message: Work) -> None:
        """Send the work; if that fails, the slot is released and only this request fails."""
        stage = message.stage
        now = time.perf_counter()
        state.timings.setdefault(stage, {})["queued_s"] = now - state.queued.pop(stage, now)
        message.remaining_s = max(0.0, state.deadline - asyncio.get_running_loop().time())
        replica.inflight.add(state.rid)
        state.at[stage] = replica.replica_id
        state.touched.add(replica.replica_id)
        try:
            self.send(replica, message)
            if message.stream_from:
                state.stream_targets[stage] = replica.replica_id
                for chunk in state.stream_buffer.pop(stage, []):
                    self._send_chunk(state, stage, replica, chunk)
        except Exception as exc:  # it never got the work: nothing to wait for it to stop
            log.exception("request %s: sending work to replica %s failed", state.rid, replica.replica_id)
            replica.inflight.discard(state.rid)
            self.fail(state, RequestFailed(500, f"could not send the request to stage {stage!r}: {exc}", stage))

    def _send_chunk(self, state: RequestState, dst: str, replica: Replica, chunk: Chunk) -> None:
        state.sent_chunks.setdefault(dst, []).append(chunk)
        self.send(replica, chunk)

    def full_stage(self) -> tuple[str, int] | None:
        """The first stage whose queue is at its limit (max_queued), and the limit: a new request is refused
        (429) then. Requests still putting their large inputs count as waiting, beyond the free slots they
        may take (`max_queued: 0` still takes a free slot). Admitted work may still push a queue past it."""
        for stage in self.topology.stages:
            replicas = self.registry.of_stage(stage.name)
            limit = stage.queue_limit(sum(replica.max_inflight for replica in replicas))
            free = sum(max(0, r.max_inflight - r.busy) for r in replicas if self.registry.is_healthy(r))
            waiting = len(self.queues[stage.name]) + max(0, self.arriving.get(stage.name, 0) + 1 - free)  # + the new one
            if waiting > limit:
                return stage.name, limit
        return None

    def drain_queue(self, stage: str) -> None:
        """Hand queued work of `stage` to replicas with free slots."""
        queue = self.queues[stage]
        while queue:
            replica = self.registry.pick(stage)
            if replica is None:
                return
            rid, message = queue.popleft()
            state = self.requests.get(rid)
            if state is not None:
                self._dispatch(state, replica, message)

    def drain_all(self) -> None:
        for stage in self.queues:
            self.drain_queue(stage)

    # ------------------------------------------------------------------ stage messages

    def on_output(self, replica: Replica, message: Output, frame: bytes | memoryview | None) -> None:
        stage, rid = message.stage, message.rid
        state = self.requests.get(rid)
        if state is None:
            # The request already ended (deadline, failure): let the replica free what it put.
            self.send(replica, Abort(rid, "request already ended"))
            return
        state.emitted.add(stage)
        streamed = message.end or not message.last
        for dst in self._outputs_of[stage]:
            item = message.edges.get(dst)
            if streamed:
                self._relay_chunk(state, stage, dst, item, message)
            elif item is not None:
                self._input_ready(state, stage, dst, [item], streamed=False)
        if frame is not None:
            self._final_output(state, stage, frame, streamed)
        if message.last and state.rid in self.requests:
            self._stage_done(state, replica, stage, message)

    def _relay_chunk(self, state: RequestState, src: str, dst: str, item: Any, message: Output) -> None:
        end = message.end
        if item is not None and not (isinstance(item, dict) and isinstance(item.get("key"), str)):
            self.fail(state, RequestFailed(502, f"stage {src!r} sent a malformed chunk for {dst!r}", src))
            return
        if len(self._inputs_of[dst]) > 1:
            # A fan-in stage gets a streamed input as the list of its chunks, once the stream ends.
            items = state.gathering.setdefault((dst, src), [])
            if end:
                self._input_ready(state, src, dst, state.gathering.pop((dst, src)), streamed=True)
            elif item is not None:
                items.append(item)
            return
        chunk = Chunk(
            state.rid, src, item["key"] if item else "", message.seq, last=end,
            meta=item.get("meta") if item else None, end=end,
        )
        if dst not in state.stream_targets:
            state.stream_targets[dst] = None
            state.stream_buffer[dst] = [chunk]
            self._route(state, dst, stream_from=src)
            return
        target = state.stream_targets[dst]
        replica = self.registry.replicas.get(target) if target else None
        if replica is None:
            state.stream_buffer.setdefault(dst, []).append(chunk)
            return
        try:
            self._send_chunk(state, dst, replica, chunk)
        except Exception as exc:  # e.g. control.MessageTooLarge: the request fails now, not at its deadline
            self.fail(state, RequestFailed(502, f"could not relay a chunk of stage {src!r} to stage {dst!r}: {exc}", src))

    def _input_ready(self, state: RequestState, src: str, dst: str, items: list, *, streamed: bool) -> None:
        gathered = state.gathered.setdefault(dst, {})
        gathered[src] = (items, streamed)
        if len(gathered) < len(self._inputs_of[dst]):
            return
        del state.gathered[dst]
        sources = {name: entry[0] for name, entry in gathered.items()}
        streamed_names = [name for name, entry in gathered.items() if entry[1]]
        self._route(state, dst, sources=sources, streamed=streamed_names)

    def _final_output(self, state: RequestState, stage: str, frame: bytes | memoryview, streamed: bool) -> None:
        try:
            value = codec.decode(frame, copy=True)
        except codec.FrameError as exc:
            self.fail(state, RequestFailed(502, f"stage {stage!r} sent an unreadable output: {exc}", stage))
            return
        if streamed:
            if state.first_chunk_s is None:
                state.first_chunk_s = time.perf_counter() - state.created
            state.chunks.setdefault(stage, []).append(value)
            if state.events is not None:
                state.events.put_nowait(events.Chunk(stage, value))
        else:
            state.outputs[stage] = value

    def _stage_done(self, state: RequestState, replica: Replica, stage: str, message: Output) -> None:
        replica.inflight.discard(state.rid)
        replica.full = False  # a slot of it is free now
        state.at.pop(stage, None)
        state.done.add(stage)
        state.timings.setdefault(stage, {}).update(message.timings)
        if stage in state.chunks or (message.end and stage in self.final_names):
            state.outputs[stage] = state.chunks.pop(stage, [])
        self.drain_queue(stage)
        if all(name in state.done for name in self.final_names) and not state.future.done():
            self._complete(state)

    def _complete(self, state: RequestState) -> None:
        self.requests.pop(state.rid, None)
        self._release_inputs(state)
        if len(self.final_names) == 1:
            outputs = state.outputs.get(self.final_names[0])
        else:
            outputs = {name: state.outputs.get(name) for name in self.final_names}
        self.completed += 1
        self._observe(state, 200)
        state.future.set_result(outputs)
        if state.events is not None:
            state.events.put_nowait(events.Done(outputs))

    def on_error(self, replica: Replica, message: Error) -> None:
        state = self.requests.get(message.rid)
        replica.inflight.discard(message.rid)
        if message.kind is FailureKind.REPLICA_FULL:
            self._refused(replica, state)
            return
        if state is not None:
            self.fail(state, stage_failure(replica.replica_id, message))
        self.drain_queue(replica.stage)

    # ------------------------------------------------------------------ failure

    def fail(self, state: RequestState, error: RequestFailed) -> None:
        """End a request with `error` and make every replica it touched let go of it."""
        if self.requests.pop(state.rid, None) is None:
            return
        self.failed += 1
        self._release_inputs(state)
        self._observe(state, error.status)
        log.warning("request %s failed with %d%s: %s", state.rid, error.status,
                    f" at stage {error.stage!r}" if error.stage else "", error.message, extra={"request_id": state.rid})
        for replica_id in state.touched:
            replica = self.registry.replicas.get(replica_id)
            if replica is not None:
                replica.stop(state.rid)  # busy until it has stopped computing for it (its heartbeat says)
                try:
                    self.send(replica, Abort(state.rid, error.message))
                except Exception:
                    log.exception("request %s: abort to replica %s failed", state.rid, replica_id)
        for stage in state.queued:
            self.queues[stage] = deque(item for item in self.queues[stage] if item[0] != state.rid)
        if not state.future.done():
            state.future.set_exception(error)
            state.future.exception()  # mark retrieved: a streaming client may never await it
        if state.events is not None:
            state.events.put_nowait(events.Failed(error))
        self.drain_all()

    def abandon(self, state: RequestState) -> None:
        """Its client went away: the request ends, and every stage lets go of it (a no-op once it ended)."""
        self.fail(state, RequestFailed(CLIENT_GONE, "the client went away", None))

    def expire(self) -> None:
        """Fail every request past its deadline, naming where it was."""
        now = asyncio.get_running_loop().time()
        for state in [s for s in self.requests.values() if s.deadline <= now]:
            stage = next(iter(state.at), None) or next(iter(state.queued), None)
            self.fail(state, RequestFailed(504, f"deadline exceeded while at {state.location()}", stage))

    def holds(self, replica_id: str) -> bool:
        """Whether a request still running took part of its work on `replica_id`: the outputs that
        replica put may not have been fetched yet, so a draining replica must not exit before."""
        return any(replica_id in state.touched for state in self.requests.values())

    def replica_lost(self, replica: Replica, reason: str) -> None:
        """A replica died or left. Work it held that had produced no output yet is retried once on
        another healthy replica; the rest fails now, naming the stage, rather than at its deadline."""
        stage = replica.stage
        others = any(r is not replica for r in self.registry.of_stage(stage) if self.registry.is_healthy(r))
        for rid in list(replica.inflight):
            state = self.requests.get(rid)
            if state is None:
                continue
            if others and stage not in state.emitted and stage not in state.retried and stage in state.work:
                log.warning("request %s: replica %s %s; retrying stage %r once", rid, replica.replica_id, reason, stage)
                self._retry(state, stage)
            else:
                message = f"stage {stage!r} replica {replica.replica_id!r} {reason} while handling the request"
                self.fail(state, RequestFailed(502, message, stage))
        replica.inflight.clear()

    def _refused(self, replica: Replica, state: RequestState | None) -> None:
        """The replica had no free slot (another coordinator's work took it): no failure. It is not
        picked until we hear from it again, and the work goes back to the head of its stage's queue."""
        replica.full = True
        stage = replica.stage
        if state is not None and state.at.get(stage) == replica.replica_id and stage in state.work:
            state.at.pop(stage, None)
            state.touched.discard(replica.replica_id)
            if state.work[stage].stream_from:  # the next replica needs the chunks this one was sent
                state.stream_buffer[stage] = state.sent_chunks.pop(stage, []) + state.stream_buffer.get(stage, [])
                state.stream_targets[stage] = None
            state.queued[stage] = time.perf_counter()
            self.queues[stage].appendleft((state.rid, state.work[stage]))
        self.drain_queue(stage)

    def _retry(self, state: RequestState, stage: str) -> None:
        state.retried.add(stage)
        state.at.pop(stage, None)
        message = dataclasses.replace(state.work[stage])
        if message.inputs_ref is not None:  # the first replica took the inputs: hold them again
            asyncio.get_running_loop().create_task(self._put_again_and_place(state, message))
            return
        if message.stream_from:  # the new replica needs the chunks the old one already had
            state.stream_buffer[stage] = state.sent_chunks.pop(stage, []) + state.stream_buffer.get(stage, [])
            state.stream_targets[stage] = None
        self._place(state, message)

    async def _put_again_and_place(self, state: RequestState, message: Work) -> None:
        try:
            message.inputs_ref = await self.inputs.hold_again(state.rid, message.stage, state.large_inputs)
        except RequestFailed as exc:
            self.fail(state, exc)
            return
        if state.rid in self.requests:
            state.work[message.stage] = message
            self._place(state, message)

    def _observe(self, state: RequestState, status: int) -> None:
        if self.observer is not None:
            try:
                self.observer(state, status)
            except Exception:  # metrics must never fail a request
                log.exception("request %s: recording metrics failed", state.rid)

    def _release_inputs(self, state: RequestState) -> None:
        if state.large_inputs is not None:
            self.inputs.release(state.rid)
