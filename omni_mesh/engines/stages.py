"""Stage handlers that run a real model part: `ThinkerStage`, `TalkerStage`, `Code2WavStage`.

Each is built once per replica from its stage's `engine:` settings (`from_stage`), loads its part in
`warm()` (before the replica reports ready), and runs generation in a model thread of its own, one
request at a time, while the event loop keeps streaming; a thinker or talker with `max_batch` > 1 decodes
up to that many requests together in one forward per step (omni_mesh.engines.batching), and code2wav
decodes whole replies queued together in one call, and streamed chunks likewise (omni_mesh.engines.gather).

The stream, stage to stage (one way, as every payload flows):
- thinker -> talker: `{"text": delta}` per reply token as it is made, then one last chunk with the
  talker's inputs (`"talker"`), `"usage"` and `"finish_reason"`;
- talker -> code2wav: the text deltas passed on as they come, then `{"codes": int64 [n]}` chunks as the
  talker makes them (a short first chunk), then `{"usage", "finish_reason"}`;
- a client that does not read a stream needs no chunks: the thinker sends its text with the talker's
  inputs, and the talker its codes, in one chunk each;
- code2wav -> client: streamed, `{"text", "audio_pcm16", "sample_rate"}` chunks (text first, audio as
  it is made) and a last one with `usage` and `finish_reason`; otherwise one answer with `text`,
  `audio_wav_base64` (24 kHz mono 16-bit WAV), `sample_rate`, `duration_s`, `usage`, `finish_reason`.
"""


from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from omni_mesh.audio import SAMPLE_RATE, pcm16_bytes, wav_base64
from omni_mesh.engines.bridge import Generation
from omni_mesh.engines.engine_stage import EngineStage
from omni_mesh.engines.kv_budget import check_request, talker_kv_tokens
from omni_mesh.engines.media_inputs import ENCODED_KEY
from omni_mesh.engines.media_parts import audio_in_video
from omni_mesh.engines.settings import Sampling, parse_engine
from omni_mesh.engines.stage_inputs import chunks, client_streams, wants_audio
from omni_mesh.engines.thinker_stage import ThinkerStage
from omni_mesh.handlers import HandlerContext

log = logging.getLogger("omni_mesh.engines")


class EncoderStage(EngineStage):
    """A request's messages and media -> the processor's expanded ids and the towers' embeddings
    (`{"encoded": Encoded}`, omni_mesh.engines.encoder) for the thinker."""

    async def __call__(self, inputs: Any, ctx: HandlerContext) -> dict:
        towers = self._loaded()
        assert self.model is not None
        loop = asyncio.get_running_loop()
        # vLLM's mm_processor_kwargs: the OpenAI route sends them as params, /v1/requests either way
        in_video = audio_in_video(inputs, ctx.params)
        encode = functools.partial(self.model.encode, towers, inputs, use_audio_in_video=in_video)
        encoded = await loop.run_in_executor(self.executor, encode)
        return {ENCODED_KEY: encoded}


class TalkerStage(EngineStage):
    """The thinker's stream -> its text passed on, then codec codes in chunks as they are made."""

    async def __call__(self, inputs: Any, ctx: HandlerContext) -> AsyncIterator[dict]:
        talker = self._loaded()
        assert self.model is not None
        sampling = Sampling.of(self.spec, ctx.params)
        thinker_output, tail = None, {}
        async for chunk in chunks(inputs, "talker"):
            if chunk.get("text"):
                yield {"text": chunk["text"]}
            if "talker" in chunk:
                thinker_output = chunk["talker"]
                tail = {key: chunk[key] for key in ("usage", "finish_reason") if key in chunk}
        if thinker_output is None:
            raise ValueError(f"stage {self.stage!r}: the thinker's stream ended without the talker's inputs")
        if not wants_audio(ctx):  # modalities ["text"]: no codes, code2wav passes the text on
            yield tail
            return
        kv_tokens = talker_kv_tokens(thinker_output, sampling.max_audio_tokens)
        check_request(self.kv_budget, kv_tokens, f"the thinker's prompt and reply and max_audio_tokens "
                      f"{sampling.max_audio_tokens}", "max_audio_tokens")

        def run(push: Any, should_stop: Any) -> Any:
            self.model.seed(sampling.seed)
            return self.model.talk(talker, thinker_output, sampling, push, should_stop)

        def join(push: Any, should_stop: Any) -> Any:  # into the running batch: a Future of the codes
            begin = functools.partial(self.model.talk_begin, talker, thinker_output, sampling, should_stop)
            return self.batcher.submit(begin, push, should_stop, kv_tokens)

        generation = Generation(None, join) if self.batcher is not None else Generation(self.executor, run)
        stops = set(self.model.code_stop_ids(talker))
        pending: list[Any] = []
        # Chunks only help a client that hears the audio as it is made; any other gets the codes at once.
        size = self.spec.first_chunk_codes if client_streams(ctx) else None
        try:
            async for code in generation:
                if isinstance(code, int) and code in stops:
                    continue
                pending.append(code)
                if self.batcher is None:  # a batch counts its own
                    self.tokens_total += 1
                if size is not None and len(pending) >= size:
                    yield {"codes": self.model.codes_tensor(pending)}
                    pending, size = [], self.spec.chunk_codes
            await generation.result()
        finally:
            await generation.settle()
        if pending:
            yield {"codes": self.model.codes_tensor(pending)}
        yield tail


