"""OpenAI content parts -> the canonical part an engine reads.

Parts in (OpenAI's chat schema, and `/v1/requests` `inputs.messages`):
- `{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"|"mp3"|"flac"|"ogg"}}`
- `{"type": "image_url", "image_url": {"url": <data URL or http(s) URL>}}` (also `"image_url": "<url>"`)
- `{"type": "video_url", "video_url": {"url": ...}}`, `{"type": "audio_url", "audio_url": {"url": ...}}`

The canonical part (what `canonical()` returns, and `engines.text.chat_messages(..., media=True)` puts
in a message's content): `{"type": "audio"|"image"|"video", "data": <bytes>, "format": <name>}`, the
format sniffed from the bytes (sniff.py's names) and equal to what the client declared, if it declared one.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from omni_mesh.media.errors import MediaError
from omni_mesh.media.limits import MediaLimits
from omni_mesh.media.sniff import AUDIO_FORMATS, KINDS, kind_of, normalise, sniff

#: Content part types that carry media, and the kind each carries.
MEDIA_PARTS = {"input_audio": "audio", "audio_url": "audio", "image_url": "image", "video_url": "video"}
#: The canonical part types (the chat template's names).
CANONICAL = ("audio", "image", "video")
GENERIC_MIME = ("application/octet-stream", "")


@dataclass(frozen=True)
class Source:
    """Where a media part's bytes are: inline (`data`, base64 still) or at a remote `url`."""

    kind: str  # audio | image | video
    part_type: str
    data: str | None  # base64 text
    url: str | None  # http(s)
    declared: str | None  # the format the client declared (input_audio.format, a data URL's MIME type)


def source(part: dict[str, Any]) -> Source:
    """Where `part`'s media is; MediaError for a part of the wrong shape."""
    part_type = part.get("type")
    kind = MEDIA_PARTS.get(part_type)  # type: ignore[arg-type]
    if kind is None:
        raise MediaError(f"{part_type!r} is not a media part (one of {', '.join(MEDIA_PARTS)})")
    body = part.get(part_type)
    if part_type == "input_audio":
        if not isinstance(body, dict) or not isinstance(body.get("data"), str):
            raise MediaError('an input_audio part needs {"input_audio": {"data": <base64>, "format": "wav"}}')
        fmt = body.get("format")
        if not isinstance(fmt, str) or normalise(fmt) not in AUDIO_FORMATS:
            raise MediaError(f"input_audio.format {fmt!r}: must be one of {', '.join(AUDIO_FORMATS)}")
        return Source(kind, part_type, body["data"], None, normalise(fmt))
    url = body.get("url") if isinstance(body, dict) else body
    if not isinstance(url, str) or not url:
        raise MediaError(f'a {part_type} part needs {{"{part_type}": {{"url": "data:...;base64,..." or "https://..."}}}}')
    if url.startswith("data:"):
        data, declared = _data_url(url, kind, part_type)
        return Source(kind, part_type, data, None, declared)
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise MediaError(f"{part_type}.url: scheme {scheme!r} is not supported; send a data: URL or an http(s) URL")
    return Source(kind, part_type, None, url, None)


def _data_url(url: str, kind: str, part_type: str) -> tuple[str, str | None]:
    header, comma, data = url.partition(",")
    if not comma:
        raise MediaError(f"{part_type}.url: a data URL needs a comma before its data (data:image/png;base64,...)")
    params = header[len("data:") :].split(";")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise MediaError(f"{part_type}.url: only base64 data URLs are supported (data:<type>;base64,<data>)")
    mime = params[0].strip().lower()
    if mime in GENERIC_MIME:
        return data, None
    major, _, minor = mime.partition("/")
    if major != kind:
        raise MediaError(f"{part_type}.url: a data URL of type {mime!r} in a {part_type} part; send {kind}/* data")
    fmt = normalise(minor)
    if fmt not in KINDS[kind]:
        raise MediaError(f"{part_type}.url: {mime!r} is not a supported {kind} type ({', '.join(KINDS[kind])})")
    return data, fmt


def decode_base64(text: str, limits: MediaLimits, what: str = "data") -> bytes:
    """Strict base64 (RFC 4648, no stray characters), refused before decoding when over max_bytes."""
    if len(text) // 4 * 3 > limits.max_bytes + 2:
        raise MediaError(f"{what}: {len(text) // 4 * 3} bytes exceed the limit of {limits.max_bytes} bytes per part")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{what}: not valid base64 ({exc})") from None


def checked(data: bytes, kind: str, declared: str | None, what: str) -> str:
    """The format of `data`, which must be a `kind` and what the client declared; MediaError if not."""
    if not data:
        raise MediaError(f"{what}: empty")
    found = sniff(data)
    if found is None or kind_of(found) != kind:
        named = f"{declared} " if declared else ""
        got = f"; the bytes look like {found}" if found else ""
        raise MediaError(f"{what}: not a {named}{kind} file{got} ({kind} formats: {', '.join(KINDS[kind])})")
    if declared is not None and found != declared:
        raise MediaError(f"{what}: declared {declared} but the bytes are {found}")
    return found


def canonical(part: dict[str, Any], limits: MediaLimits | None = None) -> dict[str, Any]:
    """`part` (inline media) as the canonical part; MediaError saying what is wrong with it. Checks the
    base64, the size and the format, not the content (decode.probe / decode_* do that)."""
    limits = limits or MediaLimits.from_env()
    src = source(part)
    if src.url is not None:
        raise MediaError(f"{src.part_type}.url: remote URLs are fetched by the coordinator; send a data: URL here")
    what = "input_audio.data" if src.part_type == "input_audio" else f"{src.part_type}.url"
    data = decode_base64(src.data or "", limits, what)
    fmt = checked(data, src.kind, src.declared, what)
    return {"type": src.kind, "data": data, "format": fmt}
