"""The REST API key: `Authorization: Bearer <key>` on every route but the health check and the dashboard's
page (auth.OPEN_PATHS)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from omni_mesh.coordinator.http.envelope import error_response

ENV_API_KEY = "OMNI_MESH_API_KEY"

#: Routes open without credentials: the health check a container runtime or load balancer probes
#: (it says nothing but "ok"), and the dashboard's page and assets, which hold no data (the page
#: asks the API for it with the key).
OPEN_PATHS = frozenset({"/health", "/dashboard", "/dashboard.js", "/dashboard.css"})


class ApiKey:
    """ASGI middleware: 401 (with `WWW-Authenticate: Bearer`) unless the request carries the key.

    It runs before anything reads the body, so a client without the key costs no parsing."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str) -> None:
        if not key:
            raise ValueError("an empty API key would admit everyone; pass none to run without one")
        self.app = app
        self._expected = b"bearer " + key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._admits(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            "missing or wrong API key: send the header `Authorization: Bearer <key>` "
            f"(the key the coordinator was given with --api-key or {ENV_API_KEY})",
            headers={"www-authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _admits(self, scope: dict) -> bool:
        sent = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = sent.partition(b" ")
        # The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
        return hmac.compare_digest(scheme.lower() + b" " + token.strip(), self._expected)
