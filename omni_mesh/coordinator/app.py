"""The coordinator's REST API (FastAPI), served by uvicorn in the same event loop as the control plane."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omni_mesh.coordinator.dispatch import RequestFailed, RequestState
from omni_mesh.coordinator.jsonable import jsonable
from omni_mesh.coordinator.service import Coordinator
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.coordinator")

MAX_BODY_BYTES = 16 * 1024 * 1024
CLIENT_GONE = 499


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: dict[str, Any] = Field(default_factory=dict, description="the entry stages' inputs")
    params: dict[str, Any] = Field(default_factory=dict, description="passed to every handler as ctx.params")
    timeout_s: float | None = Field(default=None, gt=0, description="deadline; the coordinator's default if unset")
    stream: bool = Field(default=False, description="answer with server-sent events as the final stage streams")


def _error(status: int, message: str, stage: str | None = None, rid: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message, "stage": stage, "request_id": rid})


class BodyLimit:
    """Answer 413 to request bodies over `limit` bytes, declared or streamed, before anything parses them."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        messages, total = [], 0
        while True:
            message = await receive()
            messages.append(message)
            total += len(message.get("body", b""))
            if total > self.limit:
                await self._too_large(scope, receive, send)
                return
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        replay = iter(messages)

        async def replayed() -> dict:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable) -> None:
        response = _error(413, f"request body exceeds {self.limit} bytes")
        await response(scope, receive, send)


def create_app(coordinator: Coordinator, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await coordinator.start()
        try:
            yield
        finally:
            await coordinator.stop()

    app = FastAPI(title="omni-mesh coordinator", version="0.1.0", lifespan=lifespan)
    dispatcher = coordinator.dispatcher
    registry = coordinator.registry

    @app.post("/v1/requests", summary="run one request through the pipeline")
    async def submit(body: RequestBody) -> Any:
        timeout_s = body.timeout_s or coordinator.default_timeout_s
        if timeout_s > coordinator.max_timeout_s:
            return _error(422, f"timeout_s {timeout_s} exceeds the maximum of {coordinator.max_timeout_s}")
        state = dispatcher.submit(body.inputs, body.params, timeout_s, body.stream)
        if body.stream:
            return StreamingResponse(_events(state), media_type="text/event-stream")
        try:
            outputs = await state.future
        except RequestFailed as exc:
            return _error(exc.status, exc.message, exc.stage, state.rid)
        except asyncio.CancelledError:
            dispatcher.fail(state, RequestFailed(CLIENT_GONE, "the client went away", None))
            raise
        return _result(state, outputs)

    def _result(state: RequestState, outputs: Any) -> dict:
        return {
            "request_id": state.rid,
            "outputs": jsonable(outputs),
            "timings": state.timings,
            "latency_s": time.perf_counter() - state.created,
        }

    async def _events(state: RequestState) -> AsyncIterator[str]:
        assert state.events is not None
        try:
            while True:
                kind, stage, value = await state.events.get()
                if kind == "chunk":
                    yield _sse("chunk", {"request_id": state.rid, "stage": stage, "output": jsonable(value)})
                elif kind == "done":
                    yield _sse("done", _result(state, value))
                    return
                else:
                    yield _sse("error", {"request_id": state.rid, "stage": stage, "status": value.status, "error": value.message})
                    return
        finally:
            if state.rid in dispatcher.requests:
                dispatcher.fail(state, RequestFailed(CLIENT_GONE, "the client went away", None))

    @app.get("/health", summary="200 while the coordinator runs")
    async def health() -> dict:
        return {
            "status": "ok",
            "requests_inflight": len(dispatcher.requests),
            "completed": dispatcher.completed,
            "failed": dispatcher.failed,
            "malformed_messages": coordinator.malformed,
        }

    @app.get("/ready", summary="200 when every stage and edge can work, else 503 saying what is missing")
    async def ready() -> JSONResponse:
        missing = registry.readiness()
        if missing:
            return JSONResponse(status_code=503, content={"ready": False, "missing": missing})
        return JSONResponse(content={"ready": True, "missing": []})

    @app.get("/v1/topology", summary="stages, edges and the connector of each edge")
    async def topology() -> dict:
        return coordinator.topology.to_dict()

    @app.get("/v1/stages", summary="each stage's replicas with health, in-flight work and counters")
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

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    return app


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def serve(
    topology: Topology,
    *,
    host: str = "0.0.0.0",
    port: int = 8000,
    control: str = "tcp://0.0.0.0:5555",
    default_timeout_s: float = 30.0,
    heartbeat_timeout_s: float = 5.0,
    grace_s: float = 10.0,
) -> None:
    """Run the coordinator until SIGINT/SIGTERM; in-flight requests get `grace_s` to finish."""
    coordinator = Coordinator(
        topology, control, default_timeout_s=default_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s
    )
    app = create_app(coordinator)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_s, access_log=False
    )
    server = uvicorn.Server(config)
    log.info("coordinator for topology %r on http://%s:%d", topology.name, host, port)
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
