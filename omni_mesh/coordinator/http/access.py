"""The coordinator's access log, request ids and HTTP metrics, as one ASGI middleware.

Every response carries `X-Request-Id`: the client's (when it is a tame token) or a new one. The id is
put in `request.state.request_id` (the pipeline request takes it as its own id, so it follows the
request into every stage's log lines) and in the logging context, so every line logged while the
request is handled names it. One access-log line per request: method, path, status, latency, id.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.routing import BaseRoute, Match

from omni_mesh import logs
from omni_mesh.coordinator.scheduling.metrics import Metrics

log = logging.getLogger("omni_mesh.access")
POLLER = b"omni-mesh-autoscale"  # the User-Agent of `up`'s poll of the autoscaling targets

HEADER = b"x-request-id"

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


def request_id_of(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", ()):
        if name == HEADER and logs.tame_request_id(value.decode("latin-1")):
            return value.decode()
    return uuid.uuid4().hex


def route_label(scope: dict[str, Any], routes: list[BaseRoute], path: str, root_path: str) -> str:
    """The template of the route that answered, never the raw path: unknown paths must not mint label
    values. FastAPI's own routes (its APIRoutes) leave `scope["route"]`; the plain Starlette ones it
    serves too (/openapi.json, the /docs-assets mount) do not, so those are matched here again."""
    template = getattr(scope.get("route"), "path", None)
    if template:
        return template
    probe = {"type": "http", "path": path, "root_path": root_path, "method": scope["method"]}
    for route in routes:
        if route.matches(probe)[0] is Match.FULL:
            return getattr(route, "path", None) or "unmatched"
    return "unmatched"


class AccessLog:
    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics | None = None,
        routes: list[BaseRoute] | None = None,
        coordinator: str | None = None,
    ) -> None:
        self.app = app
        # With several coordinators, every answer names the one that served it (X-Omni-Coordinator).
        self.named = [(b"x-omni-coordinator", coordinator.encode())] if coordinator else []
        self.metrics = metrics
        self.routes = routes if routes is not None else []  # the app's, live: routes added later count

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = rid
        token = logs.request_id.set(rid)
        started = time.perf_counter()
        path, root_path = scope["path"], scope.get("root_path", "")  # before a mount rewrites them
        status = 500  # what the client gets if the app raises before answering

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode()), *self.named]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            if self.metrics is not None:
                label = route_label(scope, self.routes, path, root_path)
                self.metrics.observe_http(label, scope["method"], status, elapsed)
            # `up`'s watchdog and container probes ask /health every few seconds: their answers are noise
            # and so is `up`'s autoscaling poll of /v1/stages (twice a second, launcher_scale.POLLER);
            # /ready is polled five times a second while the stages load (`up`) and by readiness probes:
            # its 503s then are the normal course (the stages' own lines say what they do).
            poll = scope["path"] == "/v1/stages" and (b"user-agent", POLLER) in scope.get("headers", ())
            quiet = ((scope["path"] == "/health" or poll) and status == 200) or scope["path"] == "/ready"
            (log.debug if quiet else log.info)("%s %s %d %.1f ms", scope["method"], scope["path"], status, elapsed * 1000)
            logs.request_id.reset(token)
