"""Media for `omni-mesh bench engines --inputs audio|image|video`: small files made on the spot (numpy,
the stdlib's wave, Pillow, PyAV), a different one for each `n`, as OpenAI content parts."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np

KINDS = ("text", "audio", "image", "video")


def wav(n: int, seconds: float = 2.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * np.sin(2 * np.pi * (220.0 + 10 * n) * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buf.getvalue()


def png(n: int, width: int = 224, height: int = 224) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(n)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def mp4(n: int, frames: int = 8, side: int = 112, fps: int = 4) -> bytes:
    import av

    rng = np.random.default_rng(n)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def content(kind: str, n: int, question: str) -> list[dict]:
    """One user message's content: media `n` of `kind` (none for text), then the question."""
    parts: list[dict] = []
    if kind == "audio":
        parts.append({"type": "input_audio", "input_audio": {"data": _b64(wav(n)), "format": "wav"}})
    elif kind == "image":
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(png(n))}"}})
    elif kind == "video":
        parts.append({"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{_b64(mp4(n))}"}})
    return [*parts, {"type": "text", "text": question}]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
