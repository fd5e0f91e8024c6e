"""Small media files made on the spot (numpy + PyAV / Pillow / the stdlib's wave), and bad ones."""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib

import av
import numpy as np
from PIL import Image


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def wav(seconds: float = 1.0, rate: int = 16000, freq: float = 440.0) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((tone(seconds, rate, freq) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def audio(fmt: str, seconds: float = 1.0, rate: int = 16000) -> bytes:
    """An encoded sine tone: fmt mp3, flac or ogg (Opus, 48 kHz)."""
    codec = {"mp3": "mp3", "flac": "flac", "ogg": "libopus"}[fmt]
    rate = 48000 if fmt == "ogg" else rate
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono"
        sample_fmt = stream.codec_context.format.name
        samples = tone(seconds, rate)
        step = stream.codec_context.frame_size or 1024
        for start in range(0, len(samples), step):
            chunk = samples[start : start + step]
            if sample_fmt.startswith("s16"):
                chunk = (chunk * 32767).astype(np.int16)
            elif sample_fmt.startswith("s32"):
                chunk = (chunk * 2**31 - 1).astype(np.int32)
            frame = av.AudioFrame.from_ndarray(chunk[None], format=sample_fmt, layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def image(fmt: str = "png", width: int = 32, height: int = 24, color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:] = color
    pixels[: height // 2, : width // 2] = (10, 220, 40)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format={"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt])
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming width x height, with one tiny IDAT: a decompression
    bomb's header without its bulk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def video(frames: int = 8, width: int = 64, height: int = 48, fps: int = 8, *, with_audio: bool = False) -> bytes:
    """An MP4 (MPEG-4 part 2 video, AAC audio at 16 kHz): frame i is grey level 20*i."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        track = container.add_stream("aac", rate=16000) if with_audio else None
        if track is not None:
            track.layout = "mono"
        for index in range(frames):
            pixels = np.full((height, width, 3), (20 * index) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
        if track is not None:
            step = track.codec_context.frame_size or 1024
            samples = tone(frames / fps, 16000)
            for start in range(0, len(samples), step):
                frame = av.AudioFrame.from_ndarray(samples[None, start : start + step], format="fltp", layout="mono")
                frame.sample_rate = 16000
                for packet in track.encode(frame):
                    container.mux(packet)
            for packet in track.encode(None):
                container.mux(packet)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{b64(data)}"


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def image_url(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def video_url(data: bytes, mime: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}
