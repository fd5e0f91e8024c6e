"""A request's messages as the checkpoint's chat template reads them, and the media they carry.

The template knows content parts of type `text`, `audio`, `image` and `video`; OpenAI's `input_audio`,
`audio_url`, `image_url` and `video_url` are the same parts under other names and are mapped to them.
Each media part keeps its place in the message (the template puts its placeholder there) and its
media goes into `Media`, in the order the processor pairs media with placeholders.

A media part holds its media decoded (numpy):
    {"type": "audio", "audio": float32 [samples] mono at 16 kHz}
    {"type": "image", "image": uint8 [H, W, 3] RGB}
    {"type": "video", "video": uint8 [T, H, W, 3], "fps": float, "audio": float32 [samples] (optional)}
or encoded: an OpenAI part as the coordinator passes it on (`input_audio`, `image_url`, ... with base64
data; the coordinator has checked it and inlined any remote URL), or `omni_mesh.media`'s canonical part
(`{"type", "data": bytes, "format"}`). Both are read and decoded by `omni_mesh.media` (the one decoder), here,
in the stage that runs the processor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_mesh.errors import InvalidInput

MEDIA_KINDS = ("audio", "image", "video")
#: OpenAI's part types -> the template's.
PART_TYPES = {"input_audio": "audio", "audio_url": "audio", "image_url": "image", "video_url": "video"}


@dataclass
class Video:
    frames: np.ndarray  # uint8 [T, H, W, 3]
    fps: float
    audio: np.ndarray | None = None  # float32 [samples] at 16 kHz


@dataclass
class Media:
    audios: list[np.ndarray] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.audios or self.images or self.videos)


def has_media(inputs: Any) -> bool:
    """Whether a request's inputs carry any media part (cheap: no decoding)."""
    if not isinstance(inputs, dict) or not isinstance(inputs.get("messages"), list):
        return False
    for message in inputs["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and PART_TYPES.get(p.get("type"), p.get("type")) in MEDIA_KINDS for p in content
        ):
            return True
    return False


def chat_and_media(inputs: Any) -> tuple[list[dict], Media, bool]:
    """(messages for the template, their media, use_audio_in_video asked by the inputs)."""
    from omni_mesh.engines.text import chat_messages

    if not has_media(inputs):
        return chat_messages(inputs), Media(), False
    media = Media()
    messages = []
    for index, message in enumerate(inputs["messages"]):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInput(f"inputs.messages[{index}] must have a string role")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidInput(f"inputs.messages[{index}].content must be a string or a list of parts")
        parts = [_part(part, media, f"inputs.messages[{index}].content[{n}]") for n, part in enumerate(content)]
        messages.append({"role": message["role"], "content": parts})
    return messages, media, audio_in_video(inputs)


def audio_in_video(inputs: Any, params: Any = None) -> bool:
    """vLLM's `mm_processor_kwargs.use_audio_in_video`: from the request's params (where the OpenAI route
    puts it) or its inputs (`/v1/requests` may send it either way); a value not a bool is refused."""
    for where, holder in (("params", params), ("inputs", inputs)):
        options = holder.get("mm_processor_kwargs") if isinstance(holder, dict) else None
        if options is None:
            continue
        if not isinstance(options, dict):
            raise InvalidInput(f"{where}.mm_processor_kwargs must be a mapping, got {type(options).__name__}")
        value = options.get("use_audio_in_video")
        if value is None:
            continue
        if not isinstance(value, bool):
            raise InvalidInput(f"{where}.mm_processor_kwargs.use_audio_in_video must be true or false, "
                               f"got {value!r}")
        return value
    return False


def _part(part: Any, media: Media, where: str) -> dict:
    if not isinstance(part, dict):
        raise InvalidInput(f"{where}: a content part must be a mapping with a type")
    if part.get("type") in PART_TYPES:  # an OpenAI part: its bytes, checked, as the canonical part
        part = _canonical(part, where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidInput(f"{where}: a text part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    if kind in MEDIA_KINDS and isinstance(part.get("data"), (bytes, bytearray, memoryview)):
        part = _decoded(kind, part, where)
    if kind == "audio":
        media.audios.append(_audio(part.get("audio"), where))
    elif kind == "image":
        media.images.append(_array(part.get("image"), where, "image", ndim=3, dtype=np.uint8))
    elif kind == "video":
        frames = _array(part.get("video"), where, "video", ndim=4, dtype=np.uint8)
        fps = part.get("fps")
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0:
            raise InvalidInput(f"{where}: a video part needs its frame rate ('fps' > 0), got {fps!r}")
        track = part.get("audio")
        media.videos.append(Video(frames, float(fps), None if track is None else _audio(track, where)))
    else:
        raise InvalidInput(f"{where}: part type {part.get('type')!r} is not one this model reads "
                           f"(text, audio, image, video, input_audio, image_url, video_url, audio_url)")
    return {"type": kind}


def _canonical(part: dict, where: str) -> dict:
    from omni_mesh import media

    try:
        return media.canonical(part)
    except media.MediaError as exc:
        raise InvalidInput(f"{where}: {exc}") from None


def _decoded(kind: str, part: dict, where: str) -> dict:
    """An encoded canonical part decoded (omni_mesh.media); its errors name the part."""
    from omni_mesh import media

    try:
        decoded = media.decode({"type": kind, "data": bytes(part["data"]), "format": part.get("format")})
    except media.MediaError as exc:
        raise InvalidInput(f"{where}: {exc}") from None
    if kind == "audio":
        return {"audio": decoded}
    if kind == "image":
        return {"image": decoded}
    return {"video": decoded.frames, "fps": decoded.fps, "audio": decoded.audio}


def _audio(value: Any, where: str) -> np.ndarray:
    clip = _array(value, where, "audio", ndim=1, dtype=np.float32)
    if len(clip) == 0:
        raise InvalidInput(f"{where}: the audio is empty")
    return clip


def _array(value: Any, where: str, kind: str, *, ndim: int, dtype: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidInput(f"{where}: the {kind} part was not decoded (got {type(value).__name__}, not an array)")
    if value.ndim != ndim or (ndim >= 3 and value.shape[-1] != 3):
        raise InvalidInput(f"{where}: a decoded {kind} must have {ndim} dimensions (RGB last), got {value.shape}")
    return np.ascontiguousarray(value, dtype=dtype)
