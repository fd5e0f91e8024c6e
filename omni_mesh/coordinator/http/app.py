"""The coordinator's REST API (FastAPI), served by uvicorn in the same event loop as the control plane."""

from __future__ import annotations

import gc
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from omni_mesh import __version__
from omni_mesh.coordinator.http import docs, envelope
from omni_mesh.coordinator.http.access import AccessLog
from omni_mesh.coordinator.http.auth import ApiKey
from omni_mesh.coordinator.http.front_door import Answered
from omni_mesh.coordinator.http.hosts import LoopbackHosts, is_loopback
from omni_mesh.coordinator.http.limits import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    WRITE_TIMEOUT_S,
    BodyLimit,
    read_deadlines,
)
from omni_mesh.coordinator.http.memory import return_large_blocks
from omni_mesh.coordinator.http.routes import dashboard, requests, status
from omni_mesh.coordinator.http.stopping import serve_ending_requests_at_grace
from omni_mesh.coordinator.openai import routes as openai_routes
from omni_mesh.coordinator.scheduling.registry import HEARTBEAT_TIMEOUT_S
from omni_mesh.coordinator.scheduling.service import Coordinator
from omni_mesh.fdlimit import raise_nofile_limit
from omni_mesh.media.limits import MediaLimits
from omni_mesh.topology import Topology

log = logging.getLogger("omni_mesh.coordinator")

MAX_BODY_BYTES = 16 * 1024 * 1024


def create_app(
    coordinator: Coordinator,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    host: str | None = None,
) -> FastAPI:
    """The coordinator's app: its routers (http.routes and openai.routes), error envelope and middleware. `host`
    is the address it listens on: on loopback it answers only requests addressed to loopback."""

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
    metrics = coordinator.metrics
    app.include_router(requests.router(coordinator))  # /v1/requests
    app.include_router(status.router(coordinator, metrics))  # /health, /ready, /v1/stages, /metrics, ...
    app.include_router(openai_routes.router(coordinator))  # /v1/chat/completions, /v1/models
    app.include_router(dashboard.router())  # /dashboard

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)  # runs before any body is read
    if host is not None and is_loopback(host):
        app.add_middleware(LoopbackHosts)  # DNS rebinding: before the key, which is often unset there
    # outer: every answer is logged (and, with several coordinators, names ours)
    app.add_middleware(AccessLog, metrics=metrics, routes=app.routes, coordinator=coordinator.peers.coordinator_id)
    app.add_middleware(Answered)  # outermost: an answer's connection learns it is idle again (the cap)
    return app


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
    max_control_connections: int | None = None,
    max_rest_connections: int | None = None,
    write_timeout_s: float = WRITE_TIMEOUT_S,
    media_limits: MediaLimits | None = None,
    reuse_port: bool = False,
    own_port: int | None = None,
) -> None:
    """Run the coordinator until SIGINT/SIGTERM; in-flight requests get `grace_s` to finish.

    `reuse_port`: the REST port is shared with the mesh's other coordinators (SO_REUSEPORT: the kernel
    spreads new connections over them); `own_port`: a second REST port of this coordinator alone, for
    the launcher's readiness checks, watchdog and autoscaling poll."""
    fd_limit = raise_nofile_limit()
    return_large_blocks()  # a large answer's memory goes back to the system once it is sent
    coordinator = Coordinator(
        topology, control, default_timeout_s=default_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
        max_connections=max_control_connections, media_limits=media_limits,
    )
    app = create_app(coordinator, api_key=api_key, host=host)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=grace_s,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,  # the client closes an idle connection first (http_limits)
        # Past the cap (default half the descriptors) a new REST connection is answered 503 at once.
        http=read_deadlines(
            header_timeout_s, body_timeout_s, write_timeout_s,
            max_connections=max_rest_connections or max(64, fd_limit // 2),
        ),
        ws="none",  # no WebSocket routes: an upgrade request is answered as plain HTTP
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
    )
    # The app, its routes and models live as long as the process: frozen out of the cyclic collector
    # (as aio.run froze the imports), or each full collection walks them, a stall of tens of ms in
    # every stream under way (issue 40's p99).
    gc.collect()
    gc.freeze()
    server = uvicorn.Server(config)
    sockets = None  # one coordinator: uvicorn binds its port itself, as it always has
    if reuse_port or own_port is not None:
        sockets = [_listen(host, port, reuse_port), *([_listen(host, own_port, False)] if own_port else [])]
    coordinator.peers.ports.update({"rest": port, **({"own": own_port} if own_port is not None else {})})
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
        await serve_ending_requests_at_grace(server, coordinator.dispatcher, sockets)  # past the grace: 503s
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound REST socket, as uvicorn binds its own, and shared with other processes when `reuse_port`
    (only processes of the same user may join it: Linux checks)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
