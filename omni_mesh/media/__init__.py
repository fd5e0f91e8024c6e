"""Media in requests: content parts parsed, checked and decoded; torch-free (numpy, Pillow, PyAV).

THE CANONICAL PART (what an engine reads; `engines.text.chat_messages(inputs, media=True)` returns
messages whose content is a list of these, in the client's order):

    {"type": "text",  "text": str}
    {"type": "audio", "data": bytes, "format": "wav" | "mp3" | "flac" | "ogg"}
    {"type": "image", "data": bytes, "format": "png" | "jpeg" | "gif" | "webp" | "bmp"}
    {"type": "video", "data": bytes, "format": "mp4" | "webm"}

`data` is the file's bytes (base64 decoded; a remote URL already fetched by the coordinator) and
`format` what the bytes are (sniffed, and equal to what the client declared). The coordinator has
checked each part cheaply (probe: base64, format, header dimensions, duration and frame count,
truncation) before admitting the request; the engine decodes:

    decode_audio(data, fmt, rate=16000) -> float32 mono samples at `rate`
    decode_image(data, fmt)             -> uint8 RGB [H, W, 3]
    decode_video(data, fmt)             -> Video(frames uint8 [T, H, W, 3], fps, audio float32 | None, audio_rate)

Every failure is a MediaError (an InvalidInput: a stage raising it answers 422); its message says what
is wrong with the part, and callers put where the part is in front (`messages[0].content[1]: ...`).
Limits (MediaLimits) come from the environment, the same in the coordinator and the stages.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from omni_mesh.media.errors import MediaError
from omni_mesh.media.limits import MediaLimits
from omni_mesh.media.parts import CANONICAL, MEDIA_PARTS, canonical
from omni_mesh.media.sniff import sniff

# PyAV and Pillow load on first use: parsing and checking parts' shape needs neither.
_LAZY = {
    "DEFAULT_RATE": "containers", "Video": "containers", "decode_audio": "containers", "decode_video": "containers",
    "probe_audio": "containers", "probe_video": "containers", "decode_image": "image", "probe_image": "image",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"omni_mesh.media.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'omni_mesh.media' has no attribute {name!r}")


__all__ = [
    "CANONICAL", "DEFAULT_RATE", "MEDIA_PARTS", "MediaError", "MediaLimits", "Video", "canonical", "decode",
    "decode_audio", "decode_image", "decode_video", "probe", "sniff",
]


def probe(kind: str, data: bytes, fmt: str, limits: MediaLimits) -> None:
    """The cheap checks of one part's bytes (no pixels, no samples decoded); MediaError if it fails one."""
    from omni_mesh.media import containers, image

    if kind == "image":
        image.probe_image(data, fmt, limits)
    elif kind == "audio":
        containers.probe_audio(data, fmt, limits)
    else:
        containers.probe_video(data, fmt, limits)


def decode(part: dict, limits: MediaLimits | None = None):  # noqa: ANN201 - ndarray or Video
    """A canonical media part decoded: audio samples at DEFAULT_RATE, image pixels, or a Video."""
    from omni_mesh.media import containers, image

    kind, data, fmt = part["type"], part["data"], part["format"]
    if kind == "audio":
        return containers.decode_audio(data, fmt, containers.DEFAULT_RATE, limits)
    if kind == "image":
        return image.decode_image(data, fmt, limits)
    return containers.decode_video(data, fmt, limits)
