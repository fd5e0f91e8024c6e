"""The coordinator's REST API (FastAPI), served by uvicorn in the same event loop as the control plane."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from omni_mesh import __version__
from omni_mesh.coordinator import docs, envelope
from omni_mesh.coordinator.access import AccessLog
from omni_mesh.coordinator.auth import ApiKey
from omni_mesh.coordinator.client_gone import ClientGone, unless_client_leaves
from omni_mesh.coordinator.dispatch import RequestFailed, RequestState
from omni_mesh.coordinator.envelope import error_response, responses
from omni_mesh.coordinator.http_limits import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    WRITE_TIMEOUT_S,
    BodyLimit,
    read_deadlines,
)
from omni_mesh.coordinator.json_body import json_answer
from omni_mesh.coordinator.jsonable import jsonable
from omni_mesh.coordinator.memory import return_large_blocks
from omni_mesh.coordinator.metrics import CONTENT_TYPE_LATEST, Metrics, stats
from omni_mesh.coordinator.openai_api import openai_router
from omni_mesh.coordinator.registry import HEARTBEAT_TIMEOUT_S
from omni_mesh.coordinator.request_body import RequestBody, unpackable
from omni_mesh.coordinator.service import Coordinator
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.coordinator")

MAX_BODY_BYTES = 16 * 1024 * 1024
CLIENT_GONE = 499
#: Retry-After of a 429: a queue drains at the pace of its stage, which we cannot promise; a second
#: spreads retries out without making a client wait long for a slot that frees soon.
RETRY_AFTER_S = 1


class ReadyBody(BaseModel):
    ready: bool
    mesh: str = Field(description="the topology's name")
    instance: str = Field(description="this coordinator's instance id (OMNI_MESH_INSTANCE, or made at start)")
    missing: list[str] = Field(description="what keeps the mesh from serving: stages without a healthy replica, edges")
    error: str | None = Field(default=None, description="when not ready: the same, in one sentence")
    stage: str | None = None
    request_id: str | None = None


def create_app(
    coordinator: Coordinator, *, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await coordinator.start()
        try:
            yield
        finally:
            await coordinator.stop()

    app = FastAPI(
        title="omni-mesh coordinator", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    envelope.install(app)
    docs.install(app)  # /docs and /redoc with local assets: no CDN
    dispatcher = coordinator.dispatcher
    registry = coordinator.registry
    metrics = Metrics(coordinator)
    dispatcher.observer = metrics.observe_request

    @app.post(
        "/v1/requests",
        summary="run one request through the pipeline",
        responses=responses(401, 413, 422, 429, 500, 502, 504),
    )
    async def submit(body: RequestBody, request: Request) -> Any:
        timeout_s = body.timeout_s or coordinator.default_timeout_s
        if timeout_s > coordinator.max_timeout_s:
            return error_response(
                422, f"timeout_s: {timeout_s:g} s exceeds the maximum of {coordinator.max_timeout_s:g} s",
                field="timeout_s",
            )
        bad = unpackable(body.inputs, body.params)
        if bad is not None:
            return error_response(422, f"{bad[0]}: {bad[1]}", field=bad[0])
        full = _full_stage()
        if full is not None:
            stage, limit = full
            return error_response(
                429,
                f"stage {stage!r} has {limit} request(s) waiting for a free replica, its limit "
                "(max_queued); retry later, or add replicas",
                stage=stage,
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        try:  # inputs too large for a control message go to the entry stages through a connector
            state = await dispatcher.admit(
                body.inputs, body.params, timeout_s, body.stream, rid=request.state.request_id
            )
        except RequestFailed as exc:
            return error_response(exc.status, exc.message, stage=exc.stage)
        if body.stream:
            return StreamingResponse(_events(state), media_type="text/event-stream")
        try:
            outputs = await unless_client_leaves(request, state.future)
        except RequestFailed as exc:
            return error_response(exc.status, exc.message, stage=exc.stage, rid=state.rid)
        except (asyncio.CancelledError, ClientGone) as exc:
            # every stage still working on it lets go of it (its handler is cancelled there)
            dispatcher.fail(state, RequestFailed(CLIENT_GONE, "the client went away", None))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return Response(status_code=CLIENT_GONE)  # nobody reads it: for the access log
        return json_answer(_result(state, outputs))  # a large answer is encoded as it is sent

    def _full_stage() -> tuple[str, int] | None:
        """The first stage whose queue is at its limit, and the limit. Work of requests already
        admitted may still push a queue past it: they are never refused midway."""
        for stage in coordinator.topology.stages:
            running = sum(replica.max_inflight for replica in registry.of_stage(stage.name))
            limit = stage.queue_limit(running)
            if len(dispatcher.queues[stage.name]) >= limit:
                return stage.name, limit
        return None

    def _result(state: RequestState, outputs: Any) -> dict:
        return {
            "request_id": state.rid,
            "outputs": outputs,  # as the stage made them: json_answer and _sse convert them
            "timings": state.timings,
            "latency_s": time.perf_counter() - state.created,
        }

    async def _events(state: RequestState) -> AsyncIterator[str]:
        assert state.events is not None
        try:
            while True:
                # A suspension at every event: with a backlog queued, get() and a send to a client
                # that is gone never wait, so its disconnect (a cancel) would land only at the end.
                await asyncio.sleep(0)
                kind, stage, value = await state.events.get()
                if kind == "chunk":
                    yield _sse("chunk", {"request_id": state.rid, "stage": stage, "output": jsonable(value)})
                elif kind == "done":
                    yield _sse("done", jsonable(_result(state, value)))
                    return
                else:
                    yield _sse("error", {"request_id": state.rid, "stage": stage, "status": value.status, "error": value.message})
                    return
        finally:
            if state.rid in dispatcher.requests:
                dispatcher.fail(state, RequestFailed(CLIENT_GONE, "the client went away", None))

    @app.get("/health", summary="200 while the coordinator runs (no API key needed)")
    async def health() -> dict:
        return {
            "status": "ok",
            "requests_inflight": len(dispatcher.requests),
            "completed": dispatcher.completed,
            "failed": dispatcher.failed,
            "malformed_messages": coordinator.malformed,
            "refused_peers": coordinator.refused_peers.count,  # handshakes without this mesh's keys
            "forged_messages": coordinator.forged.count,  # sent in another connection's replica's name
            "ingress": dispatcher.ingress.health() if dispatcher.ingress else None,
        }

    @app.get(
        "/ready",
        summary="200 when every stage and edge can work, else 503 saying what is missing",
        responses={**responses(401), 503: {"model": ReadyBody, "description": envelope.MEANINGS[503]}},
    )
    async def ready() -> JSONResponse:
        missing = registry.readiness()
        mesh = {"mesh": coordinator.topology.name, "instance": coordinator.instance}
        if missing:
            error = f"not ready: {'; '.join(missing)}"
            body = ReadyBody(ready=False, missing=missing, error=error, **mesh)
            return JSONResponse(status_code=503, content=body.model_dump())
        return JSONResponse(content={"ready": True, "missing": [], **mesh})

    @app.get("/v1/topology", summary="stages, edges and the connector of each edge", responses=responses(401))
    async def topology() -> dict:
        return coordinator.topology.to_dict()

    @app.get(
        "/v1/stages",
        summary="each stage's replicas with health, in-flight work and counters",
        responses=responses(401),
    )
    async def stages() -> dict:
        now = time.monotonic()
        return {
            "stages": [
                {
                    "stage_id": stage.stage_id,
                    "name": stage.name,
                    "queued": len(dispatcher.queues[stage.name]),
                    "replicas": [
                        r.describe(now, registry.heartbeat_timeout_s) for r in registry.of_stage(stage.name)
                    ],
                }
                for stage in coordinator.topology.stages
            ]
        }

    app.include_router(openai_router(coordinator))  # /v1/chat/completions, /v1/models

    @app.get("/metrics", summary="Prometheus metrics (omni_mesh_*)", response_class=Response, responses=responses(401))
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats", summary="live totals behind /dashboard and `omni-mesh status`", responses=responses(401))
    async def live_stats() -> dict:
        return stats(coordinator, metrics)

    @app.get("/dashboard", summary="live page: topology graph, health, throughput", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_DASHBOARD)

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)  # runs before any body is read
    app.add_middleware(AccessLog, metrics=metrics)  # added last: outermost, so every answer is logged
    return app


_DASHBOARD = (Path(__file__).with_name("dashboard.html")).read_text()


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def serve(
    topology: Topology,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    control: str = "tcp://127.0.0.1:5555",
    default_timeout_s: float = 30.0,
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    grace_s: float = 10.0,
    api_key: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
    write_timeout_s: float = WRITE_TIMEOUT_S,
) -> None:
    """Run the coordinator until SIGINT/SIGTERM; in-flight requests get `grace_s` to finish."""
    return_large_blocks()  # a large answer's memory goes back to the system once it is sent
    coordinator = Coordinator(
        topology, control, default_timeout_s=default_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s
    )
    app = create_app(coordinator, api_key=api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=grace_s,
        access_log=False,
        http=read_deadlines(header_timeout_s, body_timeout_s, write_timeout_s),
        ws="none",  # no WebSocket routes: an upgrade request is answered as plain HTTP
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
    )
    server = uvicorn.Server(config)
    scheme = "https" if ssl_certfile else "http"
    log.info(
        "coordinator for topology %r on %s://%s:%d (API key %s)",
        topology.name, scheme, host, port, "required" if api_key else "not set: every client is admitted",
    )
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully, so SIGTERM (a
    # container stop, `omni-mesh up` shutting down) would end the process with status 143 after a
    # clean shutdown. Catch that re-raised SIGTERM: a graceful stop exits 0, like a stage replica's.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main_thread else None
    try:
        await server.serve()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
