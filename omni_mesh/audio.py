"""Audio as stages answer it: float samples in [-1, 1] as 16-bit PCM, a WAV file, or its base64."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np

#: What the omni pipelines speak at (Qwen-Omni's vocoders, the demo).
SAMPLE_RATE = 24_000


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] as 16-bit little-endian PCM (what a WAV file and a pcm16 stream hold)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_bytes(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A mono 16-bit PCM RIFF/WAV file holding float samples in [-1, 1]."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm16_bytes(samples))
    return buf.getvalue()


def wav_base64(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> str:
    return base64.b64encode(wav_bytes(samples, sample_rate)).decode("ascii")
