"""Qwen3-Omni split into its three parts, each loading only its own weights: the thinker (text), the
talker (codec frames: its MoE decoder draws each frame's first code, its code predictor the others) and
code2wav (waveform). Together they compute what `Qwen3OmniMoeForConditionalGeneration.generate()`
computes in one call (tests/test_qwen3_omni_parts.py checks it, greedy).

What travels thinker -> talker (`qwen3_omni_thinker.Qwen3OmniThinker.generate()`'s dict; H = the thinker's hidden size,
tensors in the thinker's dtype, the talker casts them to its own):
    reply_ids         int64 [R]   the reply (the talker does not need it; the stage reports it)
    user_ids          int64 [U]   the prompt's ids in user turns (the talker's rope reads them)
    user_rows         [U, H]      per user-turn token: its embedding, or for an audio/image/video
                                  placeholder the hidden state of layer `accept_hidden_layer`
    user_multimodal   bool [U]    which user rows are placeholders (hidden states)
    assistant_rows    [A, H]      embeddings from the last `<|im_start|>assistant` to the last token fed
                                  back into the thinker (A = P - start + R - 1)
    tts_rows          [3, H]      the thinker's embeddings of tts bos, eos, pad (so the talker never loads
                                  the thinker's embedding table)
    text_end          int         index in the reply of the first thinker eos (R if none)
talker -> code2wav: int64 [T, G] codes, one row per frame (12.5 frames per second), G code groups.
code2wav: float32 waveform at 24 kHz, `samples_per_frame` (1920) samples per frame.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerForConditionalGeneration,
)

from omni_mesh.engines.checkpoint import CheckpointError, load_part, read_config
from omni_mesh.engines.generation import sampling_kwargs, streaming
from omni_mesh.engines.prefill import (
    DEFAULT_CHUNK,
    check_prompt,
    generation_positions,
    new_cache,
    prefill,
)

SAMPLE_RATE = 24_000
#: generate()'s talker defaults (its signature).
TALKER_TEMPERATURE = 0.9
TALKER_TOP_P = 1.0
TALKER_TOP_K = 50
TALKER_REPETITION_PENALTY = 1.05
DEFAULT_SPEAKER = "Ethan"
#: generate() suppresses the talker's top 1024 ids (its control ids) except codec eos.
TALKER_SUPPRESSED_TOP = 1024
#: generate() decodes in chunks of 300 frames (and loses samples at each boundary: see decode()).
REFERENCE_CHUNK_FRAMES = 300

#: The keys of the thinker's output the talker reads.
TALKER_INPUT_KEYS = (
    "user_ids", "user_rows", "user_multimodal", "assistant_rows", "tts_rows", "text_end",
)
#: The prompt's image and video grids, where it has any: the talker's 3-D positions read them, as in generate().
#: Not with audio in the prompt too: transformers 5.25's talker then fails placing it (it reads an audio_config
#: its config lacks), in generate() as here; without the grids it gets 1-D positions, and speaks.
TALKER_GRID_KEYS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid")


def load_config(model_dir: Path) -> Qwen3OmniMoeConfig:
    """The checkpoint's config; CheckpointError when the directory holds no Qwen3-Omni."""
    model_type = read_config(Path(model_dir)).get("model_type")
    if model_type != "qwen3_omni_moe":
        raise CheckpointError(f"{model_dir}: model_type {model_type!r} is not a Qwen3-Omni (qwen3_omni_moe)")
    return Qwen3OmniMoeConfig.from_pretrained(str(model_dir))


class Qwen3OmniMoeTalkerPart(Qwen3OmniMoeTalkerForConditionalGeneration):
    """The talker loaded on its own. Checkpoints store its MoE experts one by one; the whole model's
    loader fuses them (a conversion registered for model_type qwen3_omni_moe) but the talker's own
    model_type has none, so the same conversion is registered for this class name: nothing else
    (the whole model included) is affected."""


_REGISTER_LOCK = threading.Lock()


def _register_talker_conversion() -> None:
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    name = Qwen3OmniMoeTalkerPart.__name__
    with _REGISTER_LOCK:  # registering twice is an error
        if get_checkpoint_conversion_mapping(name) is None:
            mapping = get_checkpoint_conversion_mapping("qwen3_omni_moe")
            if mapping is not None:
                register_checkpoint_conversion_mapping(name, mapping)


