"""A checkpoint directory opened for one stage: which architecture it holds (`open_model`), and how
that architecture's parts are loaded and read (`Qwen2_5Omni`, `Qwen3Omni`, each a `ModelParts`: the
stage handlers stay the same for every model)."""

from __future__ import annotations

from typing import Any

import torch

from omni_mesh.engines.checkpoint import CheckpointError, read_config
from omni_mesh.engines.generation import decoding_args
from omni_mesh.engines.model_parts import ModelParts
from omni_mesh.engines.settings import ARCHS, EngineSpec, Sampling

__all__ = ["ARCHITECTURES", "ModelParts", "Qwen2_5Omni", "Qwen3Omni", "open_model"]


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
