"""Audio out through PyAV (FFmpeg's encoders): 16-bit mono PCM as an mp3, FLAC or Ogg Opus file.

Each call makes one whole file (the coordinator encodes every streamed delta on its own, so each
delta plays by itself). An encoder that does not take the PCM's rate (mp3 and Opus take a fixed set)
gets the nearest rate it takes at or above it: Opus files always decode at 48 kHz anyway.
"""

from __future__ import annotations

import io

import av
import numpy as np

#: format -> (FFmpeg muxer, encoder): what OpenAI's and vLLM's clients ask for.
CODECS = {"mp3": ("mp3", "libmp3lame"), "flac": ("flac", "flac"), "opus": ("ogg", "libopus")}


def encode_pcm16(pcm: bytes, sample_rate: int, fmt: str) -> bytes:
    """The 16-bit little-endian mono `pcm` at `sample_rate` as a whole `fmt` file (one of CODECS)."""
    muxer, codec = CODECS[fmt]
    rate = _encoder_rate(codec, sample_rate)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=muxer) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        if pcm:  # no samples: a valid file with no audio in it
            frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm, dtype="<i2").reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = sample_rate  # PyAV resamples and cuts it into the encoder's frame size
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _encoder_rate(codec: str, sample_rate: int) -> int:
    rates = av.codec.Codec(codec, "w").audio_rates
    if not rates or sample_rate in rates:
        return sample_rate
    return min(rates, key=lambda rate: (rate < sample_rate, abs(rate - sample_rate)))
