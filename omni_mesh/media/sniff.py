"""Which format a file is, from its first bytes (its magic number), never from what the client says.

The format names are the ones content parts use (`input_audio.format`), and each maps to the FFmpeg
demuxer that reads it: the demuxer is always named, so FFmpeg never probes for one itself (some of
its demuxers, such as playlists, would open other files or URLs).
"""

from __future__ import annotations

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
IMAGE_FORMATS = ("png", "jpeg", "gif", "webp", "bmp")
VIDEO_FORMATS = ("mp4", "webm")
KINDS = {"audio": AUDIO_FORMATS, "image": IMAGE_FORMATS, "video": VIDEO_FORMATS}

#: FFmpeg's demuxer for each container format.
DEMUXERS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "ogg": "ogg", "mp4": "mp4", "webm": "matroska"}
#: Other names clients use (MIME subtypes, extensions) -> ours.
ALIASES = {
    "x-wav": "wav", "wave": "wav", "vnd.wave": "wav", "mpeg": "mp3", "mpga": "mp3", "x-flac": "flac",
    "vorbis": "ogg", "opus": "ogg", "jpg": "jpeg", "pjpeg": "jpeg", "x-ms-bmp": "bmp", "quicktime": "mp4",
    "mov": "mp4", "m4v": "mp4", "x-matroska": "webm", "mkv": "webm", "matroska": "webm",
}


def normalise(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def sniff(data: bytes) -> str | None:
    """The format of `data` from its magic number; None when it is none of ours."""
    head = data[:16]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"ID3" or _mpeg_audio_frame(head):
        return "mp3"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] == b"BM" and len(data) >= 26:
        return "bmp"
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"):
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    return None


def _mpeg_audio_frame(head: bytes) -> bool:
    # An MPEG audio frame header: 11 sync bits, a version that exists, layer III (01) - not ADTS AAC
    # (layer 00) nor JPEG (0xFFD8).
    return len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x18 != 0x08 and head[1] & 0x06 == 0x02


def kind_of(fmt: str) -> str | None:
    return next((kind for kind, formats in KINDS.items() if fmt in formats), None)
