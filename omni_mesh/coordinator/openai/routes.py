"""OpenAI-compatible serving: `POST /v1/chat/completions` and `GET /v1/models`.

The topology's `openai:` section (omni_mesh.topology.openai_spec) names the model, how a chat request
becomes the pipeline's inputs, and which final-stage fields hold the reply's text, audio and token
counts. Every request reads the final stages' stream (`stream: true` to the dispatcher), so a stream
of `chat.completion.chunk` events carries each text and audio piece as soon as a final stage emits
it; a non-streaming answer is the same pieces joined. A request is admitted as on `/v1/requests`
(scheduling.admission). Errors on these routes are OpenAI's error object,
`{"error": {"message", "type", "param", "code"}}`; the app's middleware (API key, body limit)
applies here as on every other route.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from omni_mesh.coordinator.http.client_gone import ClientGone, unless_client_leaves
from omni_mesh.coordinator.http.envelope import responses
from omni_mesh.coordinator.openai.answer import Answer, failed, openai_error
from omni_mesh.coordinator.openai.request import ChatRequest, ChatRequestError, chat_call
from omni_mesh.coordinator.scheduling import events
from omni_mesh.coordinator.scheduling.admission import admit
from omni_mesh.coordinator.scheduling.failures import CLIENT_GONE, RequestFailed
from omni_mesh.coordinator.scheduling.packable import field_path
from omni_mesh.coordinator.scheduling.service import Coordinator
from omni_mesh.topology.openai_spec import OpenAISpec


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


def router(coordinator: Coordinator) -> APIRouter:
    routes = APIRouter(route_class=_OpenAIRoute, tags=["OpenAI"])
    started = int(time.time())

    def spec_for(model: str) -> OpenAISpec | JSONResponse:
        spec = coordinator.topology.openai
        if spec is not None and model == spec.model:
            return spec
        served = f"it serves {spec.model!r}" if spec else "its topology has no `openai:` section, so it serves none"
        return openai_error(404, f"the model {model!r} does not exist on this mesh; {served} (GET /v1/models)", "model")

    def model_card(spec: OpenAISpec) -> dict[str, Any]:
        return {"id": spec.model, "object": "model", "created": started, "owned_by": "omni-mesh"}

    @routes.get("/v1/models", summary="the model this mesh serves (the topology's openai.model)")
    async def models() -> dict:
        spec = coordinator.topology.openai
        return {"object": "list", "data": [model_card(spec)] if spec else []}

    # 422 documented with our envelope, not FastAPI's default HTTPValidationError (bad bodies are 400 here).
    @routes.get("/v1/models/{model:path}", summary="one model", response_model=None, responses=responses(401, 422))
    async def model(model: str) -> dict | JSONResponse:
        spec = spec_for(model)
        return spec if isinstance(spec, JSONResponse) else model_card(spec)

    @routes.post(
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
            return openai_error(exc.status, exc.message, exc.param)
        try:
            messages = {name: "messages" for name, source in spec.inputs.items() if source == "messages"}
            state = await admit(
                coordinator, call.inputs, call.params, request_id=getattr(request.state, "request_id", None),
                timeout_s=None, stream=True, messages=messages,
            )
        except RequestFailed as exc:
            return failed(exc)
        answer = Answer(coordinator, state, spec, call)
        try:
            first = await answer.next_event()  # a request failing before its first output gets a real status
        except BaseException:
            answer.abandon()
            raise
        if isinstance(first, events.Failed):
            return failed(first.error)
        if body.stream:
            return StreamingResponse(answer.stream(first), media_type="text/event-stream")
        try:
            return await unless_client_leaves(request, answer.whole(first))
        except ClientGone:
            answer.abandon()  # the request ends in every stage
            return Response(status_code=CLIENT_GONE)  # nobody reads it: for the access log

    return routes