class Qwen3OmniTalker:
    """The talker alone (with its code predictor): the thinker's output in, codec frames out."""

    def __init__(self, model: Any, config: Qwen3OmniMoeConfig) -> None:
        self.model = model
        self.config = config
        talker = config.talker_config
        self.num_code_groups = talker.num_code_groups
        self.codec_eos = talker.codec_eos_token_id
        vocab = talker.text_config.vocab_size
        self.suppressed = [i for i in range(vocab - TALKER_SUPPRESSED_TOP, vocab) if i != self.codec_eos]
        self.context = talker.text_config.max_position_embeddings
        self.lock = threading.RLock()  # per-call state (rope deltas, the code predictor's do_sample, a hook)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: str) -> Qwen3OmniTalker:
        config = load_config(model_dir)
        _register_talker_conversion()
        # generate() itself feeds the talker embeddings and penalises only codes it draws; say it once
        warnings.filterwarnings(
            "ignore", message=r"Passing `repetition_penalty` with `inputs_embeds`", category=UserWarning
        )
        model = load_part(
            Qwen3OmniMoeTalkerPart, config.talker_config, Path(model_dir), "talker.", dtype=dtype, device=device
        )
        return cls(model, config)

    @property
    def speakers(self) -> list[str]:
        return sorted(self.config.talker_config.speaker_id or {})

    def speaker_id(self, speaker: str | None) -> int:
        name = (speaker or DEFAULT_SPEAKER).lower()
        ids = self.config.talker_config.speaker_id or {}
        if name not in ids:
            from omni_mesh.errors import InvalidInput

            raise InvalidInput(
                f"param 'speaker': {speaker!r} is not a speaker of this model; speakers: {self.speakers}"
            )
        return int(ids[name])

    @torch.no_grad()
    def generate(
        self,
        thinker_output: dict[str, Any],
        *,
        max_codes: int,
        temperature: float = TALKER_TEMPERATURE,
        top_p: float = TALKER_TOP_P,
        speaker: str | None = None,
        on_codes: Callable[[torch.Tensor], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        prefill_chunk: int | None = DEFAULT_CHUNK,
        max_input_tokens: int | None = None,
    ) -> torch.Tensor:
        """int64 [T, G] codes, T <= max_codes, as generate() makes them; `on_codes` gets each frame
        ([1, G], on the CPU) as soon as the code predictor has completed it. Greedy when temperature is 0
        (the code predictor follows: generate() mirrors the talker's do_sample onto it). The input goes
        through in pieces of `prefill_chunk` rows (None: in one call), the stop flag checked between."""
        empty = torch.zeros(0, self.num_code_groups, dtype=torch.long)
        with self.lock:  # the prefill leaves rope deltas in the model that generate() reads
            prepared = self.prepare(thinker_output, speaker=speaker, max_codes=max_codes, should_stop=should_stop,
                                    prefill_chunk=prefill_chunk, max_input_tokens=max_input_tokens)
            if prepared is None:
                return empty
            frames: list[torch.Tensor] = []

            def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
                # each step after the prefill feeds back the last code drawn with the residual codes the
                # code predictor just drew for it: a finished frame, seen here before the step runs
                residual = kwargs.get("residual_codes")
                if residual is not None:
                    frame = residual[0:1].to("cpu", torch.long)
                    frames.append(frame)
                    if on_codes is not None:
                        on_codes(frame)

            hook = self.model.register_forward_pre_hook(before_forward, with_kwargs=True)
            try:
                self.model.generate(
                    **prepared,
                    # the last token drawn never gets its frame (its residual codes would be drawn next step)
                    max_new_tokens=max_codes + 1,
                    # each step reads the last step's hidden states (the code predictor's input)
                    output_hidden_states=True,
                    return_dict_in_generate=True,
                    **streaming(None, should_stop),  # frames come from the hook above
                    **self.decoding(temperature, top_p),
                )
            finally:
                hook.remove()
        return torch.cat(frames) if frames else empty

    def prepare(
        self, thinker_output: dict[str, Any], *, speaker: str | None, max_codes: int,
        should_stop: Callable[[], bool] | None, prefill_chunk: int | None, max_input_tokens: int | None,
    ) -> dict[str, Any] | None:
        """generate()'s inputs for the talker (checked, and all but the last 2 rows prefilled in pieces of
        `prefill_chunk`: the filled cache and the positions go with them); None when there is nothing to
        speak."""
        missing = [key for key in TALKER_INPUT_KEYS if key not in thinker_output]
        if missing:
            raise ValueError(f"Qwen3-Omni talker: the thinker's output lacks {missing}: is the upstream stage a "
                             "Qwen3-Omni thinker run with for_talker=True?")
        speaker_id = self.speaker_id(speaker)
        if len(thinker_output["assistant_rows"]) < 4 or max_codes <= 0:
            # the assistant turn's 3 tokens and at least one reply token fed back: a reply of one token
            # gives the talker nothing to speak (generate() fails on it)
            return None
        with self.lock:
            inputs = self._inputs(thinker_output, speaker_id)
            check_prompt(inputs["inputs_embeds"].shape[1], context=self.context, limit=max_input_tokens,
                         who="Qwen3-Omni talker")
            prefilled = self._prefill(inputs, prefill_chunk, should_stop) if prefill_chunk is not None else {}
        return {**inputs, **prefilled}

    def decoding(self, temperature: float, top_p: float) -> dict[str, Any]:
        """generate()'s sampling arguments for the talker: the request's temperature and top_p, the
        model's top-k and repetition penalty, its control ids suppressed, codec eos the stop."""
        return {"eos_token_id": self.codec_eos, "repetition_penalty": TALKER_REPETITION_PENALTY,
                "suppress_tokens": self.suppressed, **sampling_kwargs(temperature, top_p, TALKER_TOP_K)}

    def _prefill(self, inputs: dict[str, Any], chunk: int, should_stop: Callable[[], bool] | None) -> dict[str, Any]:
        """All but the last 2 input rows through the talker in pieces: its forward takes a call with more
        than one row for the prefill (and returns the step count generate() goes on with)."""
        embeds = inputs["inputs_embeds"]
        cache = new_cache(self.model)
        grids = {key: inputs[key] for key in TALKER_GRID_KEYS if key in inputs}  # the 3-D positions of media
        positions = generation_positions(self.model, embeds, talker_input_ids=inputs["talker_input_ids"], **grids)

        def step(start: int, end: int) -> None:
            self.model(inputs_embeds=embeds[:, start:end], position_ids=positions[..., start:end], cache=cache,
                       use_cache=True, talker_input_ids=inputs["talker_input_ids"], generation_step=-1)

        prefill(embeds.shape[1] - 2, chunk=chunk, should_stop=should_stop, step=step)
        return {"cache": cache, "position_ids": positions}

    def _inputs(self, thinker_output: dict[str, Any], speaker_id: int) -> dict[str, Any]:
        """The talker's prefill as generate() assembles it (`_get_talker_user_parts`,
        `_get_talker_assistant_parts`, the eos fix of the trailing text)."""
        model, config, talker = self.model, self.config, self.config.talker_config
        device, dtype = model.device, model.dtype
        hidden = talker.text_config.hidden_size

        def rows(key: str) -> torch.Tensor:
            return thinker_output[key].to(device=device, dtype=dtype).unsqueeze(0)

        user_rows, multimodal = rows("user_rows"), thinker_output["user_multimodal"].to(device).reshape(1, -1)
        user = torch.empty((1, user_rows.shape[1], hidden), device=device, dtype=dtype)
        if multimodal.any():
            user[multimodal] = model.hidden_projection(user_rows[multimodal])
        user[~multimodal] = model.text_projection(user_rows[~multimodal])

        tts_bos, tts_eos, tts_pad = model.text_projection(rows("tts_rows")).chunk(3, dim=1)  # 3 x [1, 1, D]
        assistant = model.text_projection(rows("assistant_rows"))
        text = torch.cat((assistant[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant[:, 3:4]), dim=1)
        codec_ids = torch.tensor([[talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id,
                                   speaker_id, talker.codec_pad_id, talker.codec_bos_id]], device=device)
        codec = torch.cat((torch.zeros((1, 3, hidden), device=device, dtype=dtype),
                           model.get_input_embeddings()(codec_ids)), dim=1)
        # one entry per talker step: reply token j + 1, then tts eos; past the thinker's eos, eos then pads
        trailing = torch.cat((assistant[:, 4:], tts_eos), dim=1)
        position = torch.arange(trailing.shape[1], device=device).reshape(1, -1, 1)
        text_end = int(thinker_output["text_end"])
        trailing = torch.where(position > text_end, tts_pad.to(trailing.dtype), trailing)
        trailing = torch.where(position == text_end, tts_eos.to(trailing.dtype), trailing)

        user_ids = thinker_output["user_ids"].to(device=device, dtype=torch.long).reshape(1, -1)
        assistant_ids = torch.full((1, text.shape[1]), config.tts_pad_token_id, dtype=torch.long, device=device)
        inputs_embeds = torch.cat((user, text + codec), dim=1)
        return {
            "inputs_embeds": inputs_embeds,
            "trailing_text_hidden": trailing,
            "tts_pad_embed": tts_pad,
            "talker_input_ids": torch.cat((user_ids, assistant_ids), dim=1),
            "attention_mask": torch.ones(inputs_embeds.shape[:2], dtype=torch.long, device=device),
            **{key: thinker_output[key].to(device) for key in TALKER_GRID_KEYS if key in thinker_output},
        }
