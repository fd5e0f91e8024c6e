"""PIL images in frames: the pixels travel as an out-of-band buffer, like a tensor's bytes.

Pillow is optional. The encoder only looks for images when `PIL.Image` is already imported (a value
cannot be an image otherwise), and the decoder imports Pillow when a frame holds an image; where
Pillow is missing that frame fails with a FrameError that says so, and every other frame decodes.

The header entry is [mode, [width, height], buffer index, palette]: the buffer holds the raw pixels
in Pillow's "raw" layout for the mode (what `Image.tobytes()` gives), the palette of a P or PA image
is [palette mode, bytes], else None. The image comes back with its mode, size, pixels and palette
(not its `info`). Modes Pillow maps in place (L, P, RGBA, RGBX, CMYK, I;16*) are decoded as views
over the frame; the others (RGB is stored with 4 bytes a pixel in Pillow) are copied once.
"""

from __future__ import annotations

import sys
from typing import Any

from omni_mesh.codec.format import FrameError, UnsupportedTypeError
from omni_mesh.codec.nodes import buffer_index

# Bytes per pixel of each mode's raw layout; "1" packs 8 pixels a byte, each row padded to a byte.
PIXEL_BYTES = {
    "1": 0,
    "L": 1,
    "P": 1,
    "LA": 2,
    "La": 2,
    "PA": 2,
    "I;16": 2,
    "I;16L": 2,
    "I;16B": 2,
    "I;16N": 2,
    "RGB": 3,
    "YCbCr": 3,
    "LAB": 3,
    "HSV": 3,
    "RGBA": 4,
    "RGBa": 4,
    "RGBX": 4,
    "CMYK": 4,
    "I": 4,
    "F": 4,
}
PALETTE_MODES = ("RGB", "RGBA")
MAX_SIDE = 2**31 - 1  # Pillow's own bound on a dimension


def raw_size(mode: str, width: int, height: int) -> int:
    """Bytes of the raw pixels of a `mode` image of this size."""
    if mode == "1":
        return (width + 7) // 8 * height
    return PIXEL_BYTES[mode] * width * height


def image_class() -> type | None:
    """PIL.Image.Image if Pillow is already imported here, else None (no image can exist then)."""
    module = sys.modules.get("PIL.Image")
    return getattr(module, "Image", None)


def encode_fields(image: Any) -> tuple[str, list[int], bytes, list[Any] | None]:
    """(mode, [width, height], raw pixels, palette) of an image; UnsupportedTypeError for a mode
    without a plain raw layout."""
    mode = image.mode
    if mode not in PIXEL_BYTES:
        raise UnsupportedTypeError(f"cannot encode a PIL image of mode {mode!r}; convert it first")
    width, height = image.size
    raw = image.tobytes()
    if len(raw) != raw_size(mode, width, height):  # a mode whose layout this table has wrong
        raise UnsupportedTypeError(f"cannot encode a PIL image of mode {mode!r}: unexpected raw size")
    palette = None
    if mode in ("P", "PA") and image.palette is not None:
        palette_mode = image.palette.mode if image.palette.mode in PALETTE_MODES else "RGB"
        palette = [palette_mode, bytes(image.getpalette(palette_mode) or [])]
    return mode, [width, height], raw, palette


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise FrameError(
            "the frame holds a PIL image but Pillow is not installed here; pip install pillow"
        ) from None
    return Image


class ImageSlot:
    """A PIL image whose pixels are buffer `index`; every field is checked here, before any decode."""

    __slots__ = ("mode", "size", "nbytes", "index", "palette", "pil")

    def __init__(self, fields: Any) -> None:
        if not isinstance(fields, list) or len(fields) != 4:
            raise FrameError("image extension needs 4 fields")
        mode, size, index, palette = fields
        if type(mode) is not str or mode not in PIXEL_BYTES:
            raise FrameError(f"image: unknown mode {mode!r}")
        sides = size if type(size) is list and len(size) == 2 else None
        if sides is None or not all(type(n) is int and 0 <= n <= MAX_SIDE for n in sides):
            raise FrameError(f"image: bad size {size!r}")
        if palette is not None:
            ok = (
                mode in ("P", "PA")
                and type(palette) is list
                and len(palette) == 2
                and palette[0] in PALETTE_MODES
                and type(palette[1]) is bytes
                and len(palette[1]) % len(palette[0]) == 0
                and len(palette[1]) <= 256 * len(palette[0])
            )
            if not ok:
                raise FrameError(f"image: bad palette for mode {mode!r}")
        self.mode = mode
        self.size = (size[0], size[1])
        self.nbytes = raw_size(mode, *self.size)
        self.index = buffer_index(index)
        self.palette = palette
        self.pil = _pillow()

    def build(self, buffers: Any) -> Any:
        whole, start = buffers.locate(self.index, self.nbytes)  # checks the buffer holds exactly the pixels
        image_module = self.pil
        if not self.nbytes:
            image = image_module.new(self.mode, self.size)
        else:
            pixels = memoryview(whole).cast("B")[start : start + self.nbytes]  # keeps `whole` alive
            if buffers.copy:
                image = image_module.frombytes(self.mode, self.size, bytes(pixels), "raw", self.mode, 0, 1)
            else:  # a view over the frame where Pillow maps the mode in place; frombuffer copies the rest
                image = image_module.frombuffer(self.mode, self.size, pixels, "raw", self.mode, 0, 1)
        if self.palette is not None:
            image.putpalette(self.palette[1], rawmode=self.palette[0])
        return image
