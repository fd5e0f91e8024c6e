"""DNS rebinding guard: a coordinator listening on loopback answers only requests addressed to loopback.

A web page can make a browser on the same machine send requests to 127.0.0.1 by pointing a name it
controls there (DNS rebinding): the browser then sees that name as the page's own origin and reads
the answers. Such a request still carries the attacker's name in its Host header. So when the
coordinator listens on a loopback address (the default, where it often runs without an API key) it
answers 421 to a Host that is not localhost, 127.0.0.1 or [::1] (with or without a port).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

from omni_mesh.coordinator.http.envelope import error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether a listen address is loopback only (`0.0.0.0`, `::` and other addresses are not)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _name(host: bytes) -> str:
    """The name in a Host header value, without its port: `[::1]:8000` -> `[::1]`, `a:80` -> `a`."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class LoopbackHosts:
    """ASGI middleware: 421 unless the Host header names loopback (a request without one passes: no
    browser sends such a request)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            host = next((value for name, value in scope["headers"] if name == b"host"), None)
            if host is not None and _name(host) not in LOOPBACK_NAMES:
                shown = host.decode("latin-1")[:100]
                response = error_response(
                    421,
                    f"Host {shown!r} is not this coordinator's: it listens on loopback and answers requests for "
                    "localhost, 127.0.0.1 or [::1] only (a guard against DNS rebinding; bind another "
                    "address with --host to serve other names)",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
