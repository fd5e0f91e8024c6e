"""The media package on its own: parts parsed, formats sniffed, every bad file refused with a clear
MediaError before anything big is decoded, and good files decoded to the arrays engines read."""

from __future__ import annotations

import io
import time
import tracemalloc

import av
import numpy as np
import pytest
from support import media_files as mf

from omni_mesh import media
from omni_mesh.errors import InvalidInput
from omni_mesh.media import MediaError, MediaLimits
from omni_mesh.media.limits import ENV

LIMITS = MediaLimits()


def faststart_video(tmp_path, frames: int = 12) -> bytes:
    """An MP4 with its index first, so a cut file still opens and its missing frames show."""
    path = tmp_path / "fast.mp4"
    with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(frames):
            pixels = rng.integers(0, 255, (48, 64, 3), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path.read_bytes()


# decoding what is good


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "ogg"])
def test_audio_decodes_to_float32_mono_at_the_requested_rate(fmt: str) -> None:
    data = mf.wav(1.0, 22050) if fmt == "wav" else mf.audio(fmt, 1.0)
    part = media.canonical(mf.input_audio(data, fmt), LIMITS)
    assert part == {"type": "audio", "data": data, "format": fmt}
    samples = media.decode(part)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(samples.size - 16000) < 1700  # 1 s at 16 kHz (codecs pad a frame or so)
    assert 0.2 < np.abs(samples).max() <= 1.0  # the tone, not silence
    # 440 Hz survives: the spectrum peaks there
    spectrum = np.abs(np.fft.rfft(samples[:16000] if samples.size >= 16000 else samples))
    assert abs(np.argmax(spectrum) * 16000 / (2 * (spectrum.size - 1)) - 440) < 10


def test_image_decodes_to_rgb_uint8() -> None:
    for fmt, mime in (("png", "image/png"), ("jpeg", "image/jpeg"), ("webp", "image/webp")):
        data = mf.image(fmt, 32, 24)
        part = media.canonical(mf.image_url(data, mime), LIMITS)
        pixels = media.decode(part)
        assert pixels.shape == (24, 32, 3) and pixels.dtype == np.uint8
        assert pixels.flags.writeable  # a read-only array makes the processor's torch.from_numpy warn, per request
        assert np.abs(pixels[-1, -1].astype(int) - (200, 30, 60)).max() < 24, fmt
        assert np.abs(pixels[0, 0].astype(int) - (10, 220, 40)).max() < 24, fmt


