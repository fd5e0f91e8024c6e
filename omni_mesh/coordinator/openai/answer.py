"""One admitted chat request: its events read as reply pieces, answered whole or as a stream of
`chat.completion.chunk` events (OpenAI's shapes)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from omni_mesh.coordinator.http.sse import sse
from omni_mesh.coordinator.openai.audio import COMPRESSED, encode
from omni_mesh.coordinator.openai.reply import Piece, Reply, ReplyError
from omni_mesh.coordinator.openai.request import ChatCall
from omni_mesh.coordinator.scheduling import events
from omni_mesh.coordinator.scheduling.dispatch import RequestState
from omni_mesh.coordinator.scheduling.failures import RequestFailed, openai_body
from omni_mesh.coordinator.scheduling.service import Coordinator
from omni_mesh.topology.openai_spec import OpenAISpec

DEFAULT_SAMPLE_RATE = 24_000  # OpenAI's pcm16 rate: the WAV header of a reply no stage gave a rate for
#: A reply's audio.expires_at is this long after it was made, as OpenAI's (nothing is kept for later
#: turns here, but a client reads the field as a lifetime, and OpenAI's is an hour).
AUDIO_EXPIRES_S = 3600


def openai_error(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """OpenAI's error answer for a failure of the mesh's `status` (422 is OpenAI's 400, and so on)."""
    code, body = openai_body(status, message, param)
    return JSONResponse(status_code=code, content=body, headers=headers)


def failed(exc: RequestFailed) -> JSONResponse:
    return openai_error(exc.status, exc.message, exc.field, exc.headers)


class Answer:
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
        # With audio, the text is the audio's transcript, and `content` is null (as OpenAI answers).
        self.content = call.text and call.audio_format is None

    async def next_event(self) -> events.Event:
        assert self.state.events is not None
        return await self.state.events.get()

    def abandon(self) -> None:
        """The client went away: the request ends, and every stage lets go of it."""
        self.dispatcher.abandon(self.state)

    async def pieces(self, event: events.Event) -> AsyncIterator[Piece]:
        """The reply's pieces in order, from `event` on, until the request is done; RequestFailed if it fails."""
        while True:
            if isinstance(event, events.Failed):
                raise event.error
            try:
                if isinstance(event, events.Done):
                    for piece in self.reply.done(event.outputs):
                        yield piece
                    return
                piece = self.reply.chunk(event.stage, event.value)
                if piece is not None:
                    yield piece
            except ReplyError as exc:
                failure = RequestFailed(502, f"{exc.message} (see the topology's openai: section)", exc.stage)
                self.dispatcher.fail(self.state, failure)
                raise failure from None
            event = await self.next_event()

    async def whole(self, first: events.Event) -> JSONResponse:
        try:
            async for _ in self.pieces(first):
                pass
        except RequestFailed as exc:
            return failed(exc)
        except BaseException:
            self.abandon()
            raise
        message: dict[str, Any] = {"role": "assistant", "content": self.reply.text if self.content else None}
        if self.call.audio_format is not None:
            message["audio"] = {
                "id": self.audio_id,
                "data": await self._audio(bytes(self.reply.pcm)),
                "expires_at": self.created + AUDIO_EXPIRES_S,
                "transcript": self.reply.text,
            }
        choice = {"index": 0, "message": message, "finish_reason": self.reply.finish_reason, "logprobs": None}
        return JSONResponse(self._object("chat.completion", [choice], usage=self.reply.usage))

    async def stream(self, first: events.Event) -> AsyncIterator[str]:
        try:
            yield self._chunk({"role": "assistant", "content": "" if self.content else None})
            async for piece in self.pieces(first):
                delta = await self._delta(piece)
                if delta:
                    yield self._chunk(delta)
            expires_at = self.created + AUDIO_EXPIRES_S
            end = {"audio": {"id": self.audio_id, "expires_at": expires_at}} if self.call.audio_format else {}
            yield self._chunk(end, finish_reason=self.reply.finish_reason)
            if self.call.include_usage:
                yield sse(self._object("chat.completion.chunk", [], usage=self.reply.usage))
            yield "data: [DONE]\n\n"
        except RequestFailed as exc:
            yield sse(openai_body(exc.status, exc.message)[1])
        finally:
            self.abandon()  # a no-op once the request is done

    async def _delta(self, piece: Piece) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if piece.text and self.content:
            delta["content"] = piece.text
        if self.call.audio_format is not None:
            audio: dict[str, Any] = {}
            if piece.text:
                audio["transcript"] = piece.text
            if piece.pcm:
                audio["data"] = await self._audio(piece.pcm)
            if audio:
                delta["audio"] = {"id": self.audio_id, **audio}
        return delta

    async def _audio(self, pcm: bytes) -> str:
        fmt = self.call.audio_format
        assert fmt is not None
        rate = self.reply.sample_rate or DEFAULT_SAMPLE_RATE
        # FFmpeg's encoders take milliseconds a second of audio: off the event loop, as other requests wait on it.
        data = await asyncio.to_thread(encode, pcm, rate, fmt) if fmt in COMPRESSED else encode(pcm, rate, fmt)
        return base64.b64encode(data).decode("ascii")

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        extra = {"usage": None} if self.call.include_usage else {}
        return sse(self._object("chat.completion.chunk", [choice], **extra))

    def _object(self, kind: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.spec.model, "choices": choices, **extra}
