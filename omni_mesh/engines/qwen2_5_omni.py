"""Qwen2.5-Omni split into its three parts, each loading only its own weights: the thinker (text),
the talker (codec codes) and token2wav (DiT + BigVGAN: waveform). Together they compute what
`Qwen2_5OmniForConditionalGeneration.generate()` computes in one call, so a mesh of three stages
answers as the one-process model does (tests/test_engines_qwen2_5_omni.py checks it).

What travels thinker -> talker (`ThinkerOutput`): the prompt and reply ids, the talker's input rows
(layer-0 embedding + last hidden state, summed as generate() sums them) for the prompt [P, H] and the
reply [R-1, H] (the last token never goes back through the thinker), and the thinker's embeddings of
the three text tokens the talker needs (the speaker's bos, eos, pad: [3, H]) so the talker never
loads the thinker's embedding table. talker -> token2wav: int64 codes [n], 50 per second of audio.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    Qwen2_5OmniConfig,
    Qwen2_5OmniTalkerForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniToken2WavModel,
    SuppressTokensLogitsProcessor,
)

from omni_mesh.engines.checkpoint import CheckpointError, load_part
from omni_mesh.engines.dit_mask import compact_mask
from omni_mesh.engines.generation import sampling_kwargs, streaming
from omni_mesh.engines.prefill import (
    DEFAULT_CHUNK,
    Prepared,
    check_prompt,
    new_cache,
    prefill,
    thinker_prefill,
    whole_prompt,
)
from omni_mesh.engines.speaker_once import speaker_once

SAMPLE_RATE = 24_000
#: generate()'s talker defaults (its signature): sampling and the repetition penalty it applies even greedy.
TALKER_TOP_K = 40
TALKER_REPETITION_PENALTY = 1.05
SPEAKERS_FILE = "spk_dict.pt"
DEFAULT_SPEAKER = "Chelsie"  # generate()'s default


def load_config(model_dir: Path) -> Qwen2_5OmniConfig:
    return Qwen2_5OmniConfig.from_pretrained(str(model_dir))


def load_speakers(model_dir: Path) -> dict[str, dict[str, Any]]:
    """spk_dict.pt: per speaker its text bos token, speaker embedding (`cond`) and reference mel."""
    path = model_dir / SPEAKERS_FILE
    if not path.exists():
        raise CheckpointError(f"{model_dir}: no {SPEAKERS_FILE}: Qwen2.5-Omni's speakers are missing")
    return torch.load(path, weights_only=True)  # tensors and ints only: weights_only refuses anything else


def speaker_entry(speakers: dict[str, dict[str, Any]], name: str | None) -> dict[str, Any]:
    name = name or DEFAULT_SPEAKER
    if name not in speakers:
        from omni_mesh.errors import InvalidInput

        raise InvalidInput(f"param 'speaker': {name!r} is not a speaker of this model; speakers: {sorted(speakers)}")
    return speakers[name]


@dataclass
class ThinkerOutput:
    """Everything the talker needs from the thinker (module docstring)."""

    prompt_ids: torch.Tensor  # int64 [P]
    reply_ids: torch.Tensor  # int64 [R]
    prompt_rows: torch.Tensor  # [P, H]: embedding + hidden state of each prompt token
    reply_rows: torch.Tensor  # [R-1, H]: the same for the reply tokens fed back into the thinker
    text_embeds: torch.Tensor  # [3, H]: the speaker's text bos, text eos, text pad embeddings
    text_bos_token: int  # the speaker's text bos id (the talker's text ids start the reply with it)

    def to_payload(self) -> dict[str, torch.Tensor]:
        return dict(vars(self))

    @classmethod
    def from_payload(cls, payload: dict) -> ThinkerOutput:
        try:
            return cls(**{name: payload[name] for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise ValueError(f"talker input lacks {exc.args[0]!r}: is the upstream stage a Qwen2.5-Omni thinker?") from None


@dataclass
class TextReply:
    """A thinker's reply when no stage reads the talker's inputs (a text-only mesh): its ids alone."""

    reply_ids: torch.Tensor  # int64 [R]


class Thinker:
    """The thinker alone: prompt ids in, reply ids streamed out, plus what the talker needs."""

    def __init__(self, model: Any, config: Qwen2_5OmniConfig, speakers: dict[str, dict[str, Any]]) -> None:
        self.model = model
        self.config = config
        self.speakers = speakers
        self.context = config.thinker_config.text_config.max_position_embeddings

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: str, skip: tuple[str, ...] = ()) -> Thinker:
        """`skip`: the towers' prefixes when an encoder stage runs them (`omni_mesh.engines.encoder`)."""
        config = load_config(model_dir)
        model = load_part(
            Qwen2_5OmniThinkerForConditionalGeneration, config.thinker_config, model_dir, "thinker.",
            dtype=dtype, device=device, skip=skip,
        )
        return cls(model, config, load_speakers(model_dir))

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        speaker: str | None = None,
        on_token: Callable[[int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        prefill_chunk: int | None = DEFAULT_CHUNK,
        options: dict[str, Any] | None = None,
        media: dict[str, Any] | None = None,
        for_talker: bool = True,
    ) -> ThinkerOutput | TextReply:
        """The reply; `prefill_chunk` tokens of the prompt at a time, the stop flag checked between
        (None: the prompt in one call, as generate() alone does it). `media`: generate() arguments for the
        prompt's encoded media (`media_inputs.thinker_kwargs`): such a prompt goes in one call.
        `for_talker=False`: the reply's ids alone (no hidden states kept)."""
        bos_token = speaker_entry(self.speakers, speaker)["bos_token"]
        prepared = self.prepare(prompt_ids, should_stop=should_stop, prefill_chunk=prefill_chunk, media=media,
                                for_talker=for_talker)
        result = self.model.generate(
            input_ids=prepared.input_ids,
            max_new_tokens=max_tokens,
            return_dict_in_generate=True,
            **prepared.kwargs,
            **streaming(on_token, should_stop),
            **sampling_kwargs(temperature, top_p),
            **(options or {}),  # generation.decoding_args: top_k, penalties, ...
        )
        if not for_talker:
            return self.text_reply(prepared.input_ids, result.sequences)
        return self.output(prepared.input_ids, result.sequences, result.hidden_states, prepared.hidden, bos_token)

    def prepare(
        self, prompt_ids: torch.Tensor, *, should_stop: Callable[[], bool] | None, prefill_chunk: int | None,
        media: dict[str, Any] | None, for_talker: bool = True,
    ) -> Prepared:
        """The prompt checked and (text only) prefilled in pieces but its last token; generate()'s arguments
        for the rest (hidden states kept `for_talker`: it reads layer 0 and the last of every step)."""
        input_ids = prompt_ids.reshape(1, -1).to(self.model.device)
        check_prompt(input_ids.shape[1], context=self.context, limit=None, who="Qwen2.5-Omni thinker")
        if media:  # chunked prefill does not take encoder outputs (yet): the prompt in one call
            prefill_chunk = None
        prefilled: dict[str, Any] = {}
        hidden: list[torch.Tensor] = []  # the prefilled tokens' embeddings and last hidden states
        if prefill_chunk is not None:
            prefilled, hidden = thinker_prefill(
                self.model, input_ids, chunk=prefill_chunk, should_stop=should_stop, layers=(0, -1) if for_talker else ()
            )
        return Prepared(input_ids, {"output_hidden_states": for_talker, **prefilled, **(media or {})}, hidden)

    @staticmethod
    def text_reply(input_ids: torch.Tensor, sequences: torch.Tensor) -> TextReply:
        return TextReply(reply_ids=sequences[0, input_ids.shape[1]:].cpu())

    def output(
        self, input_ids: torch.Tensor, sequences: torch.Tensor, steps: Any, hidden: list[torch.Tensor], bos_token: int,
    ) -> ThinkerOutput:
        """The talker's inputs from a generation: `sequences` [1, P + R], `steps` one tuple of hidden states
        per step (layer 0 first, the last layer last), `hidden` the prefilled tokens' (prefill.thinker_prefill)."""
        device = input_ids.device
        embeds = [whole_prompt(hidden, 0, steps[0][0])] + [step[0] for step in steps[1:]]
        last = [whole_prompt(hidden, 1, steps[0][-1])] + [step[-1] for step in steps[1:]]
        prompt_embeds = embeds[0][0].clone()
        # generate() blanks the embeddings of audio, image and video placeholders before the talker
        placeholders = (self.config.thinker_config.audio_token_index, self.config.thinker_config.image_token_index,
                        self.config.thinker_config.video_token_index)
        prompt_embeds[torch.isin(input_ids[0], torch.tensor(placeholders, device=device))] = 0
        prompt_rows = last[0][0] + prompt_embeds
        reply_rows = (torch.cat(last[1:], dim=1) + torch.cat(embeds[1:], dim=1))[0] if len(steps) > 1 else prompt_rows[:0]
        table = self.model.get_input_embeddings()
        text_tokens = torch.tensor([bos_token, self.config.talker_config.tts_text_end_token_id,
                                    self.config.talker_config.tts_text_pad_token_id], device=device)
        return ThinkerOutput(
            prompt_ids=input_ids[0].cpu(),
            reply_ids=sequences[0, input_ids.shape[1]:].cpu(),
            prompt_rows=prompt_rows.cpu(),
            reply_rows=reply_rows.cpu(),
            text_embeds=table(text_tokens).cpu(),
            text_bos_token=int(bos_token),
        )


class Talker:
    """The talker alone: the thinker's output in, codec codes streamed out."""

    def __init__(self, model: Any, config: Qwen2_5OmniConfig) -> None:
        self.model = model
        self.config = config
        talker = config.talker_config
        self.codec_pad, self.codec_eos = talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id
        self.codec_bos, self.codec_mask = talker.tts_codec_start_token_id, talker.tts_codec_mask_token_id
        # Ids the DiT cannot embed (past its codec table) would make token2wav fail; generate() can only
        # suppress codec bos, which a trained talker never emits anyway. The stop ids stay allowed.
        speech = config.token2wav_config.dit_config.num_embeds
        self.suppressed = [i for i in range(talker.vocab_size) if i >= speech and i not in (self.codec_pad, self.codec_eos)]
        if self.codec_bos not in self.suppressed:
            self.suppressed.append(self.codec_bos)
        self.context = talker.max_position_embeddings

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: str) -> Talker:
        config = load_config(model_dir)
        model = load_part(
            Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config, model_dir, "talker.",
            dtype=dtype, device=device,
        )
        return cls(model, config)

    @property
    def stop_ids(self) -> list[int]:
        return [self.codec_pad, self.codec_eos]

    def logits_processor(self) -> LogitsProcessorList:
        """What the talker stage passes to generate() (the reference test passes the same)."""
        return LogitsProcessorList([SuppressTokensLogitsProcessor(self.suppressed, device=self.model.device)])

    @torch.no_grad()
    def generate(
        self,
        thinker: ThinkerOutput | dict,
        *,
        max_codes: int,
        temperature: float = 0.9,
        top_p: float = 0.8,
        speaker: str | None = None,
        on_code: Callable[[int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        prefill_chunk: int | None = DEFAULT_CHUNK,
        max_input_tokens: int | None = None,
    ) -> torch.Tensor:
        """The codes (int64 [n], stop id excluded), as generate() builds the talker's inputs. The voice
        comes with the thinker's output (its text bos), so `speaker` changes nothing here. The input goes
        through in pieces of `prefill_chunk` rows (None: in one call), the stop flag checked between."""
        del speaker
        prepared = self.prepare(thinker, should_stop=should_stop, prefill_chunk=prefill_chunk,
                                max_input_tokens=max_input_tokens)
        result = self.model.generate(
            input_ids=prepared.input_ids, max_new_tokens=max_codes, **prepared.kwargs,
            **self.decoding(temperature, top_p), **streaming(on_code, should_stop),
        )
        return self.output(prepared, result)

    def prepare(
        self, thinker: ThinkerOutput | dict, *, should_stop: Callable[[], bool] | None, prefill_chunk: int | None,
        max_input_tokens: int | None,
    ) -> Prepared:
        """The talker's input as generate() builds it, checked and (but its last row) prefilled in pieces;
        generate()'s arguments for the rest. `extra["reply_part"]`: the rows each decode step adds."""
        if isinstance(thinker, dict):
            thinker = ThinkerOutput.from_payload(thinker)
        device, dtype = self.model.device, self.model.dtype
        prompt_ids = thinker.prompt_ids.to(device).reshape(1, -1)
        reply_ids = thinker.reply_ids.to(device).reshape(1, -1)
        prompt_rows = thinker.prompt_rows.to(device=device, dtype=dtype).unsqueeze(0)
        reply_rows = thinker.reply_rows.to(device=device, dtype=dtype).unsqueeze(0)
        bos_embed, eos_embed, pad_embed = thinker.text_embeds.to(device=device, dtype=dtype).unsqueeze(0).split(1, dim=1)
        bos_token = thinker.text_bos_token
        input_text_ids = torch.cat([prompt_ids, torch.tensor([[bos_token]], device=device), reply_ids[:, :1]], dim=1)
        input_ids = torch.cat(
            [torch.full_like(prompt_ids, self.codec_mask), torch.tensor([[self.codec_pad, self.codec_bos]], device=device)],
            dim=1,
        )
        inputs_embeds = torch.cat([prompt_rows, bos_embed, reply_rows[:, :1]], dim=1)
        reply_part = torch.cat([reply_rows[:, 1:], eos_embed, pad_embed], dim=1)
        check_prompt(inputs_embeds.shape[1], context=self.context, limit=max_input_tokens, who="Qwen2.5-Omni talker")
        prefilled: dict[str, Any] = {}
        if prefill_chunk is not None:
            # generate() gives the talker no attention mask: its forward takes positions from the cache
            cache = new_cache(self.model)
            prefill(inputs_embeds.shape[1] - 1, chunk=prefill_chunk, should_stop=should_stop,
                    step=lambda start, end: self.model(inputs_embeds=inputs_embeds[:, start:end], cache=cache, use_cache=True))
            prefilled = {"cache": cache}
        kwargs = {"input_text_ids": input_text_ids, "thinker_reply_part": reply_part, "inputs_embeds": inputs_embeds,
                  "eos_token_id": self.stop_ids, "pad_token_id": self.codec_pad, **prefilled}
        return Prepared(input_ids, kwargs, extra={"reply_part": reply_part})

    def decoding(self, temperature: float, top_p: float) -> dict[str, Any]:
        """generate()'s sampling arguments for the talker: the request's temperature and top_p, the
        model's top-k and repetition penalty, the codes the DiT cannot embed suppressed."""
        return {"repetition_penalty": TALKER_REPETITION_PENALTY, "logits_processor": self.logits_processor(),
                **sampling_kwargs(temperature, top_p, TALKER_TOP_K)}

    def output(self, prepared: Prepared, sequences: torch.Tensor, steps: Any = None) -> torch.Tensor:
        """The codes of a generation's `sequences` [1, P + 2 + n], up to the first stop id."""
        codes = sequences[0, prepared.input_ids.shape[1]:]
        stops = torch.isin(codes, torch.tensor(self.stop_ids, device=codes.device)).nonzero()
        return (codes[: int(stops[0])] if len(stops) else codes).cpu()


class Token2Wav:
    """token2wav alone (float32, as generate() runs it): codes in, 24 kHz waveform out.

    Its DiT decodes the whole code sequence from noise drawn with torch's global generator, so a seeded
    decode (seed, then decode, under `lock`) reproduces generate()'s waveform for the same codes.
    """

    lock = threading.Lock()  # the global generator's seed and its draw go together

    def __init__(self, model: Any, speakers: dict[str, dict[str, Any]], num_steps: int = 10) -> None:
        self.model = model
        self.speakers = speakers
        self.num_steps = num_steps
        self.samples_per_code = model.config.dit_config.repeats * _hop_length(model.config.bigvgan_config)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: str, num_steps: int = 10) -> Token2Wav:
        del dtype  # token2wav runs in float32 whatever the stage's dtype
        config = load_config(model_dir)
        model = load_part(
            Qwen2_5OmniToken2WavModel, config.token2wav_config, model_dir, "token2wav.",
            dtype=torch.float32, device=device,
        )
        return cls(model, load_speakers(model_dir), num_steps)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, *, speaker: str | None = None, seed: int | None = None) -> torch.Tensor:
        """float32 waveform [samples] of `codes` (int64 [n]); empty for no codes."""
        if codes.numel() == 0:
            return torch.zeros(0)
        entry = speaker_entry(self.speakers, speaker)
        device = self.model.device
        dit = self.model.code2wav_dit_model
        with self.lock, compact_mask(dit), speaker_once(dit):
            if seed is not None:
                torch.manual_seed(seed)
            wav = self.model(
                codes.reshape(1, -1).to(device),
                conditioning=entry["cond"].to(device).float(),
                reference_mel=entry["ref_mel"].to(device).float(),
                num_steps=self.num_steps,
            )
        return wav.reshape(-1).float().cpu()


def _hop_length(bigvgan_config: Any) -> int:
    hop = 1
    for rate in bigvgan_config.upsample_rates:
        hop *= rate
    return hop
