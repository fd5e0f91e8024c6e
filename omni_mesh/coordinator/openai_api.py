"""OpenAI-compatible serving: `POST /v1/chat/completions` and `GET /v1/models`.

The topology's `openai:` section (omni_mesh.openai_section) names the model, how a chat request
becomes the pipeline's inputs, and which final-stage fields hold the reply's text, audio and token
counts. Every request reads the final stages' stream (`stream: true` to the dispatcher), so a stream
of `chat.completion.chunk` events carries each text and audio piece as soon as a final stage emits
it; a non-streaming answer is the same pieces joined. Errors on these routes are OpenAI's error
object, `{"error": {"message", "type", "param", "code"}}`; the app's middleware (API key, body limit)
applies here as on every other route.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from omni_mesh.coordinator.client_gone import ClientGone, unless_client_leaves
from omni_mesh.coordinator.dispatch import RequestFailed, RequestState
from omni_mesh.coordinator.envelope import field_path, responses
from omni_mesh.coordinator.openai_audio import encode
from omni_mesh.coordinator.openai_reply import Piece, Reply, ReplyError
from omni_mesh.coordinator.openai_request import ChatCall, ChatRequest, ChatRequestError, chat_call
from omni_mesh.coordinator.request_body import unpackable
from omni_mesh.coordinator.service import Coordinator
from omni_mesh.openai_section import OpenAISpec

CLIENT_GONE = 499
DEFAULT_SAMPLE_RATE = 24_000  # OpenAI's pcm16 rate: the WAV header of a reply no stage gave a rate for
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}
_ERROR_CODES = {404: "model_not_found", 413: "request_too_large", 429: "queue_full", 504: "timeout"}


def error_object(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": _ERROR_CODES.get(status)}}


def openai_error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_object(status, message, param), headers=headers)


def failed(exc: RequestFailed) -> JSONResponse:
    """A request the mesh failed; one its stages found invalid (422) is OpenAI's 400."""
    return openai_error(400 if exc.status == 422 else exc.status, exc.message, headers=exc.headers)


class _OpenAIRoute(APIRoute):
    """Answers a body the schema refuses with OpenAI's error object and 400, as OpenAI does (the rest
    of the API answers 422 with the mesh's own envelope)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return _invalid_body(exc)
            except HTTPException as exc:  # a body FastAPI could not parse at all
                return openai_error(exc.status_code, f"the request body could not be read: {exc.detail}")

        return route


def _invalid_body(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = list(first.get("loc", ()))
    param = field_path(loc[1:] if loc[:1] == ["body"] else loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif param is None:
        message = "the request needs a JSON object body with `model` and `messages`"
    elif kind == "extra_forbidden":
        message = f"{param}: unknown field (pipeline-specific params go under `params`)"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}"
    more = len(errors) - 1
    return openai_error(400, message + (f" (and {more} more problem{'s' * (more > 1)})" if more > 0 else ""), param)


def openai_router(coordinator: Coordinator) -> APIRouter:
    """The OpenAI routes of `coordinator`'s app (added with `app.include_router`)."""
    router = APIRouter(route_class=_OpenAIRoute, tags=["OpenAI"])
    dispatcher = coordinator.dispatcher
    started = int(time.time())

    def spec_for(model: str) -> OpenAISpec | JSONResponse:
        spec = coordinator.topology.openai
        if spec is not None and model == spec.model:
            return spec
        served = f"it serves {spec.model!r}" if spec else "its topology has no `openai:` section, so it serves none"
        return openai_error(404, f"the model {model!r} does not exist on this mesh; {served} (GET /v1/models)", "model")

    def model_card(spec: OpenAISpec) -> dict[str, Any]:
        return {"id": spec.model, "object": "model", "created": started, "owned_by": "omni-mesh"}

    @router.get("/v1/models", summary="the model this mesh serves (the topology's openai.model)")
    async def models() -> dict:
        spec = coordinator.topology.openai
        return {"object": "list", "data": [model_card(spec)] if spec else []}

    # 422 documented with our envelope, not FastAPI's default HTTPValidationError (bad bodies are 400 here).
    @router.get("/v1/models/{model:path}", summary="one model", response_model=None, responses=responses(401, 422))
    async def model(model: str) -> dict | JSONResponse:
        spec = spec_for(model)
        return spec if isinstance(spec, JSONResponse) else model_card(spec)

    @router.post(
        "/v1/chat/completions", summary="OpenAI chat completions, text and audio", response_model=None,
        responses=responses(401, 422, 429),
    )
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        spec = spec_for(body.model)
        if isinstance(spec, JSONResponse):
            return spec
        try:
            call = chat_call(body, spec)
        except ChatRequestError as exc:
            return openai_error(400, exc.message, exc.param)
        bad = unpackable(call.inputs, call.params)
        if bad is not None:
            return openai_error(400, f"{bad[0]}: {bad[1]}")
        full = _full_stage(coordinator)
        if full is not None:
            return openai_error(429, full, headers={"retry-after": "1"})
        try:
            # The request's id is the access log's (the client's X-Request-Id, when usable): it names
            # the request in every stage's log lines.
            rid = getattr(request.state, "request_id", None)
            state = await dispatcher.admit(call.inputs, call.params, coordinator.default_timeout_s, True, rid=rid)
        except RequestFailed as exc:
            return failed(exc)
        answer = _Answer(coordinator, state, spec, call)
        try:
            first = await answer.next_event()  # a request failing before its first output gets a real status
        except BaseException:
            answer.abandon()
            raise
        if first[0] == "error":
            return failed(first[2])
        if body.stream:
            return StreamingResponse(answer.stream(first), media_type="text/event-stream")
        try:
            return await unless_client_leaves(request, answer.whole(first))
        except ClientGone:
            answer.abandon()  # the request ends in every stage
            return Response(status_code=CLIENT_GONE)  # nobody reads it: for the access log

    return router


