"""The one way into the mesh, for `POST /v1/requests` and the OpenAI route alike.

A request is checked in this order, each refusal a RequestFailed naming what was wrong: its deadline
(422 over the coordinator's maximum), that its inputs and params can travel to a stage (422 naming
the field), its media parts (422 naming the message and part), the size of its params (413), then the queues (429 with Retry-After while a stage's
queue is at its limit). Then it gets its id and goes to the entry stages: inputs too large for a
control message go through the ingress connector first (scheduling.large_inputs), counted against
the queue limit meanwhile, so concurrent large requests cannot overshoot it.
"""

from __future__ import annotations

from typing import Any

import msgpack

from omni_mesh.coordinator.scheduling.dispatch import RequestState
from omni_mesh.coordinator.scheduling.failures import RequestFailed
from omni_mesh.coordinator.scheduling.media_check import check_media
from omni_mesh.coordinator.scheduling.packable import unpackable
from omni_mesh.coordinator.scheduling.service import Coordinator

#: Params travel in every stage's work message: they must stay small (large data goes in inputs).
MAX_PARAMS_BYTES = 256 * 1024
#: Retry-After of a 429: a queue drains at the pace of its stage, which we cannot promise; a second
#: spreads retries out without making a client wait long for a slot that frees soon.
RETRY_AFTER_S = 1


async def admit(
    coordinator: Coordinator,
    inputs: dict[str, Any],
    params: dict[str, Any],
    *,
    request_id: str | None,
    timeout_s: float | None,
    stream: bool,
    messages: dict[str, str] | None = None,
) -> RequestState:
    """The admitted request (named `request_id`, the access log's, when that is free), or
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
    rid = dispatcher.new_rid(request_id)
    if dispatcher.inputs.inline(inputs):
        return dispatcher.submit(inputs, params, timeout_s, stream, rid=rid)
    refs = await dispatcher.inputs.hold(rid, inputs)
    return dispatcher.submit(inputs, params, timeout_s, stream, rid=rid, inputs_refs=refs)