class Code2WavStage(EngineStage):
    """Codec codes -> 24 kHz audio: streamed chunk by chunk to a streaming client, else decoded whole
    (the one-shot decode the reference makes, seeded as it is)."""

    def __call__(self, inputs: Any, ctx: HandlerContext) -> Any:
        return self._stream(inputs, ctx) if client_streams(ctx) else self._whole(inputs, ctx)

    async def _whole(self, inputs: Any, ctx: HandlerContext) -> dict:
        decoder = self._loaded()
        assert self.model is not None
        sampling = Sampling.of(self.spec, ctx.params)
        text, codes, tail = [], [], {}
        async for chunk in chunks(inputs, "code2wav"):
            text.append(chunk.get("text") or "")
            if chunk.get("codes") is not None:
                codes.append(chunk["codes"])
            tail.update({key: chunk[key] for key in ("usage", "finish_reason") if key in chunk})
        all_codes = self.model.join_codes(codes)
        loop = asyncio.get_running_loop()
        samples = np.zeros(0, dtype=np.float32)  # no codes (a text-only request): no audio
        if codes:
            if self.gather is not None:  # decoded with the requests queued beside it
                wav = await asyncio.wrap_future(self.gather.submit((all_codes, sampling)))
            else:
                wav = await loop.run_in_executor(self.executor, self.model.decode, decoder, all_codes, sampling)
            samples = wav.numpy().astype(np.float32, copy=False)
        return {
            "text": "".join(text),
            "sample_rate": SAMPLE_RATE,
            "audio_wav_base64": wav_base64(samples),
            "duration_s": len(samples) / SAMPLE_RATE,
            "codes": self.model.code_frames(all_codes),
            "usage": tail.get("usage"),
            "finish_reason": tail.get("finish_reason", "stop"),
        }

    async def _stream(self, inputs: Any, ctx: HandlerContext) -> AsyncIterator[dict]:
        decoder = self._loaded()
        assert self.model is not None
        sampling = Sampling.of(self.spec, ctx.params)
        streaming = self.model.stream_decoder(decoder, sampling)
        tail: dict = {}
        fed = False
        async for chunk in chunks(inputs, "code2wav"):
            if chunk.get("text"):
                yield {"text": chunk["text"], "audio_pcm16": b"", "sample_rate": SAMPLE_RATE}
            if chunk.get("codes") is not None:
                wav = await self._decoded(streaming, chunk["codes"], first=not fed)
                fed = True
                if len(wav):
                    yield {"text": "", "audio_pcm16": pcm16_bytes(wav.numpy()), "sample_rate": SAMPLE_RATE}
            tail.update({key: chunk[key] for key in ("usage", "finish_reason") if key in chunk})
        rest = await self._decoded(streaming, None) if fed else None
        yield {
            "text": "",
            "audio_pcm16": pcm16_bytes(rest.numpy()) if rest is not None else b"",
            "sample_rate": SAMPLE_RATE,
            "usage": tail.get("usage"),
            "finish_reason": tail.get("finish_reason", "stop"),
        }

    async def _decoded(self, streaming: Any, codes: Any, *, first: bool = False) -> Any:
        """A streamed chunk's new samples (codes None: the rest, at the end), decoded with the chunks of the
        other requests queued beside it (max_batch > 1: one call; a stream's `first` chunk before the
        others' chunks, engines.gather), else alone."""
        if self.stream_gather is not None:
            return await asyncio.wrap_future(self.stream_gather.submit((streaming, codes), first=first))
        call = streaming.finish if codes is None else functools.partial(streaming.feed, codes)
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)


#: The handler class of each part.
STAGES: dict[str, type[EngineStage]] = {
    "encoder": EncoderStage, "thinker": ThinkerStage, "talker": TalkerStage, "code2wav": Code2WavStage,
}


def engine_handler(options: dict, stage: str = "", *, fed_by_encoder: bool = False, feeds_stages: bool = True) -> EngineStage:
    """The handler of a stage with `engine:` settings (loaded by its warm()); a thinker `fed_by_encoder`
    loads no towers, one that `feeds_stages` not keeps nothing for a talker."""
    spec = parse_engine(options, f"stage {stage!r}")
    return STAGES[spec.part](spec, stage, fed_by_encoder=fed_by_encoder, feeds_stages=feeds_stages)
