"""Audio between a stage's output and an OpenAI client: anything a stage may hold -> 16-bit PCM ->
wav, pcm16, flac, mp3 or opus.

A stage's audio field holds one of `omni_mesh.topology.openai_spec.ENCODINGS`; the client asks for one of
FORMATS. 16-bit little-endian mono PCM is the common ground: pieces are joined as PCM, and each
answer (or streamed delta) is encoded on its own, so every `wav` (flac, mp3, opus) delta is a whole,
playable file. WAV and PCM are written here; the COMPRESSED formats through PyAV
(omni_mesh.media.audio_out), imported on first use: a coordinator without PyAV serves wav and pcm16,
and answers 501 for the others (audio_unavailable says so before the request is admitted).
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import io
import wave
from typing import Any

import numpy as np

from omni_mesh.lazy_torch import tensor_class

#: Encoded by FFmpeg (Ogg Opus for `opus`, as OpenAI's); wav and pcm16 need nothing but the standard library.
COMPRESSED = ("flac", "mp3", "opus")
FORMATS = ("wav", "pcm16", *COMPRESSED)


class AudioError(ValueError):
    """A stage's audio value is not what the topology's `openai.audio_output` says it is."""


def to_pcm16(value: Any, encoding: str) -> tuple[bytes, int | None]:
    """(16-bit little-endian mono PCM, the rate when the value itself says it: wav) of a stage's value."""
    if encoding == "float":
        return _float_pcm16(value), None
    data = _raw_bytes(value)
    if encoding == "pcm16":
        if len(data) % 2:
            raise AudioError(f"pcm16 audio of {len(data)} bytes: an odd count cannot be 16-bit samples")
        return data, None
    return _wav_pcm16(data)


def audio_unavailable(fmt: str) -> str | None:
    """Why `fmt` cannot be encoded here (PyAV missing), or None when it can."""
    if fmt in COMPRESSED and importlib.util.find_spec("av") is None:
        return (
            f"audio format {fmt!r} needs PyAV, which this coordinator lacks (pip install 'omni-mesh[engines]'); "
            "ask for wav or pcm16"
        )
    return None


def encode(pcm: bytes, sample_rate: int, fmt: str) -> bytes:
    """`pcm` (16-bit mono) in the client's format: a whole WAV, FLAC, mp3 or Ogg Opus file, or the PCM itself."""
    if fmt == "pcm16":
        return pcm
    if fmt in COMPRESSED:
        from omni_mesh.media.audio_out import encode_pcm16  # PyAV: loaded only when a client asks for it

        return encode_pcm16(pcm, sample_rate, fmt)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm)
    return buf.getvalue()


def _raw_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        return value.tobytes()
    if isinstance(value, str):  # base64, as a JSON-minded stage may send it
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise AudioError(f"audio given as a string is not base64: {exc}") from None
    raise AudioError(f"audio must be bytes (or base64 text), got {type(value).__name__}")


def _float_pcm16(value: Any) -> bytes:
    if isinstance(value, tensor_class()):
        value = value.detach().float().cpu().numpy()
    try:
        samples = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise AudioError(f"float audio must be an array of samples, got {type(value).__name__}: {exc}") from None
    if samples.ndim != 1:
        raise AudioError(f"float audio must be 1-D mono samples, got shape {tuple(samples.shape)}")
    return (np.clip(np.nan_to_num(samples), -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def _wav_pcm16(data: bytes) -> tuple[bytes, int]:
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            if wav.getnchannels() != 1 or wav.getsampwidth() != 2:
                raise AudioError(
                    f"wav audio must be mono 16-bit, got {wav.getnchannels()} channel(s) of {8 * wav.getsampwidth()} bits"
                )
            return wav.readframes(wav.getnframes()), wav.getframerate()
    except (wave.Error, EOFError) as exc:
        raise AudioError(f"wav audio is not a readable WAV file: {exc}") from None
