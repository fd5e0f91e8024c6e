"""Images: the header's dimensions checked before a pixel is decoded (no decompression bomb), then
RGB uint8 pixels. Pillow's own bomb limit (Image.MAX_IMAGE_PIXELS) stays in force under ours."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from omni_mesh.media.errors import MediaError
from omni_mesh.media.limits import MediaLimits

#: Our format names -> Pillow's.
PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "gif": "GIF", "webp": "WEBP", "bmp": "BMP"}


def _open(data: bytes, fmt: str, limits: MediaLimits) -> Image.Image:
    """The image with only its header read, its size within limits."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[PIL_FORMATS[fmt]])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"{fmt} image: refused before decoding, a possible decompression bomb ({exc})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"not a readable {fmt} image ({exc})") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise MediaError(f"{fmt} image: its header claims {width}x{height} pixels")
    if width * height > limits.max_image_pixels:
        raise MediaError(
            f"{fmt} image of {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{limits.max_image_pixels} pixels"
        )
    return image


def probe_image(data: bytes, fmt: str, limits: MediaLimits) -> tuple[int, int]:
    """(width, height) from the header; MediaError for an image over the limit or damaged. Decodes no
    pixels: a PNG's chunks are walked and their checksums checked (which finds a truncated file), a
    JPEG must end where JPEGs end."""
    image = _open(data, fmt, limits)
    if fmt == "jpeg" and not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        raise MediaError("jpeg image: truncated (no end-of-image marker)")
    if fmt == "png":
        try:
            image.verify()
        except (OSError, SyntaxError, ValueError) as exc:
            raise MediaError(f"png image: damaged or truncated ({exc})") from None
    return image.size


def decode_image(data: bytes, fmt: str, limits: MediaLimits | None = None) -> np.ndarray:
    """RGB uint8 pixels [H, W, 3] (the first frame of an animation); MediaError for a bad image."""
    limits = limits or MediaLimits.from_env()
    image = _open(data, fmt, limits)
    try:
        image.load()  # Pillow refuses a truncated file here (ImageFile.LOAD_TRUNCATED_IMAGES is off)
        return np.array(image.convert("RGB"))  # writable: torch.from_numpy warns on a read-only view
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"{fmt} image: damaged or truncated ({exc})") from None
