"""Audio and video through PyAV (FFmpeg): probes that read the container without decoding (durations,
frame counts and dimensions against the limits, truncation), and the decoders the entry stage runs.

The demuxer is always named from the sniffed format (sniff.DEMUXERS), never probed by FFmpeg, and
the bytes are read from memory: FFmpeg opens no file and no URL on a request's behalf.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import av
import numpy as np

from omni_mesh.media.errors import MediaError
from omni_mesh.media.limits import MediaLimits
from omni_mesh.media.sniff import DEMUXERS

#: Qwen-Omni's audio encoders (Whisper's feature extractor) take 16 kHz.
DEFAULT_RATE = 16000


@dataclass(frozen=True)
class Video:
    frames: np.ndarray  # uint8 [T, H, W, 3] RGB
    fps: float
    audio: np.ndarray | None  # float32 mono at audio_rate: the audio track, None without one
    audio_rate: int


@contextmanager
def _opened(data: bytes, fmt: str) -> Iterator[av.container.InputContainer]:
    try:
        container = av.open(io.BytesIO(data), mode="r", format=DEMUXERS[fmt])
    except av.FFmpegError as exc:
        raise MediaError(f"not a readable {fmt} file ({_reason(exc)})") from None
    try:
        yield container
    except av.FFmpegError as exc:
        raise MediaError(f"{fmt} file: damaged or truncated ({_reason(exc)})") from None
    finally:
        container.close()


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def _seconds(stream: av.stream.Stream, ticks: int | None) -> float | None:
    return float(ticks * stream.time_base) if ticks is not None and stream.time_base is not None else None


def _declared_s(container: av.container.InputContainer, stream: av.stream.Stream) -> float | None:
    declared = _seconds(stream, stream.duration)
    if declared is None and container.duration is not None:
        declared = container.duration / av.time_base
    return declared


def probe_audio(data: bytes, fmt: str, limits: MediaLimits) -> float:
    """The clip's duration in seconds, read packet by packet without decoding; MediaError when it has
    no audio, is over limits.max_audio_s, or ends before its header says it does."""
    if fmt == "wav":
        _check_wav_length(data)
    elif fmt == "ogg":
        _check_ogg_end(data)
    with _opened(data, fmt) as container:
        if not container.streams.audio:
            raise MediaError(f"{fmt} file: no audio stream")
        stream = container.streams.audio[0]
        declared = _declared_s(container, stream)
        if declared is not None and declared > limits.max_audio_s:
            raise MediaError(f"audio of {declared:.1f} s exceeds the limit of {limits.max_audio_s:g} s")
        seconds = 0.0
        for packet in container.demux(stream):
            _whole(packet, fmt)
            seconds += _seconds(stream, packet.duration) or 0.0
            if seconds > limits.max_audio_s:
                raise MediaError(f"audio longer than the limit of {limits.max_audio_s:g} s")
        if seconds == 0.0:
            raise MediaError(f"{fmt} file: no audio in it")
        if declared is not None and seconds < 0.95 * declared - 0.05:
            raise MediaError(f"{fmt} file: truncated ({seconds:.2f} s of the {declared:.2f} s its header declares)")
        return seconds


def _whole(packet: av.Packet, fmt: str) -> None:
    if packet.is_corrupt:  # FFmpeg's mark on a packet cut short by the end of the file
        raise MediaError(f"{fmt} file: truncated or damaged (a {packet.stream.type} packet at byte {packet.pos} is incomplete)")


def _check_wav_length(data: bytes) -> None:
    """A WAV's data chunk must be as long as its header says (FFmpeg quietly plays what is there)."""
    offset = 12
    while offset + 8 <= len(data):
        chunk, size = struct.unpack_from("<4sI", data, offset)
        if chunk == b"data":
            have = len(data) - offset - 8
            if size != 0xFFFFFFFF and have < size:  # 0xFFFFFFFF: a streamed WAV of unknown length
                raise MediaError(f"wav file: truncated ({have} of the {size} bytes of audio its header declares)")
            return
        offset += 8 + size + (size & 1)
    raise MediaError("wav file: truncated (no data chunk)")