def test_video_decodes_frames_fps_and_its_audio_track() -> None:
    data = mf.video(frames=8, fps=8, with_audio=True)
    part = media.canonical(mf.video_url(data), LIMITS)
    assert part["format"] == "mp4"
    video = media.decode(part)
    assert video.frames.shape == (8, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.fps == 8.0
    levels = video.frames[:, 24, 32, 0].astype(int)
    assert np.abs(levels - 20 * np.arange(8)).max() < 8  # frame i is grey 20*i, in order
    assert video.audio is not None and video.audio.dtype == np.float32 and abs(video.audio.size - 16000) < 2100
    assert media.decode_video(mf.video(4), "mp4").audio is None


def test_a_data_url_of_generic_type_is_sniffed() -> None:
    data = mf.image("png")
    part = media.canonical({"type": "image_url", "image_url": f"data:application/octet-stream;base64,{mf.b64(data)}"})
    assert part["format"] == "png"


# refusing what is bad: each a MediaError (an InvalidInput, so 422 from a stage) that says what


def refused(part: dict, *words: str, limits: MediaLimits = LIMITS) -> str:
    with pytest.raises(MediaError) as caught:
        part = media.canonical(part, limits)
        media.probe(part["type"], part["data"], part["format"], limits)
    message = str(caught.value)
    for word in words:
        assert word in message, message
    assert isinstance(caught.value, InvalidInput)
    return message


def test_corrupt_base64_is_refused() -> None:
    refused({"type": "input_audio", "input_audio": {"data": "UklGR!!!not base64", "format": "wav"}}, "input_audio.data", "base64")
    refused({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo*"}}, "image_url.url", "base64")


def test_bytes_that_are_not_the_declared_format_are_refused() -> None:
    refused(mf.input_audio(mf.audio("mp3"), "wav"), "declared wav", "mp3")
    refused(mf.image_url(mf.image("jpeg"), "image/png"), "declared png", "jpeg")
    refused(mf.input_audio(b"hello, not audio at all" * 10, "wav"), "not a wav audio file")
    refused(mf.image_url(mf.wav(0.1), "image/png"), "not a png image file", "look like wav")
    refused(mf.video_url(mf.image("png"), "video/mp4"), "not a mp4 video file", "png")
    refused(mf.image_url(mf.image("png"), "audio/wav"), "of type 'audio/wav' in a image_url part")


def test_unknown_formats_and_shapes_are_refused() -> None:
    refused({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}, "input_audio.format", "'aiff'")
    refused({"type": "input_audio", "input_audio": "AAAA"}, "input_audio part needs")
    refused({"type": "image_url", "image_url": {}}, "image_url part needs")
    refused({"type": "image_url", "image_url": {"url": "data:image/png,plain"}}, "only base64 data URLs")
    refused({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "scheme 'file'")
    refused({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "remote URLs are fetched by the coordinator")
    refused({"type": "file", "file": {}}, "'file' is not a media part")


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "ogg"])
def test_truncated_audio_is_refused(fmt: str) -> None:
    data = mf.wav(2.0) if fmt == "wav" else mf.audio(fmt, 2.0)
    refused(mf.input_audio(data[: len(data) // 2], fmt), "truncated")
    with pytest.raises(MediaError, match="truncated"):
        media.decode_audio(data[: len(data) // 2], fmt)


def test_truncated_images_are_refused() -> None:
    for fmt in ("png", "jpeg"):
        data = mf.image(fmt, 200, 200)
        refused(mf.image_url(data[: len(data) // 2], f"image/{fmt}"), "truncated")
        with pytest.raises(MediaError, match="truncated"):
            media.decode_image(data[: len(data) // 2], fmt)


def test_truncated_video_is_refused(tmp_path) -> None:
    data = faststart_video(tmp_path)
    assert media.probe_video(data, "mp4", LIMITS) == (12, 64, 48)
    refused(mf.video_url(data[: len(data) // 2]), "truncated")
    refused(mf.video_url(data[:-10]), "truncated")  # the last frame cut short
    cut = mf.video(8)  # index last: cut, it has no index at all
    refused(mf.video_url(cut[: len(cut) // 2]), "mp4 file")


def test_a_decompression_bomb_header_is_refused_before_any_pixel_is_decoded() -> None:
    bomb = mf.png_header_only(100_000, 100_000)
    tracemalloc.start()
    started = time.monotonic()
    try:
        refused(mf.image_url(bomb), "decompression bomb", "10000000000 pixels")
        with pytest.raises(MediaError, match="decompression bomb"):
            media.decode_image(bomb, "png")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 1.0
    assert peak < 10 * 1024 * 1024  # 30 GB of pixels were never allocated
    # under Pillow's own limit, ours still holds
    refused(mf.image_url(mf.png_header_only(8000, 8000)), "8000x8000", "40000000 pixels")
    refused(mf.image_url(mf.image("png", 64, 64)), "64x64", limits=MediaLimits(max_image_pixels=1000))


def test_audio_longer_than_the_limit_is_refused() -> None:
    short = MediaLimits(max_audio_s=1.5)
    for fmt in ("wav", "mp3", "flac", "ogg"):
        data = mf.wav(2.0) if fmt == "wav" else mf.audio(fmt, 2.0)
        refused(mf.input_audio(data, fmt), "exceeds the limit of 1.5 s" if fmt != "ogg" else "1.5 s", limits=short)
        with pytest.raises(MediaError, match="1.5 s"):
            media.decode_audio(data, fmt, limits=short)


def test_video_with_more_frames_than_the_limit_is_refused() -> None:
    few = MediaLimits(max_video_frames=5)
    refused(mf.video_url(mf.video(frames=8)), "limit of 5 frames", limits=few)
    with pytest.raises(MediaError, match="limit of 5 frames"):
        media.decode_video(mf.video(frames=8), "mp4", few)
    refused(mf.video_url(mf.video(frames=4, width=64, height=48)), "64x48", limits=MediaLimits(max_image_pixels=1000))
    track = MediaLimits(max_audio_s=0.5)
    refused(mf.video_url(mf.video(frames=8, with_audio=True)), "audio track", limits=track)


def test_a_part_over_the_byte_limit_is_refused_before_decoding_its_base64() -> None:
    refused(mf.input_audio(mf.wav(1.0)), "exceed the limit of 1000 bytes", limits=MediaLimits(max_bytes=1000))


def test_limits_come_from_the_environment() -> None:
    limits = MediaLimits.from_env({ENV["max_audio_s"]: "12.5", ENV["allowed_domains"]: "Example.com, cdn.org."})
    assert limits.max_audio_s == 12.5 and limits.allowed_domains == ("example.com", "cdn.org")
    assert MediaLimits.from_env(limits.env()) == limits
    with pytest.raises(ValueError, match="OMNI_MESH_MEDIA_MAX_VIDEO_FRAMES"):
        MediaLimits.from_env({ENV["max_video_frames"]: "many"})
    with pytest.raises(ValueError, match="max_bytes"):
        MediaLimits(max_bytes=0)


def test_sniffing_names_each_format() -> None:
    files = {
        "wav": mf.wav(0.1), "mp3": mf.audio("mp3", 0.2), "flac": mf.audio("flac", 0.2), "ogg": mf.audio("ogg", 0.2),
        "png": mf.image("png"), "jpeg": mf.image("jpeg"), "webp": mf.image("webp"), "mp4": mf.video(2),
    }
    assert {fmt: media.sniff(data) for fmt, data in files.items()} == {fmt: fmt for fmt in files}
    assert media.sniff(b"\x00" * 32) is None
    assert media.sniff(io.BytesIO(b"").read()) is None
