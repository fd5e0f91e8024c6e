"""The one error envelope every REST error answers with: `{"error", "stage", "request_id", "field"}`.

FastAPI's own 422 (`{"detail": [...]}`), Starlette's 404/405 and unhandled exceptions are all turned
into it here. A message names the field (`inputs.p`, `params.a[3].b`) but never echoes the value that
was sent: that value may not be serialisable at all (NaN, a lone surrogate), and it may be large.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from omni_mesh.coordinator.scheduling.packable import field_path

log = logging.getLogger("omni_mesh.coordinator")


#: What each error status means on our routes (the OpenAPI document lists them).
MEANINGS: dict[int, str] = {
    401: "missing or wrong API key, when the coordinator has one (send `Authorization: Bearer <key>`)",
    404: "no such stage (the error names the stages there are)",
    408: "the request's headers or body did not arrive in time",
    409: "the stage's replicas are not set by hand here (autoscaled, or no `omni-mesh up` runs them)",
    413: "request body too large",
    421: "the Host header names another server (a coordinator on loopback answers loopback names only)",
    422: "invalid request; `field` names what to fix",
    429: "a stage's queue is full; retry after `Retry-After` seconds",
    500: "a stage handler failed (`stage` names it), or the coordinator did",
    502: "a stage replica died or sent something unreadable",
    503: "the mesh is not ready, or a connector's memory (shared memory) is full: retry after `Retry-After` seconds",
    504: "the request's deadline passed (`error` says where it was)",
}


class ErrorBody(BaseModel):
    """The body of every error answer."""

    error: str = Field(description="what went wrong, and what to do about it")
    stage: str | None = Field(default=None, description="the stage involved, if any")
    request_id: str | None = Field(default=None, description="the request's id, once it had one")
    field: str | None = Field(default=None, description="the request field at fault (422), e.g. inputs.p")


def error_response(
    status: int,
    message: str,
    *,
    stage: str | None = None,
    rid: str | None = None,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorBody(error=message, stage=stage, request_id=rid, field=field)
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers)


def error_bytes(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 error answer that closes the connection, for code below the ASGI app."""
    body = json.dumps(ErrorBody(error=message).model_dump()).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: each error status with ErrorBody as its model."""
    return {status: {"model": ErrorBody, "description": MEANINGS[status]} for status in statuses}


def _validation_message(error: dict[str, Any]) -> tuple[str | None, str]:
    """(field, message) for one of pydantic's errors, with no part of the input in it."""
    loc: Sequence[str | int] = error.get("loc", ())
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = error.get("type", "")
    if kind == "json_invalid":
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        reason = (error.get("ctx") or {}).get("error", "")
        return None, f"the request body is not valid JSON{where}: {reason}".rstrip(": ")
    if kind == "missing" and not loc:
        return None, "the request needs a JSON body, e.g. {\"inputs\": {...}}"
    if kind == "model_attributes_type" and not loc:
        return None, "the request body must be a JSON object (send content-type: application/json)"
    field = field_path(loc) or None
    message = str(error.get("msg", "invalid value"))
    if kind == "extra_forbidden":
        message = "unknown field; the fields are inputs, params, timeout_s and stream"
    elif kind == "string_unicode":
        message = "not valid Unicode text"
    return field, f"{field}: {message}" if field else message


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    field, message = _validation_message(errors[0]) if errors else (None, "invalid request")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(422, message, field=field)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body": an integer of more digits than Python
        # converts, or JSON nested deeper than its parser goes. Bad input, like any other: 422.
        cause = exc.__cause__
        reason = "nested too deeply" if isinstance(cause, RecursionError) else str(cause).split(";")[0][:200]
        return error_response(422, f"the request body could not be parsed as JSON: {reason}")
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    if exc.status_code == 404:
        message = f"no route {request.url.path}; see /docs for the API"
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback itself once this answer is sent.
    return error_response(500, f"internal error in the coordinator ({type(exc).__name__}); see its log")


def install(app: FastAPI) -> None:
    """Answer every error of `app` with ErrorBody."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
