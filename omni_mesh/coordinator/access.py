"""The coordinator's access log, request ids and HTTP metrics, as one ASGI middleware.

Every response carries `X-Request-Id`: the client's (when it is a tame token) or a new one. The id is
put in `request.state.request_id` (the pipeline request takes it as its own id, so it follows the
request into every stage's log lines) and in the logging context, so every line logged while the
request is handled names it. One access-log line per request: method, path, status, latency, id.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from omni_mesh import logs
from omni_mesh.coordinator.metrics import Metrics

log = logging.getLogger("omni_mesh.access")

HEADER = b"x-request-id"
_TAME = re.compile(rb"[A-Za-z0-9._:-]{1,64}")

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


def request_id_of(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", ()):
        if name == HEADER and _TAME.fullmatch(value):
            return value.decode()
    return uuid.uuid4().hex


class AccessLog:
    def __init__(self, app: ASGIApp, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = rid
        token = logs.request_id.set(rid)
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            # The route's template, never the raw path: unknown paths must not mint label values.
            label = getattr(route, "path", None) or "unmatched"
            if self.metrics is not None:
                self.metrics.observe_http(label, scope["method"], status, elapsed)
            # `up`'s watchdog and container probes ask /health every few seconds: their answers are noise
            quiet = scope["path"] == "/health" and status == 200
            (log.debug if quiet else log.info)("%s %s %d %.1f ms", scope["method"], scope["path"], status, elapsed * 1000)
            logs.request_id.reset(token)
