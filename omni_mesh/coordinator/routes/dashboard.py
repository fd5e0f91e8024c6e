"""`GET /dashboard`: a live page of the mesh, drawn in the browser from the JSON routes."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

_PAGE = (Path(__file__).parent.parent / "dashboard.html").read_text()


def router() -> APIRouter:
    routes = APIRouter()

    @routes.get("/dashboard", summary="live page: topology graph, health, throughput", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_PAGE)

    return routes
