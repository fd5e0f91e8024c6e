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
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from omni_mesh.audio import SAMPLE_RATE, pcm16_bytes, wav_base64
from omni_mesh.engines.batching import Batcher, Rate
from omni_mesh.engines.bridge import Generation, every, ignore
from omni_mesh.engines.gather import Gather, counters_of
from omni_mesh.engines.kv_budget import (
    KvBudget,
    budget_of,
    check_request,
    kv_bytes_per_token,
    talker_kv_tokens,
)
from omni_mesh.engines.media_inputs import ENCODED_KEY
from omni_mesh.engines.media_parts import audio_in_video
from omni_mesh.engines.models import ModelParts, open_model
from omni_mesh.engines.settings import EngineSpec, Sampling, parse_engine, within_model_len
from omni_mesh.engines.stage_inputs import chunks, client_streams, wants_audio
from omni_mesh.engines.stops import StopText, StopWatch
from omni_mesh.engines.text import Detokenizer
from omni_mesh.handlers import HandlerContext, HandlerHooks

log = logging.getLogger("omni_mesh.engines")


class EngineStage(HandlerHooks):
    """What the stages share: settings, the model thread, loading in warm(), the encoder cache's counters()."""

    def __init__(self, spec: EngineSpec, stage: str = "", *, fed_by_encoder: bool = False, feeds_stages: bool = True) -> None:
        self.spec = spec
        self.stage = stage or spec.part
        self.fed_by_encoder = fed_by_encoder  # a thinker whose media an encoder stage encodes: no towers
        # Another stage reads this one's output; a thinker with none (a text-only mesh) keeps no hidden
        # states for a talker and sends none of its inputs: the client reads the text alone.
        self.feeds_stages = feeds_stages
        self.model: ModelParts | None = None
        self.part: Any = None
        # One model thread: requests take turns on the model (a CPU stage has no spare cores for more;
        # a GPU one would batch, which transformers' generate() does not do across requests).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.stage}-model")
        self.batcher: Batcher | None = None  # max_batch > 1: requests decode together (omni_mesh.engines.batching)
        self.gather: Gather | None = None  # code2wav with max_batch > 1: whole decodes in one call (engines.gather)
        self.stream_gather: Gather | None = None  # and streamed chunks of several requests in one call
        self.tokens_total = 0  # tokens (codes) made one request at a time (a batch counts its own, step by step)
        self.kv_budget: KvBudget | None = None  # engine.kv_cache_tokens / kv_cache_memory_bytes, once loaded
        self.token_rate = Rate()

    @classmethod
    def from_stage(cls, options: dict, stage: str = "") -> EngineStage:
        """Built from the stage's `engine:` mapping (nothing is loaded yet)."""
        return cls(parse_engine(options, f"stage {stage!r}"), stage)

    async def warm(self) -> None:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        self.model = await loop.run_in_executor(self.executor, open_model, self.spec)
        load = functools.partial(self.model.load, self.spec.part, towers=not self.fed_by_encoder)
        self.part = await loop.run_in_executor(self.executor, load)
        self.kv_budget = self._kv_budget()
        if self.spec.max_batch > 1 and self.spec.part == "code2wav":  # whole decodes gathered (Code2WavStage)
            per_call = min(self.spec.max_batch, getattr(self.part, "call_batch", None) or self.spec.max_batch)
            self.gather = Gather(self.executor, functools.partial(self.model.decode_many, self.part), per_call)
            self.stream_gather = Gather(self.executor, self.model.decode_chunks, per_call)
        elif self.spec.max_batch > 1:
            self.batcher = self._batcher()
        log.info(
            "stage %s loaded the %s of %s (%s) in %.1f s",
            self.stage, self.spec.part, self.model.directory, self.model.arch, time.perf_counter() - started,
        )

    def _batcher(self) -> Batcher | None:
        """The running batch of a part that batches (thinkers, talkers); None for the others, with a warning."""
        assert self.model is not None
        engine = self.model.batch_engine(self._loaded(), self.spec.part, for_talker=self.feeds_stages)
        if engine is None:
            log.warning("stage %s: engine.max_batch %d has no effect on a %s %s yet: its requests take turns",
                        self.stage, self.spec.max_batch, self.model.arch, self.spec.part)
            return None
        return Batcher(self.stage, engine, self.spec.max_batch, self.kv_budget)

    def _kv_budget(self) -> KvBudget | None:
        """The stage's KV budget in tokens (omni_mesh.engines.kv_budget); a part without a KV cache (an
        encoder, code2wav) says it has no effect."""
        if self.spec.kv_cache_tokens is None and self.spec.kv_cache_memory_bytes is None:
            return None
        model = getattr(self.part, "model", None)
        if self.spec.part not in ("thinker", "talker") or not hasattr(model, "config"):
            log.warning("stage %s: engine.kv_cache_tokens / kv_cache_memory_bytes have no effect on a %s",
                        self.stage, self.spec.part)
            return None
        budget = budget_of(self.spec, kv_bytes_per_token(model), f"stage {self.stage!r}")
        assert budget is not None
        log.info("stage %s: KV cache budget %d tokens (%d bytes)", self.stage, budget.tokens, budget.bytes)
        return budget

    def counters(self) -> dict[str, int | float]:
        """A thinker's tokens (a talker's codes) made and per second, its running batch's size and queue
        (max_batch > 1), and the encoder cache's hits, misses and items where this stage encodes media (an
        encoder, or a thinker with its towers); sent with every heartbeat (omni_mesh.stage.counters)."""
        out: dict[str, int | float] = self.batcher.counters() if self.batcher is not None else {}
        if self.batcher is None and self.kv_budget is not None:
            out.update({"kv_cache_budget_tokens": self.kv_budget.tokens, "kv_cache_budget_bytes": self.kv_budget.bytes})
        out.update(counters_of([g for g in (self.gather, self.stream_gather) if g is not None]))
        unit = {"thinker": "tokens", "talker": "codes"}.get(self.spec.part)
        if unit is not None:
            made = self.tokens_total + (self.batcher.tokens_total if self.batcher is not None else 0)
            out.update({f"generated_{unit}_total": made, f"generated_{unit}_per_second": self.token_rate(made)})
        cache = getattr(self.model, "towers_cache", None)
        if cache is None or self.spec.part not in ("encoder", "thinker") or self.fed_by_encoder:
            return out
        stats = cache.stats()
        return {**out, "encoder_cache_hits_total": stats["hits"], "encoder_cache_misses_total": stats["misses"],
                "encoder_cache_items": stats["items"]}

    def _loaded(self) -> Any:
        if self.part is None:
            raise RuntimeError(f"stage {self.stage!r}: its model is not loaded (warm() was not awaited)")
        return self.part


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


