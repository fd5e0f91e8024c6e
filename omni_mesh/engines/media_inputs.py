"""The thinker's side of the encoder: `Encoded` embeddings (omni_mesh.engines.encoder) -> the arguments
of the thinker's generate() that make it compute what it computes from the processor's raw features.

- The prompt keeps its `input_ids` (expanded): without them generate() falls back to 1-D positions.
- Audio embeddings are scattered into `inputs_embeds` at the audio placeholders, as the thinker's forward
  does; image and video go in as `mm_encoder_outputs` (the library's precomputed-encoder input), so the
  forward scatters them and, for Qwen3-Omni, adds their deepstack features to the first layers itself.
- Grids, seconds per grid and `feature_attention_mask` (rebuilt from the audio lengths) go along: the
  3-D rope positions are computed from them.
"""

from __future__ import annotations

from typing import Any

import torch

ENCODED_KEY = "encoded"  # the encoder stage's output: {"encoded": Encoded}


def prompt_ids(encoded: dict[str, Any]) -> torch.Tensor:
    """The expanded prompt, int64 [1, P]."""
    return torch.as_tensor(encoded["input_ids"]).reshape(1, -1).to(torch.long)


def thinker_kwargs(thinker_model: Any, encoded: dict[str, Any]) -> dict[str, Any]:
    """generate() arguments for `thinker_model` (a `...ThinkerForConditionalGeneration`) from `Encoded`,
    besides `input_ids` (`prompt_ids(encoded)`, which the caller passes)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    device = thinker_model.device
    config = thinker_model.config
    input_ids = prompt_ids(encoded).to(device)
    thinker_model.model.rope_deltas = None  # per-call state of the model object: never the last request's
    table = thinker_model.get_input_embeddings()
    inputs_embeds = table(input_ids)
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(input_ids),
        "use_audio_in_video": bool(encoded.get("use_audio_in_video", False)),
    }
    if "audio_embeds" in encoded:
        audio = encoded["audio_embeds"].to(device, inputs_embeds.dtype)
        mask = (input_ids == _token_id(config, "audio")).unsqueeze(-1).expand_as(inputs_embeds)
        if int(mask[..., 0].sum()) != audio.shape[0]:
            raise ValueError(f"thinker: {int(mask[..., 0].sum())} audio placeholders but {audio.shape[0]} audio embeddings")
        inputs_embeds = inputs_embeds.masked_scatter(mask, audio)
        lengths = torch.as_tensor(encoded["audio_lengths"], dtype=torch.long)
        frames = torch.arange(int(lengths.max())).unsqueeze(0)
        kwargs["feature_attention_mask"] = (frames < lengths.unsqueeze(1)).to(device=device, dtype=torch.long)
    outputs = {}
    for kind in ("image", "video"):
        if f"{kind}_embeds" not in encoded:
            continue
        grids = torch.as_tensor(encoded[f"{kind}_grid_thw"], dtype=torch.long).to(device)
        sizes = (grids.prod(-1) // thinker_model.model.spatial_merge_size**2).tolist()
        embeds = encoded[f"{kind}_embeds"].to(device)
        output = BaseModelOutputWithPooling(pooler_output=torch.split(embeds, sizes))
        if f"{kind}_deepstack" in encoded:
            output["deepstack_features"] = [torch.split(layer.to(device), sizes) for layer in encoded[f"{kind}_deepstack"]]
        outputs[kind] = output
        kwargs[f"{kind}_grid_thw"] = grids
    if outputs:
        kwargs["mm_encoder_outputs"] = outputs
    if "video_second_per_grid" in encoded:
        kwargs["video_second_per_grid"] = torch.as_tensor(encoded["video_second_per_grid"]).to(device)
    kwargs["inputs_embeds"] = inputs_embeds
    return kwargs


def _token_id(config: Any, kind: str) -> int:
    """The placeholder id of a kind (Qwen2.5 names it `*_token_index`, Qwen3 `*_token_id`)."""
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"thinker config names no {kind} placeholder token")
