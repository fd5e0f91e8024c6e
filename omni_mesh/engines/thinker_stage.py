"""`ThinkerStage`: prompt -> reply text, streamed token by token, and the talker's inputs at the end (where
a stage reads them).

Where the model runs: one request at a time in the replica's model thread (`max_batch: 1`); with
`max_batch` > 1 in a running batch, by default in the stage's engine core, a process of its own
(omni_mesh.engines.core), else (`core_process: false`) in a thread of the replica. Wherever the prompt is
made ready it is checked there before any generation (a 4xx); the stage detokenizes and streams the reply
and tells its end either way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from omni_mesh.engines.bridge import Generation, every, ignore
from omni_mesh.engines.core_client import EngineCore, ThinkerEnd
from omni_mesh.engines.engine_stage import EngineStage
from omni_mesh.engines.kv_budget import checked_sampling
from omni_mesh.engines.media_parts import audio_in_video
from omni_mesh.engines.models import open_model
from omni_mesh.engines.settings import Sampling
from omni_mesh.engines.stage_inputs import client_streams
from omni_mesh.engines.stops import StopText, StopWatch
from omni_mesh.engines.text import Detokenizer
from omni_mesh.handlers import HandlerContext

log = logging.getLogger("omni_mesh.engines")


@dataclass
class Started:
    """A request whose generation has begun, wherever it runs."""

    generation: Generation
    end: Callable[[Any], ThinkerEnd]  # the generation's output -> how the request ended


class ThinkerStage(EngineStage):
    """Prompt -> reply text, streamed token by token, and the talker's inputs at the end (where a stage reads them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core: EngineCore | None = None

    async def warm(self) -> None:
        if self.spec.max_batch == 1 or not self.spec.core_process:
            await super().warm()
            return
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        self.model = await loop.run_in_executor(self.executor, open_model, self.spec)  # configs and tokenizer: no weights
        self.core = EngineCore(self.stage)
        await self.core.start(self.spec, fed_by_encoder=self.fed_by_encoder, feeds_stages=self.feeds_stages)
        log.info("stage %s loaded the thinker of %s (%s) in its engine core in %.1f s",
                 self.stage, self.model.directory, self.model.arch, time.perf_counter() - started)

    def counters(self) -> dict[str, int | float]:
        if self.core is None:
            return super().counters()
        out = self.core.counters()  # the running batch's, the KV cache's, the towers' cache where it encodes
        made = int(out.pop("tokens_total", 0))
        return {**out, "generated_tokens_total": made, "generated_tokens_per_second": self.token_rate(made)}

    async def __call__(self, inputs: Any, ctx: HandlerContext) -> AsyncIterator[dict]:
        if self.model is None:
            raise RuntimeError(f"stage {self.stage!r}: its model is not loaded (warm() was not awaited)")
        sampling = Sampling.of(self.spec, ctx.params)
        in_video = audio_in_video(inputs, ctx.params)  # vLLM's mm_processor_kwargs
        # A client reading a stream gets the text token by token; for any other the text goes with the
        # talker's inputs in one chunk (a chunk per token would cost every stage a hop per token), and no
        # token is handed to this loop as it comes.
        detok = Detokenizer(self.model.tokenizer) if client_streams(ctx) else None
        begin = self._in_core if self.core is not None else self._in_process
        started = await begin(inputs, sampling, in_video, detok is not None)
        generation = started.generation
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
        end = started.end(output)
        reply = end.reply
        if detok is not None:
            detok.extend(reply[len(detok.ids):])  # what the last pushes held back (engine.stream_interval)
        if self.batcher is None and self.core is None:
            self.tokens_total += len(reply)
        last = {
            "text": text.add(detok.flush()) + text.flush()
            if detok
            else text.whole(self.model.tokenizer.decode(reply, skip_special_tokens=True)),
            "usage": {"prompt_tokens": end.prompt_tokens, "completion_tokens": len(reply)},
            "finish_reason": "stop" if end.stopped or len(reply) < end.max_tokens else "length",
        }
        yield {**last, "talker": end.talker} if self.feeds_stages else last

    def client_output(self, output: Any) -> Any:
        """What a client reads of the thinker when it is a final stage too: not the talker's inputs."""
        return {key: value for key, value in output.items() if key != "talker"}

    async def _in_core(self, inputs: Any, sampling: Sampling, in_video: bool | None, streams: bool) -> Started:
        """The request handed to the engine core whole: its prompt made ready there (media through its
        towers), checked there (a 4xx before any generation), run in its batch; a cancel follows it there."""
        core = self.core
        assert core is not None
        rids: list[int] = []

        def submit(push: Any, should_stop: Any) -> Any:
            rid, future = core.submit(inputs, in_video, sampling, push=push if streams else None,
                                      interval=self.spec.stream_interval)
            rids.append(rid)
            return future

        generation = Generation(None, submit, on_stop=lambda: core.cancel(rids[0]))
        return Started(generation, lambda end: end)

    async def _in_process(self, inputs: Any, sampling: Sampling, in_video: bool | None, streams: bool) -> Started:
        """The prompt made ready in the model thread (media: the processor and towers, or an encoder stage's
        embeddings laid out), then generate() there, or a place in this process's running batch."""
        thinker = self._loaded()
        assert self.model is not None
        model = self.model
        prompt = functools.partial(model.prompt, thinker, inputs, use_audio_in_video=in_video)
        ids, media = await asyncio.get_running_loop().run_in_executor(self.executor, prompt)
        tokens = int(ids.shape[-1])
        model.check_prompt(thinker, tokens)  # a 4xx before any generation
        sampling = checked_sampling(self.spec, self.kv_budget, sampling, tokens)
        stops = StopWatch(model.tokenizer, sampling.stop, sampling.stop_token_ids)
        interval = self.spec.stream_interval

        def run(push: Any, should_stop: Any) -> Any:
            model.seed(sampling.seed)
            return model.think(thinker, ids, sampling, push if streams else None, stops.until(should_stop), media,
                               for_talker=self.feeds_stages)

        def join(push: Any, should_stop: Any) -> Any:  # into the running batch: a Future of the output
            watch = stops.until(should_stop)
            begin = functools.partial(model.think_begin, thinker, ids, sampling, watch, media, for_talker=self.feeds_stages)
            assert self.batcher is not None
            return self.batcher.submit(begin, every(push, interval) if streams else ignore, watch, tokens + sampling.max_tokens)

        eos = frozenset(model.eos_token_ids(thinker))

        def end(output: Any) -> ThinkerEnd:
            reply = [int(t) for t in model.reply_ids(output).tolist()]
            stopped = stops.hit or (bool(reply) and reply[-1] in eos)
            return ThinkerEnd(reply, stopped, tokens, sampling.max_tokens,
                              model.talker_payload(output) if self.feeds_stages else None)

        generation = Generation(None, join) if self.batcher is not None else Generation(self.executor, run)
        return Started(generation, end)
