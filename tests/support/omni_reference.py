"""The library's one-call `Qwen*ForConditionalGeneration.generate()` on a processor's outputs, greedy: the
reference a mesh's reply to a request with media is compared with (text, and the waveform)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_mesh import media

QUESTION = "What is this?"


class Reference:
    """One checkpoint's whole model and processor, loaded once."""

    def __init__(self, arch: str, checkpoint: Path) -> None:
        from transformers import (
            AutoProcessor,
            Qwen2_5OmniForConditionalGeneration,
            Qwen3OmniMoeForConditionalGeneration,
        )

        self.arch = arch
        self.processor = AutoProcessor.from_pretrained(str(checkpoint))
        whole = Qwen2_5OmniForConditionalGeneration if arch == "qwen2_5_omni" else Qwen3OmniMoeForConditionalGeneration
        self.model = whole.from_pretrained(str(checkpoint)).eval()

    def features(self, files: list[tuple[str, bytes, str]], *, use_audio_in_video: bool = False) -> dict[str, Any]:
        """The processor's outputs for one user message: the media `(kind, bytes, format)` in order, then
        QUESTION; the media decoded by omni_mesh.media, called here directly, not through the engines.
        `use_audio_in_video`: each video's audio track goes in too, as the library takes a decoded track
        (`load_audio_from_video` with one audio per slot, `audio_from_video_indices` naming its video)."""
        content = [{"type": kind} for kind, _, _ in files] + [{"type": "text", "text": QUESTION}]
        text = self.processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        kwargs: dict[str, Any] = {}
        tracks = []
        for kind, data, fmt in files:
            decoded = media.decode({"type": kind, "data": data, "format": fmt})
            if kind == "video":
                kwargs.setdefault("videos", []).append(decoded.frames)
                kwargs["videos_kwargs"] = {"fps": decoded.fps}
                tracks.append(decoded.audio)
            else:
                kwargs.setdefault({"audio": "audio", "image": "images"}[kind], []).append(decoded)
        if use_audio_in_video:
            clips = kwargs.get("audio", [])
            kwargs["audio_from_video_indices"] = [None] * len(clips) + list(range(len(tracks)))
            kwargs.update(audio=clips + tracks, load_audio_from_video=True)
        return dict(self.processor(text=text, return_tensors="pt", **kwargs))

    def generate(
        self, features: dict[str, Any], *, max_tokens: int, max_codes: int, seed: int, use_audio_in_video: bool = False
    ) -> tuple[str, np.ndarray | None]:
        """(reply text, waveform float32) of generate() greedy, every other argument at its default. Qwen3's
        waveform is None for audio with images or video: 5.25's talker fails on them (qwen3_omni.TALKER_GRID_KEYS),
        so only the thinker's text is the reference there."""
        ids = features["input_ids"]
        model = self.model
        torch.manual_seed(seed)
        with torch.no_grad():
            if self.arch == "qwen2_5_omni":
                from omni_mesh.engines.qwen2_5_omni import Talker

                talker = Talker(model.talker, model.config)  # the stage's suppression list and stop ids
                # 5.25 hands every shared argument to the talker too; pixels are the thinker's only
                dropped = {f"talker_{key}": None for key in ("pixel_values", "pixel_values_videos") if key in features}
                sequences, wav = model.generate(
                    **features, **dropped, use_audio_in_video=use_audio_in_video,
                    thinker_max_new_tokens=max_tokens, thinker_do_sample=False,
                    talker_do_sample=False, talker_max_new_tokens=max_codes, talker_eos_token_id=talker.stop_ids,
                    talker_logits_processor=talker.logits_processor(),
                )
            else:
                talks = "input_features" not in features or not {"pixel_values", "pixel_values_videos"} & set(features)
                out = model.generate(
                    **features, use_audio_in_video=use_audio_in_video, thinker_max_new_tokens=max_tokens,
                    thinker_eos_token_id=model.config.im_end_token_id, thinker_do_sample=False,
                    talker_do_sample=False, talker_max_new_tokens=max_codes + 1, return_audio=talks,
                )
                sequences, wav = out if talks else (out, None)  # the thinker's sequences alone
        text = self.processor.tokenizer.decode(sequences[0, ids.shape[1] :], skip_special_tokens=True)
        return text, None if wav is None else wav.reshape(-1).float().numpy()