def _full_stage(coordinator: Coordinator) -> str | None:
    """Why a new request must be refused with 429 (a stage's queue is at its limit), or None."""
    dispatcher = coordinator.dispatcher
    for stage in coordinator.topology.stages:
        running = sum(replica.max_inflight for replica in coordinator.registry.of_stage(stage.name))
        limit = stage.queue_limit(running)
        if len(dispatcher.queues[stage.name]) >= limit:
            return f"stage {stage.name!r} has {limit} request(s) waiting for a free replica, its limit; retry later"
    return None


class _Answer:
    """One admitted chat request: its events read as reply pieces, answered whole or as a stream."""

    def __init__(self, coordinator: Coordinator, state: RequestState, spec: OpenAISpec, call: ChatCall) -> None:
        self.dispatcher = coordinator.dispatcher
        self.state = state
        self.spec = spec
        self.call = call
        finals = [stage.name for stage in coordinator.topology.final_stages]
        self.reply = Reply(spec, finals, audio=call.audio_format is not None)
        self.id = f"chatcmpl-{state.rid}"
        self.audio_id = f"audio_{state.rid}"
        self.created = int(time.time())

    async def next_event(self) -> tuple[str, str | None, Any]:
        assert self.state.events is not None
        return await self.state.events.get()

    def abandon(self) -> None:
        """The client went away: the request ends, and every stage lets go of it."""
        if self.state.rid in self.dispatcher.requests:
            self.dispatcher.fail(self.state, RequestFailed(CLIENT_GONE, "the client went away", None))

    async def pieces(self, event: tuple[str, str | None, Any]) -> AsyncIterator[Piece]:
        """The reply's pieces in order, from `event` on, until the request is done; RequestFailed if it fails."""
        while True:
            kind, stage, value = event
            if kind == "error":
                raise value
            try:
                if kind == "done":
                    for piece in self.reply.done(value):
                        yield piece
                    return
                piece = self.reply.chunk(stage or "", value)
                if piece is not None:
                    yield piece
            except ReplyError as exc:
                failure = RequestFailed(502, f"{exc.message} (see the topology's openai: section)", exc.stage)
                self.dispatcher.fail(self.state, failure)
                raise failure from None
            event = await self.next_event()

    async def whole(self, first: tuple[str, str | None, Any]) -> JSONResponse:
        try:
            async for _ in self.pieces(first):
                pass
        except RequestFailed as exc:
            return failed(exc)
        except BaseException:
            self.abandon()
            raise
        message: dict[str, Any] = {"role": "assistant", "content": self.reply.text if self.call.text else None}
        if self.call.audio_format is not None:
            message["audio"] = {
                "id": self.audio_id,
                "data": self._audio(bytes(self.reply.pcm)),
                "expires_at": self.created,  # nothing is kept for later turns: it expires at once
                "transcript": self.reply.text,
            }
        choice = {"index": 0, "message": message, "finish_reason": self.reply.finish_reason, "logprobs": None}
        return JSONResponse(self._object("chat.completion", [choice], usage=self.reply.usage))

    async def stream(self, first: tuple[str, str | None, Any]) -> AsyncIterator[str]:
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            async for piece in self.pieces(first):
                delta = self._delta(piece)
                if delta:
                    yield self._chunk(delta)
            end = {"audio": {"id": self.audio_id, "expires_at": self.created}} if self.call.audio_format else {}
            yield self._chunk(end, finish_reason=self.reply.finish_reason)
            if self.call.include_usage:
                yield _sse(self._object("chat.completion.chunk", [], usage=self.reply.usage))
            yield "data: [DONE]\n\n"
        except RequestFailed as exc:
            yield _sse(error_object(exc.status, exc.message))
        finally:
            self.abandon()  # a no-op once the request is done

    def _delta(self, piece: Piece) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if piece.text and self.call.text:
            delta["content"] = piece.text
        if self.call.audio_format is not None:
            audio: dict[str, Any] = {}
            if piece.text:
                audio["transcript"] = piece.text
            if piece.pcm:
                audio["data"] = self._audio(piece.pcm)
            if audio:
                delta["audio"] = {"id": self.audio_id, **audio}
        return delta

    def _audio(self, pcm: bytes) -> str:
        assert self.call.audio_format is not None
        data = encode(pcm, self.reply.sample_rate or DEFAULT_SAMPLE_RATE, self.call.audio_format)
        return base64.b64encode(data).decode("ascii")

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        extra = {"usage": None} if self.call.include_usage else {}
        return _sse(self._object("chat.completion.chunk", [choice], **extra))

    def _object(self, kind: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.spec.model, "choices": choices, **extra}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"
