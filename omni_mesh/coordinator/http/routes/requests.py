"""`POST /v1/requests`: one request through the pipeline, answered whole or as server-sent events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omni_mesh.coordinator.http.client_gone import ClientGone, unless_client_leaves
from omni_mesh.coordinator.http.envelope import error_response, responses
from omni_mesh.coordinator.http.json_body import json_answer
from omni_mesh.coordinator.http.jsonable import jsonable
from omni_mesh.coordinator.http.request_body import RequestBody
from omni_mesh.coordinator.http.sse import sse
from omni_mesh.coordinator.scheduling import events
from omni_mesh.coordinator.scheduling.admission import admit
from omni_mesh.coordinator.scheduling.dispatch import RequestState
from omni_mesh.coordinator.scheduling.failures import CLIENT_GONE, RequestFailed
from omni_mesh.coordinator.scheduling.service import Coordinator


def failure_response(exc: RequestFailed, rid: str | None = None) -> JSONResponse:
    return error_response(exc.status, exc.message, stage=exc.stage, rid=rid, field=exc.field, headers=exc.headers)


def router(coordinator: Coordinator) -> APIRouter:
    routes = APIRouter()
    dispatcher = coordinator.dispatcher

    @routes.post(
        "/v1/requests",
        summary="run one request through the pipeline",
        responses=responses(401, 413, 422, 429, 500, 502, 504),
    )
    async def submit(body: RequestBody, request: Request) -> Any:
        try:
            state = await admit(
                coordinator, body.inputs, body.params, request_id=getattr(request.state, "request_id", None),
                timeout_s=body.timeout_s, stream=body.stream,
            )
        except RequestFailed as exc:
            return failure_response(exc)
        if body.stream:
            return StreamingResponse(_events(state), media_type="text/event-stream")
        try:
            outputs = await unless_client_leaves(request, state.future)
        except RequestFailed as exc:
            return failure_response(exc, state.rid)
        except (asyncio.CancelledError, ClientGone) as exc:
            dispatcher.abandon(state)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return Response(status_code=CLIENT_GONE)  # nobody reads it: for the access log
        return json_answer({**_summary(state), "outputs": outputs})  # a large answer is encoded as it is sent

    finals = [stage.name for stage in coordinator.topology.final_stages]

    async def _events(state: RequestState) -> AsyncIterator[str]:
        assert state.events is not None
        streamed: set[str] = set()
        try:
            while True:
                # A suspension at every event: with a backlog queued, get() and a send to a client
                # that is gone never wait, so its disconnect (a cancel) would land only at the end.
                await asyncio.sleep(0)
                event = await state.events.get()
                if isinstance(event, events.Chunk):
                    streamed.add(event.stage)
                    yield sse({"request_id": state.rid, "stage": event.stage, "output": jsonable(event.value)}, "chunk")
                elif isinstance(event, events.Done):
                    yield sse({**_summary(state), **_unstreamed(finals, streamed, event.outputs)}, "done")
                    return
                else:
                    error = event.error
                    body = {"request_id": state.rid, "stage": error.stage, "status": error.status, "error": error.message}
                    yield sse(body, "error")
                    return
        finally:
            dispatcher.abandon(state)  # a no-op once the request ended

    return routes


def _unstreamed(finals: list[str], streamed: set[str], outputs: Any) -> dict[str, Any]:
    """`outputs` of a streamed request less what its chunks carried: a final stage that streamed is not
    repeated in `done` (its audio was sent twice); one that answered once is only there. Empty: no key."""
    if len(finals) == 1:
        return {} if finals[0] in streamed else {"outputs": jsonable(outputs)}
    rest = {name: value for name, value in (outputs or {}).items() if name not in streamed}
    return {"outputs": jsonable(rest)} if rest else {}


def _summary(state: RequestState) -> dict[str, Any]:
    return {"request_id": state.rid, "timings": state.timings, "latency_s": time.perf_counter() - state.created}
