"""Stage outputs of every type the codec carries turn into JSON for the REST answer."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import numpy as np
import pytest
import torch

from omni_mesh.coordinator.http.jsonable import jsonable


def test_sets_become_sorted_lists_and_mixed_sets_lists():
    assert jsonable({"ids": {3, 1, 2}, "tags": frozenset({"b", "a"})}) == {"ids": [1, 2, 3], "tags": ["a", "b"]}
    assert sorted(jsonable({1, "a"}), key=str) == [1, "a"]


def test_slices_become_their_bounds():
    assert jsonable(slice(2, None, 3)) == {"start": 2, "stop": None, "step": 3}


def test_images_become_png_with_mode_and_size():
    image_module = pytest.importorskip("PIL.Image")
    image = image_module.new("RGB", (4, 3), (10, 20, 30))
    out = jsonable({"frame": image})["frame"]
    assert out["mode"] == "RGB" and out["size"] == [4, 3]
    back = image_module.open(io.BytesIO(base64.b64decode(out["png_base64"])))
    assert back.size == (4, 3) and back.getpixel((0, 0)) == (10, 20, 30)


def test_everything_the_codec_carries_serialises():
    @dataclasses.dataclass
    class Point:
        x: int

    # A decoded dataclass arrives as a dict; tensors, arrays, bytes and odd floats have their own forms.
    value = {
        "t": torch.arange(3, dtype=torch.bfloat16),
        "a": np.zeros((2, 2), dtype=np.float16),
        "b": b"\x00\x01",
        "f": float("nan"),
        "c": 1 + 2j,
        "p": dataclasses.asdict(Point(1)),
        "s": {1},
        "sl": slice(None),
    }
    json.dumps(jsonable(value))
