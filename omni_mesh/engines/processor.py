"""A request's messages and media through the checkpoint's own processor.

The processor (`AutoProcessor.from_pretrained` on the checkpoint directory, as a real checkpoint ships
it) is the authority on how media becomes tokens: the chat template renders one placeholder per
`audio` / `image` / `video` part, and the processor expands each into as many tokens as its features
make, next to the features themselves (`input_features`, `pixel_values`, `pixel_values_videos`, grids).
Nothing here counts placeholders.

Media parts arrive decoded (`omni_mesh.engines.media_parts`): audio float32 mono at 16 kHz, images
RGB uint8 [H, W, 3], videos uint8 [T, H, W, 3] with their fps and, for `use_audio_in_video`, their
audio track.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_mesh.engines.checkpoint import CheckpointError
from omni_mesh.engines.media_parts import MEDIA_KINDS, Media, chat_and_media
from omni_mesh.errors import InvalidInput


def load_processor(model_dir: Path) -> Any:
    """The checkpoint's processor; CheckpointError saying what is missing."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(model_dir))
    except (OSError, ValueError, ImportError) as exc:
        raise CheckpointError(f"{model_dir}: cannot load the checkpoint's processor: {exc}") from None
    if not hasattr(processor, "feature_extractor") or not hasattr(processor, "image_processor"):
        raise CheckpointError(
            f"{model_dir}: its processor ({type(processor).__name__}) takes no audio or images: the checkpoint "
            "ships no multimodal processor (processor_config.json, preprocessor_config.json)"
        )
    return processor


@dataclass
class Processed:
    """The processor's output for one request, and the media it came from (in the processor's order)."""

    features: dict[str, Any]  # input_ids [1, P], attention_mask, and per kind its features and grids
    media: Media = field(default_factory=Media)
    use_audio_in_video: bool = False


def process(processor: Any, inputs: Any, *, use_audio_in_video: bool | None = None) -> Processed:
    """A request's `inputs` (prompt or messages with media parts) -> the processor's tensors."""
    messages, media, in_video = chat_and_media(inputs)
    use_audio_in_video = bool(in_video if use_audio_in_video is None else use_audio_in_video)
    if use_audio_in_video and media.videos and any(v.audio is None for v in media.videos):
        raise InvalidInput("use_audio_in_video: a video part has no audio track")
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs: dict[str, Any] = {"text": text, "return_tensors": "pt"}
    audio = [clip for clip in media.audios]
    if media.images:
        kwargs["images"] = [image for image in media.images]
    if media.videos:
        kwargs["videos"] = [video.frames for video in media.videos]
        kwargs["videos_kwargs"] = {"fps": float(media.videos[0].fps)}
        if use_audio_in_video:
            # the audio slots: standalone clips first, then each video's track (the template has no
            # placeholder for a track: the processor interleaves it with the video's frames)
            kwargs["audio_from_video_indices"] = [None] * len(audio) + list(range(len(media.videos)))
            audio += [video.audio for video in media.videos]
            kwargs["load_audio_from_video"] = True
    if audio:
        kwargs["audio"] = audio
    features = dict(processor(**kwargs))
    return Processed(features, media, use_audio_in_video)


__all__ = ["MEDIA_KINDS", "Processed", "load_processor", "process"]
