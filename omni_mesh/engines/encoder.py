"""The thinker's audio and vision towers, on their own: processor output in, embeddings out.

`Towers` runs the library's own `get_audio_features` / `get_image_features` / `get_video_features` (the
thinker model's methods, on an object that holds only the towers), one media item at a time so that each
item's embeddings can be cached by a hash of its features (`EncoderCache`). What it returns, `Encoded`,
is everything the thinker needs instead of the media (the payload of the encoder -> thinker edge):

    input_ids              int64 [P]     the prompt, placeholders expanded by the processor
    audio_embeds           [Na, H]       per audio placeholder, in order; audio_lengths int64 [n] (mel frames:
                                         the thinker's 3-D positions read them)
    image_embeds           [Ni, H]       image_grid_thw int64 [n, 3]
    video_embeds           [Nv, H]       video_grid_thw int64 [n, 3], video_second_per_grid float [n]
    image_deepstack, video_deepstack  [L, N, H]  Qwen3-Omni: the vision tower's deepstack features
    use_audio_in_video     bool
Kinds a request has none of are absent. The thinker side is `omni_mesh.engines.media_inputs`.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from omni_mesh.engines.checkpoint import load_part
from omni_mesh.engines.processor import Processed

#: Per architecture: the thinker model class whose encoding methods run here, and the tower classes.
_CLASSES = {
    "qwen2_5_omni": (
        "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni",
        "Qwen2_5OmniThinkerModel", "Qwen2_5OmniAudioEncoder", "Qwen2_5OmniVisionEncoder",
    ),
    "qwen3_omni_moe": (
        "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
        "Qwen3OmniMoeThinkerModel", "Qwen3OmniMoeAudioEncoder", "Qwen3OmniMoeVisionEncoder",
    ),
}
AUDIO_PREFIX, VISION_PREFIX = "thinker.audio_tower.", "thinker.visual."


class EncoderCache:
    """Embeddings by content hash, least recently used out first; counts hits and misses."""

    def __init__(self, max_items: int = 256) -> None:
        self.max_items = max_items
        self.items: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        with self._lock:
            found = self.items.get(key)
            if found is None:
                self.misses += 1
                return None
            self.items.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: str, value: dict[str, torch.Tensor]) -> None:
        if self.max_items <= 0:
            return
        with self._lock:
            self.items[key] = value
            self.items.move_to_end(key)
            while len(self.items) > self.max_items:
                self.items.popitem(last=False)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "items": len(self.items)}


class _TowersOnly(torch.nn.Module):
    """What the thinker model's encoding methods read of `self`: the towers and the thinker's config."""

    def __init__(self, audio_tower: Any, visual: Any, config: Any) -> None:
        super().__init__()
        self.audio_tower = audio_tower
        self.visual = visual
        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size


class Towers:
    """Audio and vision towers: a thinker's own (`of_thinker`) or loaded alone (`load`)."""

    def __init__(self, holder: Any, model_class: Any, arch: str, cache: EncoderCache | None = None) -> None:
        self.holder = holder  # has .audio_tower, .visual, .config
        self.model_class = model_class  # whose get_*_features run with `holder` as self
        self.arch = arch
        self.cache = cache if cache is not None else EncoderCache()

    @classmethod
    def load(cls, model_dir: Path, thinker_config: Any, arch: str, dtype: torch.dtype, device: str,
             cache: EncoderCache | None = None) -> Towers:
        """The towers alone: only `thinker.audio_tower.` and `thinker.visual.` tensors are read."""
        import importlib

        module_name, model_name, audio_name, vision_name = _CLASSES[arch]
        module = importlib.import_module(module_name)
        audio = load_part(getattr(module, audio_name), thinker_config.audio_config, model_dir, AUDIO_PREFIX,
                          dtype=dtype, device=device)
        visual = load_part(getattr(module, vision_name), thinker_config.vision_config, model_dir, VISION_PREFIX,
                           dtype=dtype, device=device)
        return cls(_TowersOnly(audio, visual, thinker_config), getattr(module, model_name), arch, cache)

    @classmethod
    def of_thinker(cls, thinker_model: Any, arch: str, cache: EncoderCache | None = None) -> Towers:
        """A loaded thinker's own towers (`...ThinkerForConditionalGeneration`): nothing is loaded again."""
        core = thinker_model.model
        return cls(core, type(core), arch, cache)

    @property
    def device(self) -> torch.device:
        return next(self.holder.audio_tower.parameters()).device

    @torch.no_grad()
    def encode(self, processed: Processed) -> dict[str, Any]:
        """The processor's output -> `Encoded` (module docstring), item by item through the cache."""
        features = processed.features
        encoded: dict[str, Any] = {"input_ids": features["input_ids"][0].to(torch.long)}
        if "input_features" in features:
            encoded.update(self._audio(features["input_features"], features["feature_attention_mask"]))
        for kind, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            if pixels in features:
                encoded.update(self._vision(kind, features[pixels], features[f"{kind}_grid_thw"]))
        if "video_second_per_grid" in features:
            encoded["video_second_per_grid"] = torch.as_tensor(features["video_second_per_grid"], dtype=torch.float32)
        encoded["use_audio_in_video"] = processed.use_audio_in_video
        return encoded

    def _audio(self, input_features: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        embeds, lengths = [], mask.sum(-1).to(torch.long)
        for i in range(input_features.shape[0]):
            one, one_mask = input_features[i : i + 1], mask[i : i + 1]
            frames = int(lengths[i])
            key = _key("audio", one[..., :frames])
            hit = self.cache.get(key)
            if hit is None:
                out = self.model_class.get_audio_features(
                    self.holder, one.to(self.device, self.holder.audio_tower.dtype), one_mask.to(self.device),
                    return_dict=True,
                )
                hit = {"embeds": out.last_hidden_state.cpu()}
                self.cache.put(key, hit)
            embeds.append(hit["embeds"])
        return {"audio_embeds": torch.cat(embeds), "audio_lengths": lengths}

    def _vision(self, kind: str, pixels: torch.Tensor, grids: torch.Tensor) -> dict[str, torch.Tensor]:
        method = getattr(self.model_class, f"get_{kind}_features")
        embeds, deepstack, start = [], [], 0
        for grid in grids:
            rows = int(grid.prod())
            one, start = pixels[start : start + rows], start + rows
            key = _key(kind, one, grid)
            hit = self.cache.get(key)
            if hit is None:
                out = method(self.holder, one.to(self.device), grid.reshape(1, 3).to(self.device), return_dict=True)
                hit = {"embeds": out.pooler_output[0].cpu()}
                if getattr(out, "deepstack_features", None) is not None:  # Qwen3: one per deepstack layer
                    hit["deepstack"] = torch.stack([layer[0] for layer in out.deepstack_features]).cpu()
                self.cache.put(key, hit)
            embeds.append(hit["embeds"])
            if "deepstack" in hit:
                deepstack.append(hit["deepstack"])
        out = {f"{kind}_embeds": torch.cat(embeds), f"{kind}_grid_thw": grids.to(torch.long)}
        if deepstack:
            out[f"{kind}_deepstack"] = torch.cat(deepstack, dim=1)
        return out


def _key(kind: str, *tensors: torch.Tensor) -> str:
    """A content hash of one item's features (what its embeddings depend on, with the weights)."""
    digest = hashlib.sha256(kind.encode())
    for tensor in tensors:
        tensor = tensor.contiguous().cpu()
        digest.update(str((tuple(tensor.shape), str(tensor.dtype))).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
