"""What one media part may cost: the operator's limits, with defaults, read from the environment.

Both the coordinator (which refuses a part over a limit before the request is admitted) and the entry
stage (which decodes it) read the same values, so `omni-mesh up` and a deployment set them once, as
environment variables every process inherits; `omni-mesh coordinator` / `up` take them as flags too.

| variable | default | what |
|---|---|---|
| OMNI_MESH_MEDIA_MAX_BYTES | 16 MiB | one part's bytes, after base64 decoding or download |
| OMNI_MESH_MEDIA_MAX_IMAGE_PIXELS | 40 000 000 | width x height of an image (or a video frame), read from the header |
| OMNI_MESH_MEDIA_MAX_AUDIO_S | 600 | seconds of one audio clip (or a video's audio track) |
| OMNI_MESH_MEDIA_MAX_VIDEO_FRAMES | 3600 | frames of one video |
| OMNI_MESH_ALLOWED_MEDIA_DOMAINS | (none) | comma-separated domains whose http(s) URLs are fetched; empty: remote media off |
| OMNI_MESH_MEDIA_FETCH_TIMEOUT_S | 10 | one remote download, connection to last byte |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

ENV = {
    "max_bytes": "OMNI_MESH_MEDIA_MAX_BYTES",
    "max_image_pixels": "OMNI_MESH_MEDIA_MAX_IMAGE_PIXELS",
    "max_audio_s": "OMNI_MESH_MEDIA_MAX_AUDIO_S",
    "max_video_frames": "OMNI_MESH_MEDIA_MAX_VIDEO_FRAMES",
    "allowed_domains": "OMNI_MESH_ALLOWED_MEDIA_DOMAINS",
    "fetch_timeout_s": "OMNI_MESH_MEDIA_FETCH_TIMEOUT_S",
}


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 40_000_000  # 6300 x 6300; Pillow's own bomb limit is ~89 M
    max_audio_s: float = 600.0
    max_video_frames: int = 3600  # 2 minutes at 30 fps
    #: Domains whose http(s) URLs may be fetched (a domain allows its subdomains); empty: none.
    allowed_domains: tuple[str, ...] = field(default_factory=tuple)
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_image_pixels", "max_audio_s", "max_video_frames", "fetch_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"media limit {name} must be > 0, got {value!r} (${ENV[name]})")

    @property
    def remote(self) -> bool:
        return bool(self.allowed_domains)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MediaLimits:
        """The limits set in the environment (ValueError naming a variable that is not a number)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for spec in fields(cls):
            raw = environ.get(ENV[spec.name], "").strip()
            if not raw:
                continue
            if spec.name == "allowed_domains":
                values[spec.name] = domains(raw)
                continue
            kind = float if spec.name.endswith("_s") else int
            try:
                values[spec.name] = kind(raw)
            except ValueError:
                raise ValueError(f"${ENV[spec.name]}={raw!r} is not a {kind.__name__}") from None
        return cls(**values)  # type: ignore[arg-type]

    def env(self) -> dict[str, str]:
        """These limits as the environment variables from_env reads (for child processes)."""
        out = {ENV[spec.name]: str(getattr(self, spec.name)) for spec in fields(self) if spec.name != "allowed_domains"}
        out[ENV["allowed_domains"]] = ",".join(self.allowed_domains)
        return out


def domains(raw: str) -> tuple[str, ...]:
    """`"a.com, B.org"` -> ("a.com", "b.org")."""
    return tuple(d.strip().lower().rstrip(".") for d in raw.split(",") if d.strip())
