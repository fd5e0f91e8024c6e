"""A checkpoint directory opened for one stage: which architecture it holds, its tokenizer, and how
that architecture's parts are loaded and read (the stage handlers stay the same for every model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from omni_mesh.engines.checkpoint import CheckpointError, read_config
from omni_mesh.engines.generation import decoding_args
from omni_mesh.engines.prefill import check_prompt
from omni_mesh.engines.settings import ARCHS, EngineSpec, Sampling

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


class Qwen2_5Omni(ModelParts):
    """Thinker, talker, token2wav (omni_mesh.engines.qwen2_5_omni)."""

    arch = "qwen2_5_omni"

    def _config_class(self) -> Any:
        from transformers import Qwen2_5OmniConfig

        return Qwen2_5OmniConfig

    def _load(self, part: str, skip: tuple[str, ...] = ()) -> Any:
        from omni_mesh.engines import qwen2_5_omni as model

        if part == "thinker":
            return model.Thinker.load(self.directory, self.dtype, self.spec.device, skip)
        if part == "talker":
            return model.Talker.load(self.directory, self.dtype, self.spec.device)
        return model.Token2Wav.load(self.directory, self.dtype, self.spec.device, self.spec.num_steps)

    def think(
        self, thinker: Any, ids: torch.Tensor, sampling: Sampling, on_token: Any, should_stop: Any, media: dict | None = None,
        for_talker: bool = True,
    ) -> Any:
        return thinker.generate(
            ids, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            speaker=sampling.speaker, on_token=on_token, should_stop=should_stop, media=media,
            prefill_chunk=self.spec.prefill_tokens, options=decoding_args(sampling, int(ids.shape[-1])),
            for_talker=for_talker,
        )

    thinker_step_layers = (0, -1)  # the talker reads every step's embeddings and last hidden states

    def _think_prepare(self, thinker: Any, ids: torch.Tensor, sampling: Sampling, should_stop: Any,
                       media: dict | None, chunk: int | None, for_talker: bool) -> tuple[Any, Any]:
        from omni_mesh.engines.qwen2_5_omni import speaker_entry

        bos = speaker_entry(thinker.speakers, sampling.speaker)["bos_token"]
        prepared = thinker.prepare(ids, should_stop=should_stop, prefill_chunk=chunk, media=media, for_talker=for_talker)
        if not for_talker:
            return prepared, lambda p, sequences, steps: thinker.text_reply(p.input_ids, sequences)
        return prepared, lambda p, sequences, steps: thinker.output(p.input_ids, sequences, steps, p.hidden, bos)

    def batch_engine(self, loaded: Any, part: str, *, for_talker: bool = True) -> Any:
        from omni_mesh.engines.talker_batch import TalkerBatch

        return TalkerBatch(loaded.model) if part == "talker" else super().batch_engine(loaded, part, for_talker=for_talker)

    def talk_begin(self, talker: Any, payload: dict, sampling: Sampling, should_stop: Any) -> Any:
        from omni_mesh.engines.thinker_batch import Begun

        prepared = talker.prepare(payload, should_stop=should_stop, **self._prefill_args())
        return Begun(prepared, talker.decoding(sampling.temperature, sampling.top_p), sampling.seed,
                     sampling.max_audio_tokens, frozenset(talker.stop_ids), talker.output)

    def talk(self, talker: Any, payload: dict, sampling: Sampling, on_code: Any, should_stop: Any) -> Any:
        return talker.generate(
            payload, max_codes=sampling.max_audio_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            on_code=on_code, should_stop=should_stop, **self._prefill_args(),
        )

    def decode(self, decoder: Any, codes: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        return decoder.decode(codes, speaker=sampling.speaker, seed=sampling.seed)

    def decode_many(self, decoder: Any, requests: list[tuple[torch.Tensor, Sampling]]) -> list[torch.Tensor]:
        from omni_mesh.engines.token2wav_batch import decode_many

        return decode_many(decoder, [(codes, sampling.speaker, sampling.seed) for codes, sampling in requests])

    def stream_decoder(self, decoder: Any, sampling: Sampling) -> Any:
        from omni_mesh.engines.token2wav_stream import ChunkedDecode

        return ChunkedDecode(decoder, sampling.speaker, sampling.seed, self.spec.context_codes)

    def reply_ids(self, output: Any) -> torch.Tensor:
        return output.reply_ids

    def talker_payload(self, output: Any) -> dict:
        return output.to_payload()

    def code_stop_ids(self, talker: Any) -> list[int]:
        return talker.stop_ids


class Qwen3Omni(ModelParts):
    """Thinker, talker (with its code predictor: frames of code groups), code2wav (omni_mesh.engines.qwen3_omni,
    qwen3_omni_code2wav).
    code2wav is causal: streamed audio equals the one-shot decode, and needs no seed."""

    arch = "qwen3_omni_moe"

    def _config_class(self) -> Any:
        from transformers import Qwen3OmniMoeConfig

        return Qwen3OmniMoeConfig

    def _load(self, part: str, skip: tuple[str, ...] = ()) -> Any:
        from omni_mesh.engines import qwen3_omni as model
        from omni_mesh.engines.qwen3_omni_code2wav import Qwen3OmniCode2Wav

        if part == "thinker":
            from omni_mesh.engines.qwen3_omni_thinker import Qwen3OmniThinker

            return Qwen3OmniThinker.load(self.directory, self.dtype, self.spec.device, skip)
        if part == "talker":
            return model.Qwen3OmniTalker.load(self.directory, self.dtype, self.spec.device)
        return Qwen3OmniCode2Wav.load(self.directory, self.dtype, self.spec.device)

    def think(
        self, thinker: Any, ids: torch.Tensor, sampling: Sampling, on_token: Any, should_stop: Any, media: dict | None = None,
        for_talker: bool = True,
    ) -> Any:
        return thinker.generate(
            ids, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            on_token=on_token, should_stop=should_stop, media=media, for_talker=for_talker,
            prefill_chunk=self.spec.prefill_tokens, options=decoding_args(sampling, int(ids.shape[-1])),
        )

    def _think_prepare(self, thinker: Any, ids: torch.Tensor, sampling: Sampling, should_stop: Any,
                       media: dict | None, chunk: int | None, for_talker: bool) -> tuple[Any, Any]:
        prepared = thinker.prepare(ids, should_stop=should_stop, prefill_chunk=chunk, media=media, for_talker=for_talker)
        return prepared, thinker.output

    def talk(self, talker: Any, payload: dict, sampling: Sampling, on_code: Any, should_stop: Any) -> Any:
        return talker.generate(
            payload, max_codes=sampling.max_audio_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            speaker=sampling.speaker, on_codes=on_code, should_stop=should_stop, **self._prefill_args(),
        )

    def batch_engine(self, loaded: Any, part: str, *, for_talker: bool = True) -> Any:
        from omni_mesh.engines.qwen3_talker_batch import Qwen3TalkerBatch

        if part == "talker":
            return Qwen3TalkerBatch(loaded.model, loaded.codec_eos)
        return super().batch_engine(loaded, part, for_talker=for_talker)

    def talk_begin(self, talker: Any, payload: dict, sampling: Sampling, should_stop: Any) -> Any:
        import functools

        from omni_mesh.engines.prefill import Prepared
        from omni_mesh.engines.qwen3_talker_batch import frames_of
        from omni_mesh.engines.thinker_batch import Begun

        inputs = talker.prepare(payload, speaker=sampling.speaker, max_codes=sampling.max_audio_tokens,
                                should_stop=should_stop, **self._prefill_args())
        empty = torch.zeros(1, 0, dtype=torch.long)  # generate() of embeddings: no ids before the codes it draws
        # max_codes + 1 tokens, as talk() asks generate(): the last one drawn never gets its frame
        return Begun(None if inputs is None else Prepared(empty, inputs), talker.decoding(sampling.temperature, sampling.top_p),
                     sampling.seed, sampling.max_audio_tokens + 1, frozenset({talker.codec_eos}),
                     functools.partial(frames_of, talker.num_code_groups), lock=talker.lock)

    def decode(self, decoder: Any, codes: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        return decoder.decode(codes)

    def decode_many(self, decoder: Any, requests: list[tuple[torch.Tensor, Sampling]]) -> list[torch.Tensor]:
        return decoder.decode_many([codes for codes, _ in requests])  # code2wav needs no seed nor speaker

    def stream_decoder(self, decoder: Any, sampling: Sampling) -> Any:
        # decode each chunk as it arrives (the talker's first chunk is the short one)
        return decoder.stream(chunk_frames=1)

    def reply_ids(self, output: Any) -> torch.Tensor:
        return output["reply_ids"]

    def talker_payload(self, output: Any) -> dict:
        from omni_mesh.engines.qwen3_omni import TALKER_GRID_KEYS, TALKER_INPUT_KEYS

        return {key: output[key] for key in (*TALKER_INPUT_KEYS, *TALKER_GRID_KEYS) if key in output}


#: Architectures by config.json model_type.
ARCHITECTURES: dict[str, type[ModelParts]] = {"qwen2_5_omni": Qwen2_5Omni, "qwen3_omni_moe": Qwen3Omni}


def open_model(spec: EngineSpec) -> ModelParts:
    """The checkpoint a stage's engine names, with the parts class of its architecture."""
    if spec.threads is not None:  # process-wide: every part of this stage computes with this many
        torch.set_num_threads(spec.threads)
    directory = spec.model_dir()
    if not directory.is_dir():
        raise CheckpointError(f"engine.model {spec.model!r}: {directory} is not a directory")
    config = read_config(directory)
    arch = spec.arch or config.get("model_type")
    if arch not in ARCHITECTURES:
        known = ", ".join(ARCHS)
        raise CheckpointError(f"{directory}: model_type {arch!r} has no engine here; engines exist for: {known}")
    return ARCHITECTURES[arch](directory, spec, config)
