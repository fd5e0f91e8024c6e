"""The one way into the mesh, for `POST /v1/requests` and the OpenAI route alike.

A request is checked in this order, each refusal a RequestFailed naming what was wrong: its deadline
(422 over the coordinator's maximum), that its inputs and params can travel to a stage (422 naming
the field), its media parts (422 naming the message and part), the size of its params (413), then the queues (429 with Retry-After while a stage's
queue is at its limit). Then it gets its id and goes to the entry stages: inputs too large for a
control message go through the ingress connector first, counted against the queue limit meanwhile
(Dispatcher.arriving), so concurrent large requests cannot overshoot it.
"""

from __future__ import annotations

from typing import Any

import msgpack
from fastapi import Request

from omni_mesh.connectors import ConnectorError
from omni_mesh.coordinator.http.request_body import unpackable
from omni_mesh.coordinator.scheduling.dispatch import RequestState
from omni_mesh.coordinator.scheduling.failures import RequestFailed, inputs_not_held
from omni_mesh.coordinator.scheduling.media_check import check_media
from omni_mesh.coordinator.scheduling.service import Coordinator
from omni_mesh.ingress import INLINE_MAX_BYTES

#: Params travel in every stage's work message: they must stay small (large data goes in inputs).
MAX_PARAMS_BYTES = 256 * 1024
#: Retry-After of a 429: a queue drains at the pace of its stage, which we cannot promise; a second
#: spreads retries out without making a client wait long for a slot that frees soon.
RETRY_AFTER_S = 1


async def admit(
    coordinator: Coordinator,
    request: Request,
    inputs: dict[str, Any],
    params: dict[str, Any],
    *,
    timeout_s: float | None,
    stream: bool,
    messages: dict[str, str] | None = None,
) -> RequestState:
    """The admitted request (its id is the access log's: the client's X-Request-Id when usable), or
    RequestFailed saying why it was refused. `messages` maps the inputs that hold chat messages to the
    field an error names (default: `inputs.messages`): their media parts are checked
    (scheduling.media_check) before the request takes a place in a queue."""
    timeout_s = timeout_s or coordinator.default_timeout_s
    if timeout_s > coordinator.max_timeout_s:
        message = f"timeout_s: {timeout_s:g} s exceeds the maximum of {coordinator.max_timeout_s:g} s"
        raise RequestFailed(422, message, field="timeout_s")
    bad = unpackable(inputs, params)
    if bad is not None:
        raise RequestFailed(422, f"{bad[0]}: {bad[1]}", field=bad[0])
    inputs = await check_media(inputs, messages or {"messages": "inputs.messages"}, coordinator.media_limits)
    params_size = len(msgpack.packb(params))
    if params_size > MAX_PARAMS_BYTES:
        raise RequestFailed(
            413, f"params of {params_size} bytes exceed {MAX_PARAMS_BYTES}: put large data in inputs", field="params"
        )
    dispatcher = coordinator.dispatcher
    full = dispatcher.full_stage()
    if full is not None:
        stage, limit = full
        raise RequestFailed(
            429,
            f"stage {stage!r} has {limit} request(s) waiting for a free replica, its limit (max_queued); "
            "retry later, or add replicas",
            stage,
            headers={"retry-after": str(RETRY_AFTER_S)},
        )
    rid = dispatcher.new_rid(getattr(request.state, "request_id", None))
    if dispatcher.ingress is None or len(msgpack.packb(inputs)) <= INLINE_MAX_BYTES:
        return dispatcher.submit(inputs, params, timeout_s, stream, rid=rid)
    entries = [entry.name for entry in coordinator.topology.entry_stages]
    for name in entries:  # counted as waiting until submit() queues or dispatches it
        dispatcher.arriving[name] += 1
    try:
        refs = {}
        for name in entries:
            try:
                refs[name] = await dispatcher.ingress.put(rid, name, inputs)
            except ConnectorError as exc:  # nothing admitted yet: what is held goes with the rid
                dispatcher.ingress.release(rid)
                raise inputs_not_held(exc, name) from None
        return dispatcher.submit(inputs, params, timeout_s, stream, rid=rid, inputs_refs=refs)
    finally:
        for name in entries:
            dispatcher.arriving[name] -= 1