def _check_ogg_end(data: bytes) -> None:
    """The last page of an Ogg stream is whole and marks the end of the stream."""
    last = data.rfind(b"OggS")
    if last < 0 or last + 27 > len(data):
        raise MediaError("ogg file: truncated (its last page is cut short)")
    segments = data[last + 27 : last + 27 + data[last + 26]]
    if len(segments) < data[last + 26] or last + 27 + len(segments) + sum(segments) > len(data):
        raise MediaError("ogg file: truncated (its last page is cut short)")
    if not data[last + 5] & 0x04:
        raise MediaError("ogg file: truncated (it does not end its stream)")


def probe_video(data: bytes, fmt: str, limits: MediaLimits) -> tuple[int, int, int]:
    """(frames, width, height), counted packet by packet without decoding; MediaError when there is no
    video, a frame is over limits.max_image_pixels, there are more than limits.max_video_frames frames
    or the audio track is too long, or the file ends before its header says it does."""
    with _opened(data, fmt) as container:
        if not container.streams.video:
            raise MediaError(f"{fmt} file: no video stream")
        video = container.streams.video[0]
        width, height = video.codec_context.width, video.codec_context.height
        if width * height > limits.max_image_pixels:
            raise MediaError(
                f"video frames of {width}x{height} = {width * height} pixels exceed the limit of "
                f"{limits.max_image_pixels} pixels"
            )
        if video.frames and video.frames > limits.max_video_frames:
            raise MediaError(f"video of {video.frames} frames exceeds the limit of {limits.max_video_frames} frames")
        audio = container.streams.audio[0] if container.streams.audio else None
        frames, seconds = 0, 0.0
        for packet in container.demux([video] + ([audio] if audio else [])):
            if packet.size == 0:
                continue  # a flush packet
            _whole(packet, fmt)
            if packet.stream is video:
                frames += 1
                if frames > limits.max_video_frames:
                    raise MediaError(f"video of more than the limit of {limits.max_video_frames} frames")
            else:
                seconds += _seconds(packet.stream, packet.duration) or 0.0
                if seconds > limits.max_audio_s:
                    raise MediaError(f"the video's audio track is longer than the limit of {limits.max_audio_s:g} s")
        if frames == 0:
            raise MediaError(f"{fmt} file: no video frames in it")
        if video.frames and frames < video.frames:
            raise MediaError(f"{fmt} file: truncated ({frames} of the {video.frames} frames its header declares)")
        return frames, width, height


def decode_audio(data: bytes, fmt: str, rate: int = DEFAULT_RATE, limits: MediaLimits | None = None) -> np.ndarray:
    """float32 mono samples in [-1, 1] at `rate`; MediaError for a bad or over-long clip."""
    limits = limits or MediaLimits.from_env()
    probe_audio(data, fmt, limits)
    with _opened(data, fmt) as container:
        return _decode_track(container, container.streams.audio[0], rate, limits)


def _decode_track(container: av.container.InputContainer, stream: av.stream.Stream, rate: int, limits: MediaLimits) -> np.ndarray:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    pieces: list[np.ndarray] = []
    most = int(limits.max_audio_s * rate) + rate  # a second of slack: resampling rounds
    count = 0
    for frame in [*container.decode(stream), None]:
        for out in resampler.resample(frame):
            pieces.append(out.to_ndarray().reshape(-1))
            count += pieces[-1].size
            if count > most:
                raise MediaError(f"audio longer than the limit of {limits.max_audio_s:g} s")
    return np.concatenate(pieces).astype(np.float32, copy=False) if pieces else np.zeros(0, np.float32)


def decode_video(
    data: bytes, fmt: str, limits: MediaLimits | None = None, *, audio_rate: int = DEFAULT_RATE, with_audio: bool = True
) -> Video:
    """RGB frames [T, H, W, 3], the frame rate, and the audio track (float32 mono at `audio_rate`, for
    use_audio_in_video; None without one, or when not `with_audio`)."""
    limits = limits or MediaLimits.from_env()
    probe_video(data, fmt, limits)
    with _opened(data, fmt) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        if len(frames) > limits.max_video_frames:
            raise MediaError(f"video of more than the limit of {limits.max_video_frames} frames")
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
    audio = None
    if with_audio:
        with _opened(data, fmt) as container:
            if container.streams.audio:
                audio = _decode_track(container, container.streams.audio[0], audio_rate, limits)
    if not frames:
        raise MediaError(f"{fmt} file: no video frames could be decoded")
    return Video(np.stack(frames), fps, audio, audio_rate)
