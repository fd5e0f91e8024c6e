"""What every architecture's parts offer the stage handlers (`ModelParts`): a checkpoint directory
opened for one stage, its tokenizer and processor, its parts loaded, and what they are asked, in the
stages' terms. Each architecture fills it in (`omni_mesh.engines.models`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from omni_mesh.engines.generation import decoding_args
from omni_mesh.engines.prefill import check_prompt
from omni_mesh.engines.settings import EngineSpec, Sampling

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelParts(ABC):
    """One checkpoint, one architecture: loads a part and reads what its parts return."""

    arch = ""

    def __init__(self, directory: Path, spec: EngineSpec, config: dict) -> None:
        self.directory = directory
        self.spec = spec
        self.config = config
        self._tokenizer: Any = None
        self._processor: Any = None
        self.towers_cache: Any = None  # the EncoderCache of this stage's towers (encoder, or a thinker that encodes)

    @property
    def dtype(self) -> torch.dtype:
        if self.spec.dtype != "auto":
            return _DTYPES[self.spec.dtype]
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "float32"
        return _DTYPES.get(str(name), torch.float32)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.directory))
        return self._tokenizer

    @property
    def processor(self) -> Any:
        """The checkpoint's processor (media -> expanded ids and features)."""
        if self._processor is None:
            from omni_mesh.engines.processor import load_processor

            self._processor = load_processor(self.directory)
        return self._processor

    def load(self, part: str, *, towers: bool = True) -> Any:
        """Part `part`; a thinker without its towers (`towers=False`) when an encoder stage feeds it."""
        if part in ("thinker", "encoder"):
            self.tokenizer  # noqa: B018 (loaded now, not by the first request)
            if (self.directory / "processor_config.json").exists() and (part == "encoder" or towers):
                self.processor  # noqa: B018
        from omni_mesh.engines.encoder import AUDIO_PREFIX, VISION_PREFIX, EncoderCache, Towers

        self.towers_cache = EncoderCache(self.spec.encoder_cache)
        if part == "encoder":
            config = self._config_class().from_pretrained(str(self.directory)).thinker_config
            return Towers.load(self.directory, config, self.arch, self.dtype, self.spec.device, self.towers_cache)
        skip = () if towers or part != "thinker" else tuple(p.removeprefix("thinker.") for p in (AUDIO_PREFIX, VISION_PREFIX))
        return self._load(part, skip)

    @abstractmethod
    def _load(self, part: str, skip: tuple[str, ...] = ()) -> Any:
        ...

    @abstractmethod
    def _config_class(self) -> Any:
        ...

    def encode(self, towers: Any, inputs: Any, *, use_audio_in_video: bool | None = None) -> dict:
        """A request's inputs through the processor and the towers: `Encoded` (omni_mesh.engines.encoder);
        `use_audio_in_video` None: as the inputs ask (media_parts.audio_in_video)."""
        from omni_mesh.engines.processor import process

        return towers.encode(process(self.processor, inputs, use_audio_in_video=use_audio_in_video))

    def prompt(self, thinker: Any, inputs: Any, *, use_audio_in_video: bool | None = None) -> tuple[torch.Tensor, dict]:
        """(prompt ids [1, P], generate() arguments for its media) of a thinker's inputs: an encoder stage's
        output, a request with media (the thinker encodes it with its own towers), or text."""
        from omni_mesh.engines.media_inputs import ENCODED_KEY, prompt_ids, thinker_kwargs
        from omni_mesh.engines.media_parts import has_media
        from omni_mesh.engines.text import prompt_ids as text_prompt_ids

        if isinstance(inputs, dict) and ENCODED_KEY in inputs:
            encoded = inputs[ENCODED_KEY]
        elif has_media(inputs):
            from omni_mesh.engines.encoder import Towers

            if thinker.model.model.audio_tower is None:
                raise ValueError("thinker: a request with media reached a thinker without towers (an encoder stage feeds it)")
            towers = Towers.of_thinker(thinker.model, self.arch, self.towers_cache)
            encoded = self.encode(towers, inputs, use_audio_in_video=use_audio_in_video)
        else:
            return text_prompt_ids(self.tokenizer, inputs), {}
        if set(encoded) <= {"input_ids", "use_audio_in_video"}:  # text only: the ids say it all
            return prompt_ids(encoded), {}
        return prompt_ids(encoded), thinker_kwargs(thinker.model, encoded)

    # What each architecture's parts are asked, in the stages' terms (a Sampling carries the params).

    @abstractmethod
    def think(
        self, thinker: Any, ids: torch.Tensor, sampling: Sampling, on_token: Any, should_stop: Any, media: dict | None = None,
        for_talker: bool = True,
    ) -> Any:
        """The thinker's reply; `should_stop` may be a StopWatch (generation.StopWhen shows it each token);
        `media`: the prompt's encoded media (generate() arguments); `for_talker=False`: no stage reads the
        talker's inputs, so no hidden states are kept (the reply's ids alone)."""

    @abstractmethod
    def talk(self, talker: Any, payload: dict, sampling: Sampling, on_code: Any, should_stop: Any) -> Any:
        ...

    @abstractmethod
    def decode(self, decoder: Any, codes: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        ...

    def decode_many(self, decoder: Any, requests: list[tuple[torch.Tensor, Sampling]]) -> list[torch.Tensor]:
        """decode() of several requests (code2wav's Gather): in one call where the part allows it."""
        return [self.decode(decoder, codes, sampling) for codes, sampling in requests]

    @abstractmethod
    def stream_decoder(self, decoder: Any, sampling: Sampling) -> Any:
        """An object with `feed(codes) -> samples` and `finish() -> samples`, for one request, whose class has
        `feed_many([(stream, codes or None)])`: several requests' feed() (None: finish()) in one call."""

    @staticmethod
    def decode_chunks(items: list[tuple[Any, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Streamed chunks of several requests (code2wav's stream Gather) in one call: `stream_decoder()`s'."""
        return type(items[0][0]).feed_many(items)

    def check_prompt(self, thinker: Any, tokens: int) -> None:
        """InvalidInput (4xx) when a prompt of `tokens` does not fit the thinker's context or the stage's
        `max_prompt_tokens`: checked before any compute."""
        check_prompt(tokens, context=thinker.context, limit=self.spec.max_prompt_tokens, who="prompt too long")

    #: The thinker's hidden states (layers) that each decode step keeps for the talker's inputs.
    thinker_step_layers: tuple[int, ...] = ()

    def think_begin(
        self, thinker: Any, ids: torch.Tensor, sampling: Sampling, should_stop: Any, media: dict | None = None,
        for_talker: bool = True,
    ) -> Any:
        """A request made ready for the thinker's running batch (omni_mesh.engines.thinker_batch, in the
        model thread): its prompt checked (a text prompt, media None or {}, within one prefill piece is left
        to the batch, which prefills those that join together in one forward; any other prefilled here), the
        settings think() would hand to generate()."""
        from omni_mesh.engines.generation import sampling_kwargs
        from omni_mesh.engines.thinker_batch import Begun

        chunk = None if not media and 1 < int(ids.shape[-1]) <= self.spec.prefill_tokens else self.spec.prefill_tokens
        prepared, output = self._think_prepare(thinker, ids, sampling, should_stop, media, chunk, for_talker)
        generation = {**sampling_kwargs(sampling.temperature, sampling.top_p), **decoding_args(sampling, int(ids.shape[-1]))}
        return Begun(prepared, generation, sampling.seed, sampling.max_tokens, frozenset(self.eos_token_ids(thinker)),
                     output, saw=getattr(should_stop, "saw", None), lock=getattr(thinker, "lock", None))

    def _think_prepare(self, thinker: Any, ids: torch.Tensor, sampling: Sampling, should_stop: Any,
                       media: dict | None, chunk: int | None, for_talker: bool) -> tuple[Any, Any]:
        """(the thinker's Prepared, output(prepared, sequences, steps) -> the result as think() returns it);
        `chunk`: the prefill's piece (None: no prefill)."""
        raise NotImplementedError(f"{self.arch}: no batched thinker")

    def batch_engine(self, loaded: Any, part: str, *, for_talker: bool = True) -> Any:
        """The `batching.Engine` of a part that batches its requests (its model loaded), else None; a
        thinker not `for_talker` keeps no step's hidden states."""
        from omni_mesh.engines.thinker_batch import ThinkerBatch

        layers = self.thinker_step_layers if for_talker else ()
        return ThinkerBatch(loaded.model, layers) if part == "thinker" else None

    def talk_begin(self, talker: Any, payload: dict, sampling: Sampling, should_stop: Any) -> Any:
        """A request made ready for the talker's running batch (as think_begin for the thinker)."""
        raise NotImplementedError(f"{self.arch}: no batched talker")

    def _prefill_args(self) -> dict[str, Any]:
        """A talker's: its input in pieces of `prefill_tokens`, at most `max_prompt_tokens` of it."""
        return {"prefill_chunk": self.spec.prefill_tokens, "max_input_tokens": self.spec.max_prompt_tokens}

    @staticmethod
    def seed(seed: int | None) -> None:
        if seed is not None:
            torch.manual_seed(seed)

    @staticmethod
    def eos_token_ids(thinker: Any) -> list[int]:
        return list(thinker.eos_token_ids)

    @abstractmethod
    def reply_ids(self, output: Any) -> torch.Tensor:
        ...

    @abstractmethod
    def talker_payload(self, output: Any) -> dict:
        ...

    def code_stop_ids(self, talker: Any) -> list[int]:
        return []

    @staticmethod
    def codes_tensor(codes: list[Any]) -> torch.Tensor:
        """Codes the talker made (ints, or [1, groups] frames) as one int64 tensor [n] or [n, groups]."""
        if codes and isinstance(codes[0], torch.Tensor):
            return torch.cat([c.reshape(-1) if c.dim() <= 1 else c for c in codes]).to(torch.int64)
        return torch.tensor(codes, dtype=torch.int64)

    @staticmethod
    def join_codes(chunks: list[torch.Tensor]) -> torch.Tensor:
        if not chunks:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.as_tensor(c) for c in chunks]).to(torch.int64)

    @staticmethod
    def code_frames(codes: Any) -> int:
        return int(torch.as_tensor(codes).shape[0])
