"""Qwen3-Omni's thinker alone: prompt ids in, reply ids streamed out, plus what the talker needs
(the dict described in omni_mesh.engines.qwen3_omni)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from omni_mesh.engines.checkpoint import load_part
from omni_mesh.engines.generation import sampling_kwargs, streaming
from omni_mesh.engines.prefill import DEFAULT_CHUNK, Prepared, check_prompt, thinker_prefill, whole_prompt
from omni_mesh.engines.qwen3_omni import TALKER_GRID_KEYS, load_config


class Qwen3OmniThinker:
    """The thinker alone: prompt ids in, reply ids streamed out, plus what the talker needs."""

    def __init__(self, model: Any, config: Qwen3OmniMoeConfig) -> None:
        self.model = model
        self.config = config
        # generate()'s thinker_eos_token_id defaults to the real model's <|im_end|>: this is that id here
        self.eos_token_ids = [config.im_end_token_id]
        self.context = config.thinker_config.text_config.max_position_embeddings
        self.lock = threading.Lock()  # the thinker keeps per-call state (rope deltas): one call at a time

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: str, skip: tuple[str, ...] = ()) -> Qwen3OmniThinker:
        """`skip`: the towers' prefixes when an encoder stage runs them (`omni_mesh.engines.encoder`)."""
        config = load_config(model_dir)
        model = load_part(
            Qwen3OmniMoeThinkerForConditionalGeneration, config.thinker_config, Path(model_dir), "thinker.",
            dtype=dtype, device=device, skip=skip,
        )
        return cls(model, config)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        on_token: Callable[[int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        for_talker: bool = True,
        prefill_chunk: int | None = DEFAULT_CHUNK,
        options: dict[str, Any] | None = None,
        media: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The reply (module docstring: the dict), made as generate() makes it. `for_talker=False`
        returns only `reply_ids` (a text-only stage: no hidden states are kept). The prompt goes through
        in pieces of `prefill_chunk` tokens (None: in one call), the stop flag checked between. `media`:
        generate() arguments for the prompt's encoded media (`media_inputs.thinker_kwargs`): such a prompt
        goes in one call."""
        if max_tokens < 1:
            raise ValueError(f"Qwen3-Omni thinker: max_tokens must be >= 1, got {max_tokens}")
        with self.lock:
            prepared = self.prepare(
                prompt_ids, should_stop=should_stop, prefill_chunk=prefill_chunk, media=media, for_talker=for_talker
            )
            result = self.model.generate(
                input_ids=prepared.input_ids,
                max_new_tokens=max_tokens,
                return_dict_in_generate=True,
                **prepared.kwargs,
                **streaming(on_token, should_stop),
                **sampling_kwargs(temperature, top_p),
                **(options or {}),  # generation.decoding_args: top_k, penalties, ...
            )
        return self.output(prepared, result.sequences, result.hidden_states)

    def prepare(
        self, prompt_ids: torch.Tensor, *, should_stop: Callable[[], bool] | None, prefill_chunk: int | None,
        media: dict[str, Any] | None, for_talker: bool = True,
    ) -> Prepared:
        """The prompt checked and (text only) prefilled in pieces but its last token; generate()'s arguments
        for the rest. Call under `lock` with the generation that follows (rope deltas are model state)."""
        device = self.model.device
        input_ids = prompt_ids.reshape(1, -1).to(device=device, dtype=torch.long)
        user = self._user_positions(input_ids[0]) if for_talker else None
        assistant_start = self._assistant_start(input_ids[0]) if for_talker else 0
        # hidden states only where the talker reads them (audio/image/video placeholders in user turns);
        # generate() keeps every layer of every step, which for a long reply of a big thinker is a lot
        placeholders = user is not None and bool(self._multimodal(input_ids[0][user]).any())
        check_prompt(input_ids.shape[1], context=self.context, limit=None, who="Qwen3-Omni thinker")
        if media:  # chunked prefill does not take encoder outputs (yet): the prompt in one call
            prefill_chunk = None
        layer = self.config.talker_config.accept_hidden_layer
        prefilled: dict[str, Any] = {}
        hidden: list[torch.Tensor] = []  # the prefilled tokens' hidden states of `layer`
        if prefill_chunk is not None:
            prefilled, hidden = thinker_prefill(
                self.model, input_ids, chunk=prefill_chunk, should_stop=should_stop,
                layers=(layer,) if placeholders else (),
            )
        kwargs = {"eos_token_id": self.eos_token_ids, "output_hidden_states": placeholders, **prefilled,
                  "use_audio_in_video": False, **(media or {})}
        extra = {"user": user, "assistant_start": assistant_start, "placeholders": placeholders, "media": media or {}}
        return Prepared(input_ids, kwargs, hidden, extra)

    def output(self, prepared: Prepared, sequences: torch.Tensor, steps: Any) -> dict[str, Any]:
        """The reply and the talker's inputs (module docstring of qwen3_omni) from a generation: `sequences`
        [1, P + R], `steps` one tuple of hidden states per step (only the first step's are read)."""
        input_ids, extra = prepared.input_ids, prepared.extra
        sequence = sequences[0]
        output: dict[str, Any] = {"reply_ids": sequence[input_ids.shape[1] :].cpu()}
        if extra["user"] is not None:
            layer = self.config.talker_config.accept_hidden_layer
            prompt_hidden = whole_prompt(prepared.hidden, 0, steps[0][layer])[0] if extra["placeholders"] else None
            output.update(self._talker_inputs(sequence, len(input_ids[0]), extra["user"], extra["assistant_start"],
                                              prompt_hidden))
            if not bool((input_ids == self.config.thinker_config.audio_token_id).any()):
                media = extra["media"]
                output.update({key: media[key].cpu() for key in TALKER_GRID_KEYS if key in media})
        return output

    def _assistant_start(self, ids: torch.Tensor) -> int:
        """Where the last `<|im_start|>assistant` is: the talker speaks from there."""
        starts = ((ids[:-1] == self.config.im_start_token_id) & (ids[1:] == self.config.assistant_token_id)).nonzero()
        if len(starts) == 0:
            raise ValueError(
                "Qwen3-Omni thinker: the prompt has no '<|im_start|>assistant' turn, which the talker speaks "
                "from; build the prompt with the chat template and add_generation_prompt=True"
            )
        return int(starts[-1])

    def _user_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """generate()'s user turns: the tokens whose latest <|im_start|> is followed by the user role id."""
        positions = torch.arange(len(ids), device=ids.device)
        im_start = torch.where(ids == self.config.im_start_token_id, positions, positions.new_full((), -1))
        role = ids[(torch.cummax(im_start, dim=0).values.clamp_min(0) + 1).clamp_max(len(ids) - 1)]
        return (role == self.config.user_token_id).nonzero().flatten()

    def _multimodal(self, ids: torch.Tensor) -> torch.Tensor:
        thinker = self.config.thinker_config
        media = [thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id]
        return torch.isin(ids, torch.tensor(media, device=ids.device))

    def _talker_inputs(
        self, sequence: torch.Tensor, prompt_length: int, user: torch.Tensor, assistant_start: int,
        prompt_hidden: torch.Tensor | None,
    ) -> dict[str, Any]:
        """The rows of the thinker's states that generate() hands to the talker, and nothing else."""
        table = self.model.get_input_embeddings()
        # generate() takes layer 0 of the hidden states: the embeddings of every token fed in, i.e. all
        # but the last one drawn (a lookup gives the same rows, without keeping every step's states)
        embeds = table(sequence[:-1])  # [P + R - 1, H]
        ids = sequence[:prompt_length]
        multimodal = self._multimodal(ids[user])
        user_rows = embeds[user]
        if prompt_hidden is not None:
            user_rows = torch.where(multimodal.unsqueeze(-1), prompt_hidden[user], user_rows)
        reply_ids = sequence[prompt_length:]
        eos = torch.isin(reply_ids, torch.tensor(self.eos_token_ids, device=sequence.device)).nonzero()
        config = self.config
        tts = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
                           device=sequence.device)
        return {
            "user_ids": ids[user].cpu(),
            "user_rows": user_rows.cpu(),
            "user_multimodal": multimodal.cpu(),
            "assistant_rows": embeds[assistant_start:].cpu(),
            "tts_rows": table(tts).cpu(),
            "text_end": int(eos[0]) if len(eos) else len(reply_ids),
        }
