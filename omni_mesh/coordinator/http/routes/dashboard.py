"""`GET /dashboard`: a live page of the mesh, drawn in the browser from the JSON routes.

The page, its script and its style hold no data, so they load without the API key (a browser cannot
send one for a page it navigates to); the script then reads everything through the API with the key
the user gives it (auth.OPEN_PATHS). A strict Content-Security-Policy runs only this origin's script,
none inline, so a value the page shows can never run as code even if it got into the markup.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

_HERE = Path(__file__).parent.parent
#: path -> (file, media type)
ASSETS = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def router() -> APIRouter:
    routes = APIRouter()
    for path, (name, media_type) in ASSETS.items():
        summary = "live page: topology graph, health, throughput" if path == "/dashboard" else f"the page's {name}"
        routes.add_api_route(
            path, _asset((_HERE / name).read_bytes(), media_type), methods=["GET"], summary=summary,
            response_class=Response, include_in_schema=path == "/dashboard",
        )
    return routes


def _asset(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return asset