class ThinkerStage(EngineStage):
    """Prompt -> reply text, streamed token by token, and the talker's inputs at the end (where a stage reads them)."""

    async def __call__(self, inputs: Any, ctx: HandlerContext) -> AsyncIterator[dict]:
        thinker = self._loaded()
        assert self.model is not None
        sampling = Sampling.of(self.spec, ctx.params)
        loop = asyncio.get_running_loop()
        # media: the processor and towers (no encoder stage), or the embeddings laid out: model-thread work
        in_video = audio_in_video(inputs, ctx.params)
        prompt = functools.partial(self.model.prompt, thinker, inputs, use_audio_in_video=in_video)
        ids, media = await loop.run_in_executor(self.executor, prompt)
        self.model.check_prompt(thinker, int(ids.shape[-1]))  # a 4xx before any generation
        sampling = within_model_len(self.spec, sampling, int(ids.shape[-1]))
        kv_tokens = int(ids.shape[-1]) + sampling.max_tokens
        check_request(self.kv_budget, kv_tokens,
                      f"a prompt of {int(ids.shape[-1])} tokens and max_tokens {sampling.max_tokens}", "max_tokens")
        eos = set(self.model.eos_token_ids(thinker))
        stops = StopWatch(self.model.tokenizer, sampling.stop, sampling.stop_token_ids)

        # A client reading a stream gets the text token by token; for any other the text goes with the
        # talker's inputs in one chunk (a chunk per token would cost every stage a hop per token), and no
        # token is handed to this loop as it comes.
        detok = Detokenizer(self.model.tokenizer) if client_streams(ctx) else None
        interval = self.spec.stream_interval

        def run(push: Any, should_stop: Any) -> Any:
            self.model.seed(sampling.seed)
            return self.model.think(thinker, ids, sampling, push if detok else None, stops.until(should_stop), media,
                                    for_talker=self.feeds_stages)

        def join(push: Any, should_stop: Any) -> Any:  # into the running batch: a Future of the output
            watch = stops.until(should_stop)
            begin = functools.partial(self.model.think_begin, thinker, ids, sampling, watch, media,
                                      for_talker=self.feeds_stages)
            return self.batcher.submit(begin, every(push, interval) if detok else ignore, watch, kv_tokens)

        generation = Generation(None, join) if self.batcher is not None else Generation(self.executor, run)
        text = StopText(sampling.stop)  # the reply's text ends before a stop string
        try:
            async for items in generation.batches():  # what came since this loop last woke up
                if detok is None:
                    continue
                # A chunk per item, as stream_interval promises even when several wait: a token (one
                # request at a time), or a batch's list of `interval` of them (bridge.every).
                for item in items:
                    detok.extend(item if isinstance(item, list) else [item])
                    if delta := text.add(detok.advance()):
                        yield {"text": delta}
            output = await generation.result()
        finally:
            await generation.settle()
        reply = [int(t) for t in self.model.reply_ids(output).tolist()]
        if detok is not None:
            detok.extend(reply[len(detok.ids):])  # what the last pushes held back (engine.stream_interval)
        if self.batcher is None:
            self.tokens_total += len(reply)
        stopped = stops.hit or (bool(reply) and reply[-1] in eos)
        last = {
            "text": text.add(detok.flush()) + text.flush()
            if detok
            else text.whole(self.model.tokenizer.decode(reply, skip_special_tokens=True)),
            "usage": {"prompt_tokens": int(ids.shape[-1]), "completion_tokens": len(reply)},
            "finish_reason": "stop" if stopped or len(reply) < sampling.max_tokens else "length",
        }
        yield {**last, "talker": self.model.talker_payload(output)} if self.feeds_stages else last

    def client_output(self, output: Any) -> Any:
        """What a client reads of the thinker when it is a final stage too: not the talker's inputs."""
        return {key: value for key, value in output.items() if key != "talker"}


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
