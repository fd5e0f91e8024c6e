"""What the engine stages share (`EngineStage`): their settings, the model thread, loading in warm(),
the running batch or gathered decodes that `max_batch` > 1 gives them, and the counters they report."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omni_mesh.engines.batching import Batcher, Rate
from omni_mesh.engines.gather import Gather, counters_of
from omni_mesh.engines.kv_budget import KvBudget, stage_budget
from omni_mesh.engines.models import ModelParts, open_model
from omni_mesh.engines.settings import EngineSpec, parse_engine
from omni_mesh.handlers import HandlerHooks

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
        self.kv_budget = stage_budget(self.spec, self.part, self.stage)
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
