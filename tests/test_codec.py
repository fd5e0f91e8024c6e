"""omni_mesh.codec: round trips of every carried type, zero-copy views, and hostile frames.

Forged frames are built here by hand from the layout the module docstring documents (PREFIX struct,
u64 length table, msgpack header with ext references, 64-byte aligned buffers), not with codec helpers.
"""

from __future__ import annotations

import ast
import collections
import ctypes
import dataclasses
import enum
import inspect
import math
import pickle
import re
import struct
import subprocess
import sys
import tracemalloc
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_mesh import codec, cuda_ipc
from omni_mesh.codec import FrameError, UnsupportedTypeError

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental",  # torch, for complex32 tensors
    "ignore:Data type alias:DeprecationWarning",  # numpy, for dtype names in forged frames
)
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPE_NAMES = sorted(codec.torch_dtypes())
LAYOUTS = ["contiguous", "scalar", "empty", "transposed", "stepped", "expanded", "reversed_dims", "offset"]

# --------------------------------------------------------------------------- expected values


def expected(value: Any) -> Any:
    """What `decode(encode(value))` must give: base types, contiguous tensors and arrays."""
    if isinstance(value, torch.Tensor):
        return value.detach().resolve_conj().resolve_neg().contiguous().clone()
    if isinstance(value, np.ndarray):
        return value.copy(order="C")
    if isinstance(value, np.generic):
        return value
    if isinstance(value, enum.Enum):
        return expected(value.value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: expected(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (set, frozenset)):
        return (frozenset if isinstance(value, frozenset) else set)(expected(v) for v in value)
    if isinstance(value, dict):
        return {expected(k): expected(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(expected(v) for v in value)
    if isinstance(value, list):
        return [expected(v) for v in value]
    for base in (bool, int, float, str, bytes):
        if isinstance(value, base):
            return base(value)
    return value


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, path: str = "payload") -> None:
    """Strict equality: same types (tuples stay tuples), same dtypes and shapes, bitwise-equal data."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, f"{path}: {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype}{got.shape}"
        assert tensor_bytes(got) == tensor_bytes(want), path
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, f"{path}: {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype}{got.shape}"
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got.dtype == want.dtype, f"{path}: {type(got)}"
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, float):
        assert type(got) is float, f"{path}: {type(got)}"
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert type(got) is dict, f"{path}: {type(got)}"
        assert len(got) == len(want), path
        for (gk, gv), (wk, wv) in zip(got.items(), want.items(), strict=True):
            assert_same(gk, wk, f"{path} key {wk!r}")
            assert_same(gv, wv, f"{path}[{wk!r}]")
    elif isinstance(want, (set, frozenset)):
        assert type(got) is type(want), f"{path}: {type(got)} instead of {type(want)}"
        assert len(got) == len(want), path
        if any(isinstance(w, torch.Tensor) for w in want):  # hashed by identity: compare their bytes
            assert sorted(map(tensor_bytes, got)) == sorted(map(tensor_bytes, want)), path
        else:
            assert got == want, f"{path}: {got!r} != {want!r}"
    elif is_image(want):
        assert is_image(got), f"{path}: {type(got)}"
        assert (got.mode, got.size) == (want.mode, want.size), f"{path}: {got.mode} {got.size}"
        assert got.tobytes() == want.tobytes(), f"{path}: pixels differ"
        assert got.getpalette() == want.getpalette(), f"{path}: palettes differ"
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{path}: {type(got)} instead of {type(want)}"
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


def round_trip(value: Any, **kwargs: Any) -> Any:
    return codec.decode(codec.encode(value), **kwargs)


CARRIED = (str, bytes, int, float, bool, type(None), torch.Tensor, np.ndarray, np.generic, slice, Image.Image)


def is_image(value: Any) -> bool:
    return isinstance(value, Image.Image)


def assert_carried_only(value: Any) -> None:
    """Whatever a frame decodes to is made only of the types the codec carries."""
    if isinstance(value, dict):
        for k, v in value.items():
            assert_carried_only(k)
            assert_carried_only(v)
    elif type(value) in (list, tuple, set, frozenset):
        for v in value:
            assert_carried_only(v)
    else:
        assert isinstance(value, CARRIED), f"decoded a {type(value)}"


# --------------------------------------------------------------------------- builders


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], raw: bytes) -> torch.Tensor:
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return base.view(dtype).reshape(shape)


def raw_for(dtype: torch.dtype, nbytes: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if dtype is torch.bool:
        return rng.integers(0, 2, nbytes, dtype=np.uint8).tobytes()
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def layout_tensor(name: str, layout: str, seed: int = 0) -> torch.Tensor:
    """A tensor of dtype `name` in the given memory layout, filled with arbitrary bits."""
    dtype = codec.torch_dtypes()[name]

    def base(*shape: int) -> torch.Tensor:
        return make_tensor(dtype, shape, raw_for(dtype, math.prod(shape) * dtype.itemsize, seed))

    if layout == "contiguous":
        return base(3, 5)
    if layout == "scalar":
        return base(1).reshape(())
    if layout == "empty":
        return torch.empty((2, 0, 3), dtype=dtype)
    if layout == "transposed":
        return base(3, 4).T
    if layout == "stepped":
        return base(4, 7)[::2, 1::3]
    if layout == "expanded":
        return base(1, 5).expand(4, 5)
    if layout == "reversed_dims":
        return base(2, 3, 4).permute(2, 0, 1)
    if layout == "offset":
        return base(20)[3:11]  # contiguous, but not at the start of its storage
    raise AssertionError(layout)


NUMPY_DTYPES = [
    *("?", "i1", "u1", "<i2", ">i2", "<u2", "<i4", ">i4", ">u4", "<i8", ">i8", "<u8"),
    *("<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "<c8", ">c16", np.dtype(np.longdouble).str),
    *("S1", "S7", "<M8[s]", ">M8[D]", "<m8[ms]"),
]


@st.composite
def torch_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = codec.torch_dtypes()[draw(st.sampled_from(DTYPE_NAMES))]
    layout = draw(st.sampled_from(LAYOUTS + ["conj"]))
    if layout in ("scalar", "empty", "transposed", "stepped", "expanded", "reversed_dims", "offset"):
        seed = draw(st.integers(0, 2**32 - 1))
        return layout_tensor(str(dtype).removeprefix("torch."), layout, seed)
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
    nbytes = math.prod(shape) * dtype.itemsize
    if dtype is torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=nbytes, max_size=nbytes)))
    else:
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    tensor = make_tensor(dtype, shape, raw)
    if layout == "conj" and dtype in (torch.complex64, torch.complex128):
        return tensor.conj()  # a lazily conjugated view: its bits differ from its values
    return tensor


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    if draw(st.booleans()):
        text = st.text(max_size=3)
        flat = draw(st.lists(text, min_size=math.prod(shape), max_size=math.prod(shape)))
        array = np.array(flat, dtype=draw(st.sampled_from(["<U3", ">U3"]))).reshape(shape)
    else:
        dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
        nbytes = math.prod(shape) * dtype.itemsize
        if dtype.kind == "b":
            raw = bytes(draw(st.lists(st.integers(0, 1), min_size=nbytes, max_size=nbytes)))
        else:
            raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
        array = np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    view = draw(st.sampled_from(["as is", "transposed", "stepped", "negative"]))
    if view == "transposed":
        return array.T
    if view == "stepped" and array.ndim:
        return array[::2]
    if view == "negative" and array.ndim:
        return array[::-1]
    return array


numpy_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 255).map(np.uint8),
    st.floats(width=16).map(np.float16),
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    st.complex_numbers().map(np.complex128),
    st.booleans().map(np.bool_),
    st.integers(-(10**6), 10**6).map(lambda d: np.datetime64(d, "D")),
    st.text(max_size=5).filter(lambda s: not s.endswith("\x00")).map(np.str_),
    st.binary(max_size=5).filter(lambda b: not b.endswith(b"\x00")).map(np.bytes_),
)

small_bytes = st.binary(max_size=codec.INLINE_BYTES_MAX)
large_bytes = st.binary(min_size=codec.INLINE_BYTES_MAX + 1, max_size=2000)
leaves = st.one_of(
    torch_tensors(),
    numpy_arrays(),
    numpy_scalars,
    small_bytes,
    large_bytes,
    st.one_of(small_bytes, large_bytes).map(bytearray),
    st.one_of(small_bytes, large_bytes).map(memoryview),
    st.text(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
)
keys = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**63), 2**64 - 1),
    st.tuples(st.integers(-5, 5), st.text(max_size=3)),
)
slice_bounds = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=3), st.booleans())
members = st.one_of(keys, st.binary(max_size=2000), st.none())  # hashable, and equal after a round trip


@dataclasses.dataclass
class Pair:
    left: Any
    right: Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: Any


payloads = st.recursive(
    st.one_of(leaves, st.builds(slice, slice_bounds, slice_bounds, slice_bounds)),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.sets(members, max_size=4),
        st.frozensets(members, max_size=4),
        st.builds(Pair, children, children),
    ),
    max_leaves=10,
)

# --------------------------------------------------------------------------- round trips


@settings(FAST, max_examples=150)
@given(payloads)
def test_round_trip_property(value: Any) -> None:
    want = expected(value)
    frame = codec.encode(value)
    assert len(frame) == codec.plan(value).nbytes == codec.frame_length(frame)
    assert_same(codec.decode(frame), want)
    assert_same(codec.decode(frame, copy=True), want)
    assert_same(codec.decode(bytes(frame)), want)  # read-only frame


@settings(FAST, max_examples=150)
@given(payloads)
def test_parts_form_round_trip_property(value: Any) -> None:
    """The parts form (header + one buffer per leaf) decodes like a frame, also from read-only parts."""
    want = expected(value)
    header, leaves, lengths = codec.split(value)
    parts = codec.leaf_buffers(leaves, lengths)
    assert [len(p) for p in parts] == lengths
    assert_same(codec.decode_parts(header, list(parts)), want)
    assert_same(codec.decode_parts(header, [bytes(p) for p in parts]), want)  # as msgpack delivers them
    assert_same(codec.decode_parts(header, list(parts), copy=True), want)


def test_parts_form_rejects_mismatched_parts() -> None:
    header, leaves, lengths = codec.split({"x": torch.arange(10), "y": np.ones(3)})
    parts = codec.leaf_buffers(leaves, lengths)
    for bad in ([], parts[:1], [parts[0], bytes(5)], [bytes(len(parts[0]) + 8), parts[1]], None, "parts"):
        with pytest.raises(FrameError):
            codec.decode_parts(header, bad)  # type: ignore[arg-type]
    for bad_header in (b"", b"\xc1", 5, bytes(40)):
        with pytest.raises(FrameError):
            codec.decode_parts(bad_header, parts)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_torch_dtype_in_every_layout(name: str, layout: str) -> None:
    tensor = layout_tensor(name, layout, seed=len(name))
    if layout in ("transposed", "stepped", "expanded", "reversed_dims"):
        assert not tensor.is_contiguous()
    for copy in (False, True):
        got = round_trip({"t": tensor, "nested": [tensor, (tensor,)]}, copy=copy)
        for leaf in (got["t"], got["nested"][0], got["nested"][1][0]):
            assert leaf.is_contiguous()
            assert_same(leaf, expected(tensor))


def test_torch_dtype_table_is_complete() -> None:
    names = set(codec.torch_dtypes())
    wanted = {"bfloat16", "bool", "complex32", "complex64", "complex128", "float16", "float64", "int8"}
    assert wanted | {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "uint16", "uint64"} <= names
    assert not any(name.startswith(("q", "bits")) for name in names)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES + ["<U4", ">U4"])
@pytest.mark.parametrize("view", ["contiguous", "transposed", "stepped", "negative", "zero-d", "empty"])
def test_every_numpy_dtype(dtype: str, view: str) -> None:
    dt = np.dtype(dtype)
    if dt.kind == "U":
        base = np.array([["ab", "c", "", "dddd"]] * 3, dtype=dt)
    else:
        raw = np.random.default_rng(1).integers(0, 2 if dt.kind == "b" else 256, 12 * dt.itemsize, np.uint8)
        base = np.frombuffer(raw.tobytes(), dtype=dt).reshape(3, 4).copy()
    array = {
        "contiguous": base,
        "transposed": base.T,
        "stepped": base[:, ::3],
        "negative": base[::-1, ::-2],
        "zero-d": base[1, 1, ...],
        "empty": base[:0],
    }[view]
    for copy in (False, True):
        got = round_trip([array], copy=copy)[0]
        assert_same(got, expected(array))
    assert round_trip(array).dtype.str == dt.str  # big-endian arrays stay big-endian


def test_scalars_and_extremes() -> None:
    value = {
        "ints": [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**32],
        "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308],
        "bools": [True, False],
        "none": None,
        "str": ["", "héllo wörld ✓ \x00 \U0001f600"],
        "bytes": [
            b"",
            b"\x00" * codec.INLINE_BYTES_MAX,
            b"\xff" * (codec.INLINE_BYTES_MAX + 1),
            b"x" * 100_000,
        ],
        "np": [
            np.float16(1.5),
            np.int8(-3),
            np.uint64(2**64 - 1),
            np.bool_(True),
            np.complex64(1 - 2j),
            np.datetime64("2024-01-02T03:04:05"),
            np.timedelta64(7, "ms"),
            np.str_("x"),
            np.bytes_(b"yz"),
            np.float64("nan"),
            np.longdouble(1) / 3,
        ],
    }
    got = round_trip(value)
    assert_same(got, expected(value))
    assert [type(b) for b in got["bools"]] == [bool, bool]


def test_bytes_like_come_back_as_bytes() -> None:
    small, large = b"abc", bytes(range(256)) * 3
    value = [bytearray(small), memoryview(small), bytearray(large), memoryview(large), memoryview(large)[::2]]
    assert round_trip(value) == [small, small, large, large, large[::2]]
    assert all(type(v) is bytes for v in round_trip(value))


def test_large_bytes_go_out_of_band() -> None:
    frame_plan = codec.plan([b"a" * codec.INLINE_BYTES_MAX, b"b" * (codec.INLINE_BYTES_MAX + 1)])
    assert frame_plan.lengths == [codec.INLINE_BYTES_MAX + 1]


def test_containers_keep_their_kind_and_keys() -> None:
    value = {
        "t": (1, (2, 3), [4, (5,)], ()),
        7: "int key",
        -(2**63): "min key",
        (1, "a"): "tuple key",
        ((1, 2), ("x",)): "nested tuple key",
        frozenset({1, (2, "b")}): "frozenset key",
        "l": [[], {}, ()],
    }
    got = round_trip(value)
    assert_same(got, value)
    assert list(got) == list(value)  # order preserved


class Color(enum.IntEnum):
    RED = 3


class Mood(str, enum.Enum):
    HAPPY = "happy"


Point = collections.namedtuple("Point", "x y")


def test_subclasses_travel_as_their_base() -> None:
    value = collections.OrderedDict(
        [("enum", Color.RED), ("str_enum", Mood.HAPPY), ("point", Point(1, [2])), (Color.RED, "key")]
    )
    value["default"] = collections.defaultdict(list, {"a": [1]})
    value["size"] = torch.Size([2, 3])
    value["param"] = torch.nn.Parameter(torch.ones(2))
    got = round_trip(value)
    assert_same(
        got,
        {
            "enum": 3,
            "str_enum": "happy",
            "point": (1, [2]),
            3: "key",
            "default": {"a": [1]},
            "size": (2, 3),
            "param": torch.ones(2),
        },
    )
    assert type(got["enum"]) is int and type(got["point"]) is tuple


# --------------------------------------------------------------------------- vllm-omni's payload types

IMAGE_MODES = ["1", "L", "P", "LA", "La", "PA", "I;16", "I;16L", "I;16B", "I;16N", "RGB", "YCbCr"]
IMAGE_MODES += ["LAB", "HSV", "RGBA", "RGBa", "RGBX", "CMYK", "I", "F"]
MAPPED_MODES = {"L", "P", "RGBA", "RGBX", "CMYK", "I;16", "I;16L", "I;16B"}  # Pillow maps these in place


def make_image(mode: str, size: tuple[int, int] = (37, 23), seed: int = 0) -> Image.Image:
    """An image whose every raw byte is random: any pixel that moves shows up."""
    probe = Image.new(mode, size)
    raw = np.random.default_rng(seed).integers(0, 256, len(probe.tobytes()), dtype=np.uint8).tobytes()
    image = Image.frombytes(mode, size, raw)
    if mode in ("P", "PA"):
        image.putpalette(bytes(range(256)) * 3, rawmode="RGB")
    return image


def test_sets_and_frozensets_come_back_as_themselves() -> None:
    value = {
        "set": {1, "a", b"b" * 600, (2, ("x", None)), 2.5, False},
        "frozen": frozenset({1, frozenset({2, (3,)}), b"q"}),
        "empty": set(),
        "empty frozen": frozenset(),
        "nested": [{frozenset({1})}, ({"k"},)],
        "tensors": {torch.arange(3), torch.ones(2, dtype=torch.bfloat16)},
        frozenset({"as", "key"}): "a frozenset key",
    }
    for got in (round_trip(value), round_trip(value, copy=True), codec.decode(bytes(codec.encode(value)))):
        assert_same(got, expected(value))
        assert type(got["set"]) is set and type(got["frozen"]) is frozenset
        got["set"].add("mutable")  # a fresh set per decode
    assert "mutable" not in round_trip(value)["set"]
    header, leaves, lengths = codec.split(value)
    assert_same(codec.decode_parts(header, codec.leaf_buffers(leaves, lengths)), expected(value))


def test_slices_come_back_as_slices() -> None:
    value = {
        "s": slice(1, None, -2),
        "t": (slice(None), slice("a", "b")),
        "big": slice(-(2**63), 2**64 - 1, 1.5),
    }
    got = round_trip(value)
    assert got == value and all(type(v) is slice for v in (got["s"], *got["t"], got["big"]))
    assert [1, 2, 3, 4][got["s"]] == [2]


def test_dataclasses_arrive_as_dicts_of_their_fields() -> None:
    @dataclasses.dataclass
    class Output:
        text: str
        tokens: torch.Tensor
        extra: Any = None
        scores: list = dataclasses.field(default_factory=list)
        computed: int = dataclasses.field(init=False, default=7)

    tokens = torch.arange(6).reshape(2, 3)[:, ::2]  # non-contiguous
    value = [Output("hi", tokens, extra=Output("inner", torch.tensor(1.0)), scores=[Frozen(2)]), Pair(("t",))]
    frame = codec.encode(value)
    assert b"Output" not in frame and b"Pair" not in frame and b"Frozen" not in frame  # nothing names a class
    got = codec.decode(frame)
    want = [
        {
            "text": "hi",
            "tokens": tokens.contiguous(),
            "extra": {
                "text": "inner",
                "tokens": torch.tensor(1.0),
                "extra": None,
                "scores": [],
                "computed": 7,
            },
            "scores": [{"x": 2}],
            "computed": 7,
        },
        {"left": ("t",), "right": None},
    ]
    assert_same(got, want)
    assert list(got[0]) == ["text", "tokens", "extra", "scores", "computed"]  # field order


def test_dataclass_fields_are_not_deep_copied() -> None:
    big = torch.zeros(1 << 20)
    frame_plan = codec.plan(Pair(big))
    assert frame_plan.leaves[-1] is big  # out of band from its own memory, as a bare tensor would be


@pytest.mark.parametrize("mode", IMAGE_MODES)
def test_pil_images_keep_mode_size_pixels_and_palette(mode: str) -> None:
    image = make_image(mode)
    value = {"image": image, "images": [make_image(mode, (1, 1), seed=1), make_image(mode, (0, 5))]}
    frame = codec.encode(value)
    frame_plan = codec.plan(value)
    assert len(image.tobytes()) in frame_plan.lengths  # the pixels are a buffer of the frame...
    assert image.tobytes() not in bytes(frame_plan.header)  # ...not bytes inside msgpack
    for got in (codec.decode(frame), codec.decode(frame, copy=True), codec.decode(bytes(frame))):
        assert_same(got, value)
    header, leaves, lengths = codec.split(value)
    assert_same(codec.decode_parts(header, codec.leaf_buffers(leaves, lengths)), value)


@pytest.mark.parametrize("mode", sorted(MAPPED_MODES))
def test_pil_image_pixels_are_views_over_the_frame(mode: str) -> None:
    image = make_image(mode, (64, 64))
    frame = codec.encode({"i": image})
    got = codec.decode(frame)["i"]
    at = frame.index(image.tobytes())
    frame[at] ^= 0xFF  # the decoded image sees the frame's bytes: nothing was copied
    assert got.tobytes()[0] == image.tobytes()[0] ^ 0xFF
    copied = codec.decode(bytes(frame), copy=True)["i"]
    frame[at] ^= 0xFF
    assert copied.tobytes()[0] == image.tobytes()[0] ^ 0xFF  # copy=True owns its pixels


_NO_PILLOW = r"""
import sys
sys.modules["PIL"] = None  # import PIL fails from here on, as where Pillow is not installed
import torch
from omni_mesh import codec
value = {"t": torch.arange(3), "s": {1, 2}, "sl": slice(1, 2)}
assert codec.decode(codec.encode(value))["s"] == {1, 2}
try:
    codec.decode(sys.stdin.buffer.read())
except codec.FrameError as exc:
    print(exc)
"""


def test_the_codec_works_without_pillow_and_an_image_frame_says_what_is_missing() -> None:
    frame = bytes(codec.encode({"image": make_image("RGB")}))
    result = subprocess.run([sys.executable, "-c", _NO_PILLOW], input=frame, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert "Pillow is not installed" in result.stdout.decode(), result.stdout


# --------------------------------------------------------------------------- views and copies


def buffer_offset(value: Any, index: int = 0) -> int:
    """Offset of out-of-band buffer `index`, derived from the documented layout."""
    frame = codec.encode(value)
    _magic, _version, _flags, count, header_len, _nbytes = struct.unpack_from("<4sHHIIQ", frame)
    lengths = struct.unpack_from(f"<{count}Q", frame, 24)
    pos = 24 + 8 * count + header_len
    for i, length in enumerate(lengths):
        pos = (pos + 63) // 64 * 64
        if i == index:
            return pos
        pos += length
    raise AssertionError(index)


def test_frame_matches_documented_layout() -> None:
    tensor = torch.arange(10, dtype=torch.int32)
    array = np.arange(3, dtype=">f8")
    big = bytes(range(200)) * 3
    frame = codec.encode({"t": tensor, "a": array, "b": big})
    magic, version, flags, count, header_len, nbytes = struct.unpack_from("<4sHHIIQ", frame)
    assert (magic, version, flags, count, nbytes) == (b"OMF1", 1, 0, 3, len(frame))
    assert struct.unpack_from("<3Q", frame, 24) == (40, 24, 600)
    header = msgpack.unpackb(bytes(frame[48 : 48 + header_len]), raw=False)
    assert header["t"].code == codec.EXT_TENSOR
    assert msgpack.unpackb(header["t"].data) == ["int32", [10], 0]
    assert msgpack.unpackb(header["a"].data) == [">f8", [3], 1]
    value = {"t": tensor, "a": array, "b": big}
    for index, want in enumerate([tensor.numpy().tobytes(), array.tobytes(), big]):
        offset = buffer_offset(value, index)
        assert offset % 64 == 0
        assert bytes(frame[offset : offset + len(want)]) == want


def test_decode_returns_views_over_the_buffer() -> None:
    value = {"t": torch.zeros(4, dtype=torch.float32), "a": np.zeros(4, dtype=np.int16)}
    frame = codec.encode(value)
    got = codec.decode(frame)
    t_off, a_off = buffer_offset(value, 0), buffer_offset(value, 1)
    struct.pack_into("<f", frame, t_off + 4, 2.5)
    struct.pack_into("<h", frame, a_off + 2, -7)
    assert got["t"].tolist() == [0.0, 2.5, 0.0, 0.0]
    assert got["a"].tolist() == [0, -7, 0, 0]
    got["t"][3] = 1.0  # and the other way round
    assert struct.unpack_from("<f", frame, t_off + 12)[0] == 1.0
    address = np.frombuffer(frame, np.uint8).ctypes.data
    assert got["t"].data_ptr() == address + t_off


def test_decode_with_copy_is_independent() -> None:
    value = {"t": torch.zeros(4), "a": np.zeros(4), "s": (torch.zeros(()),)}
    frame = codec.encode(value)
    got = codec.decode(frame, copy=True)
    frame[24 + 16 :] = b"\x7f" * (len(frame) - 40)  # scribble over the header tail and every buffer
    assert got["t"].tolist() == [0.0] * 4 and got["a"].tolist() == [0.0] * 4 and got["s"][0].item() == 0.0
    got["t"] += 1
    got["a"] += 1


def test_read_only_frame_gives_writable_tensors() -> None:
    frame = bytes(codec.encode({"t": torch.arange(4.0), "a": np.arange(3), "e": torch.empty(0)}))
    before = frame[:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a non-writable buffer
        got = codec.decode(frame)
        got["t"].add_(1)
        got["e"].add_(1)
    got["a"] += 1
    assert got["a"].flags.writeable and got["t"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert frame == before


@settings(FAST, max_examples=40)
@given(payloads, st.integers(0, 300), st.integers(0, 100))
def test_write_into_the_middle_of_a_buffer(value: Any, offset: int, tail: int) -> None:
    frame_plan = codec.plan(value)
    buf = bytearray(b"\xab" * (offset + frame_plan.nbytes + tail))
    assert frame_plan.write_into(buf, offset) == frame_plan.nbytes
    assert buf[:offset] == b"\xab" * offset and buf[offset + frame_plan.nbytes :] == b"\xab" * tail
    assert codec.frame_length(buf, offset) == frame_plan.nbytes
    want = expected(value)
    assert_same(codec.decode(buf, offset), want)
    assert_same(codec.decode(memoryview(buf), offset, copy=True), want)
    meta_end = 24 + 8 * len(frame_plan.lengths) + len(frame_plan.header)  # prefix, table, header
    assert bytes(buf[offset : offset + meta_end]) == bytes(codec.encode(value)[:meta_end])


@settings(FAST, max_examples=100)
@given(payloads)
def test_pieces_scatter_the_same_frame(value: Any) -> None:
    """The scatter form: the head and each leaf written at its offset make the frame write_into makes,
    byte for byte outside the padding; pieces are in frame order, disjoint, and inside the frame."""
    frame_plan = codec.plan(value)
    pieces = frame_plan.pieces()
    assert pieces[0].offset == 0 and pieces[0].index == -1 and bytes(pieces[0].source[:4]) == codec.MAGIC
    assert [p.index for p in pieces[1:]] == sorted(p.index for p in pieces[1:])
    for before, after in zip(pieces, pieces[1:], strict=False):
        assert before.offset + before.length <= after.offset and after.offset % codec.ALIGN == 0
    assert pieces[-1].offset + pieces[-1].length <= frame_plan.nbytes
    whole = bytearray(frame_plan.nbytes)
    frame_plan.write_into(whole)
    scattered = bytearray(frame_plan.nbytes)
    base = ctypes.addressof(ctypes.c_char.from_buffer(scattered))
    for piece in pieces:
        piece.write_at(base + piece.offset)
        span = slice(piece.offset, piece.offset + piece.length)
        assert scattered[span] == whole[span]
        if piece.address is not None:  # a contiguous CPU leaf a transport may send from its own memory
            assert ctypes.string_at(piece.address, piece.length) == whole[span]
    assert_same(codec.decode(scattered), expected(value))


def test_write_into_refuses_small_or_read_only_destinations() -> None:
    frame_plan = codec.plan({"t": torch.ones(100)})
    with pytest.raises(ValueError, match="frame needs"):
        frame_plan.write_into(bytearray(frame_plan.nbytes - 1))
    with pytest.raises(ValueError, match="frame needs"):
        frame_plan.write_into(bytearray(frame_plan.nbytes), 1)
    with pytest.raises(ValueError):
        frame_plan.write_into(bytes(frame_plan.nbytes))
    target = np.zeros(frame_plan.nbytes + 8, dtype=np.uint8)
    frame_plan.write_into(target, 8)  # any writable buffer, e.g. a numpy array
    assert_same(codec.decode(target, 8), {"t": torch.ones(100)})


def test_deep_tuples_round_trip_up_to_the_limit() -> None:
    value: Any = "core"
    for _ in range(codec.MAX_TUPLE_DEPTH):
        value = (value,)
    assert_same(round_trip(value), value)
    with pytest.raises(UnsupportedTypeError, match="nest"):
        codec.encode((value,))  # the encoder refuses what every decoder would refuse


def test_tuples_nested_around_a_large_header_are_bounded() -> None:
    # Decoders bound the bytes they unpack through tuple levels; the encoder refuses what exceeds it.
    text = "x" * 100_000
    assert_same(round_trip((((text,), 1), [2])), (((text,), 1), [2]))
    with pytest.raises(UnsupportedTypeError, match="tuples"):
        codec.encode(_nest_tuple(text, 10))


# --------------------------------------------------------------------------- unsupported values


def _function() -> None: ...


def _quietly(make: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prototype / deprecated tensor kinds warn when created
        return make()


@pytest.mark.parametrize(
    ("value", "type_name", "where"),
    [
        ({"a": [1, {Frozen(1)}]}, "inside a set", "payload['a'][1] (member Frozen(x=1))"),
        ({"a": frozenset({(1, Frozen(2))})}, "inside a set", "payload['a'] (member (1, Frozen(x=2)))[1]"),
        ({"s": slice(0, 1j)}, "slice bound of type complex", "payload['s']"),
        ({"s": (slice(0, torch.ones(1)),)}, "slice bound of type Tensor", "payload['s'][0]"),
        ({"d": Pair(1, object())}, "object", "payload['d'].right"),
        ({"cls": Pair}, "type", "payload['cls']"),
        ({(torch.ones(1),): 1}, "Tensor in a dict key", "payload (key (tensor([1.]),))[0]"),
        ({"k": {(1, b"x" * 600): 1}}, "bytes in a dict key", "payload['k'] (key (1, b'xxx"),
        ({Frozen(1): 1}, "inside a dict key", "payload (key Frozen(x=1))"),
        ([object()], "object", "payload[0]"),
        ({"f": (1, _function)}, "function", "payload['f'][1]"),
        ({"big": 2**64}, "int", "payload['big']"),
        ({"small": [-(2**63) - 1]}, "int", "payload['small'][0]"),
        ({"sp": torch.eye(3).to_sparse()}, "sparse", "payload['sp']"),
        ({"o": np.array([None, 1], dtype=object)}, "object", "payload['o']"),
        ({"c": 1 + 2j}, "complex", "payload['c']"),
        (
            {"q": _quietly(lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8))},
            "quint8",
            "payload['q']",
        ),
        ({"m": [torch.empty(3, device="meta")]}, "meta", "payload['m'][0]"),
        (
            {"n": _quietly(lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]))},
            "nested",
            "payload['n']",
        ),
        ({"v": np.void(b"ab")}, "void", "payload['v']"),
        ({"rec": np.zeros(2, dtype=[("x", "i4")])}, "dtype", "payload['rec']"),
        ({"s": ["ok", "bad \ud800 surrogate"]}, "str", "payload['s'][1]"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_values_name_type_and_path(value: Any, type_name: str, where: str) -> None:
    with pytest.raises(UnsupportedTypeError) as info:
        codec.plan(value)
    message = str(info.value)
    assert type_name in message and where in message, message
    with pytest.raises(UnsupportedTypeError):
        codec.encode(value)


def test_unsupported_is_a_type_error_and_deep_payloads_are_refused() -> None:
    assert issubclass(UnsupportedTypeError, TypeError)
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(UnsupportedTypeError, match="nest"):
        codec.encode(deep)
    deep_tuple: Any = ()
    for _ in range(100_000):
        deep_tuple = (deep_tuple,)
    with pytest.raises(UnsupportedTypeError, match="nest"):
        codec.encode(deep_tuple)


@pytest.mark.parametrize(
    "module", sorted(path.name for path in Path(inspect.getsourcefile(codec)).parent.glob("*.py"))
)
def test_no_pickle_in_the_codec(module: str) -> None:
    source = (Path(inspect.getsourcefile(codec)).parent / module).read_text()
    tree = ast.parse(source)
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    serialisers = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "copyreg", "shelve"}
    assert not imported & serialisers
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"pickle", "loads", "load", "Unpickler", "__import__", "eval", "exec", "allow_pickle"}


def test_no_pickle_at_run_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import _pickle

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pickle used")

    for module in (pickle, _pickle):
        for name in ("loads", "load", "dumps", "dump", "Unpickler", "Pickler"):
            monkeypatch.setattr(module, name, refuse)
    value = {"t": torch.ones(3), "a": np.ones(2, ">f4"), "s": np.float16(2), "b": b"x" * 600, "tu": (1, [2])}
    assert_same(round_trip(value), expected(value))
    assert_same(round_trip(value, copy=True), expected(value))


# --------------------------------------------------------------------------- hostile frames

E = msgpack.ExtType


def packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def forge(
    header: Any,
    buffers: Sequence[bytes | int] = (),
    *,
    magic: bytes = b"OMF1",
    version: int = 1,
    count: int | None = None,
    header_len: int | None = None,
    nbytes: int | None = None,
    lengths: list[int] | None = None,
) -> bytearray:
    """A frame built by hand from the documented layout. A buffer given as an int is that many zeros."""
    header = header if isinstance(header, (bytes, bytearray)) else packb(header)
    datas = [bytes(b) if isinstance(b, int) else b for b in buffers]
    table = [len(d) for d in datas] if lengths is None else lengths
    pos = 24 + 8 * len(datas) + len(header)
    offsets = []
    for data in datas:
        pos = (pos + 63) // 64 * 64
        offsets.append(pos)
        pos += len(data)
    frame = bytearray(pos)
    struct.pack_into(
        "<4sHHIIQ",
        frame,
        0,
        magic,
        version,
        0,
        len(datas) if count is None else count,
        len(header) if header_len is None else header_len,
        pos if nbytes is None else nbytes,
    )
    struct.pack_into(f"<{len(table)}Q", frame, 24, *table)
    frame[24 + 8 * len(datas) : 24 + 8 * len(datas) + len(header)] = header
    for offset, data in zip(offsets, datas, strict=True):
        frame[offset : offset + len(data)] = data
    return frame


def tensor_ext(name: Any, shape: Any, index: Any) -> E:
    return E(codec.EXT_TENSOR, packb([name, shape, index]))


def array_ext(dtype: Any, shape: Any, index: Any) -> E:
    return E(codec.EXT_NDARRAY, packb([dtype, shape, index]))


def image_ext(mode: Any = "L", size: Any = (4, 2), index: Any = 0, palette: Any = None) -> E:
    return E(codec.EXT_IMAGE, packb([mode, list(size) if isinstance(size, tuple) else size, index, palette]))


def raw_ext(code: int, data: bytes) -> bytes:
    """An ext object of any code (msgpack.ExtType refuses negative ones): ext8 header, code, data."""
    return bytes([0xC7, len(data), code & 0xFF]) + data


def cuda_ipc_ext(dtype: str = "float32", **overrides: Any) -> msgpack.ExtType:
    """A CUDA IPC tensor entry, well-formed unless `overrides` say otherwise (4 float32 in 16 bytes)."""
    fields = {
        "shape": [4],
        "stride": [1],
        "storage_offset": 0,
        "device": 0,
        "handle": b"h" * 64,
        "storage_size_bytes": 16,
        "storage_offset_bytes": 0,
        "ref_counter_handle": b"/torch_1_2",
        "ref_counter_offset": 0,
        "event_handle": b"e" * 64,
        "event_sync_required": True,
    } | overrides
    return E(codec.EXT_CUDA_IPC, packb([dtype, *(fields[name] for name in cuda_ipc.FIELDS)]))


def nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def nested_tuples(depth: int, core: bytes = b"\xc0", code: int = codec.EXT_TUPLE) -> bytes:
    """`depth` tuples (or sets, by `code`) each holding the next, built in linear time: ext header +
    fixarray(1) + inner."""
    sizes = []
    size = len(core)
    for _ in range(depth):
        size += 1  # the fixarray(1) byte
        sizes.append(size)
        size += 6 if size >= 65536 else 4 if size >= 256 else 3
    parts = []
    for size in reversed(sizes):
        if size < 256:
            parts.append(bytes([0xC7, size, code, 0x91]))
        elif size < 65536:
            parts.append(b"\xc8" + struct.pack(">H", size) + bytes([code, 0x91]))
        else:
            parts.append(b"\xc9" + struct.pack(">I", size) + bytes([code, 0x91]))
    return b"".join(parts) + core


def nested_sets(depth: int) -> bytes:
    return nested_tuples(depth, code=codec.EXT_FROZENSET)


def test_forging_helpers_match_the_encoder() -> None:
    value = {"t": torch.arange(6, dtype=torch.int16), "n": (1, ("x",)), "b": b"y" * 600}
    buffers = [torch.arange(6, dtype=torch.int16).numpy().tobytes(), b"y" * 600]
    header = {
        "t": tensor_ext("int16", [6], 0),
        "n": E(codec.EXT_TUPLE, packb([1, E(codec.EXT_TUPLE, packb(["x"]))])),
        "b": E(codec.EXT_BYTES, packb(1)),
    }
    assert bytes(forge(header, buffers)) == bytes(codec.encode(value))
    assert_same(codec.decode(forge(nested_tuples(3, packb("x")))), ((("x",),),))
    assert_same(
        codec.decode(forge(nested_tuples(40, packb(b"z" * 300)))),
        codec.decode(codec.encode(_nest_tuple(b"z" * 300, 40))),
    )


def _nest_tuple(core: Any, depth: int) -> Any:
    for _ in range(depth):
        core = (core,)
    return core


VALID = {
    "t": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "bf": torch.ones(2, dtype=torch.bfloat16),
    "a": np.arange(5, dtype=">i8"),
    "b": bytes(range(256)) * 3,
    "tu": (1, "two", (3.0, None), [True]),
    7: {"np": np.float16(3), (1, 2): b"k"},
    "e": torch.empty(0, 2),
}
VALID_FRAME = bytes(codec.encode(VALID))


HOSTILE = {
    "bad magic": forge(None, magic=b"OMF2"),
    "bad version": forge(None, version=2),
    "frame length past the end": forge(None, nbytes=10**12),
    "frame length below the prefix": forge(None, nbytes=3),
    "huge header length": forge(None, header_len=2**32 - 1),
    "huge buffer count": forge(None, count=2**32 - 1),
    "buffer table claims a terabyte": forge(tensor_ext("uint8", [2**40], 0), [8], lengths=[2**40]),
    "tensor claims a terabyte": forge(tensor_ext("float32", [2**38], 0), [64]),
    "array claims a terabyte": forge(array_ext("<f4", [2**38], 0), [64]),
    "shape product overflows int64": forge(tensor_ext("uint8", [2**40, 2**40], 0), [16]),
    "empty tensor with huge dims": forge(tensor_ext("float32", [0, 2**61, 2**61], 0), [0]),
    "empty array with huge dims": forge(array_ext("<f4", [0, 2**61, 2**61], 0), [0]),
    "bytes claims a terabyte": forge(E(codec.EXT_BYTES, packb(0)), [600], lengths=[2**40]),
    "negative dim": forge(tensor_ext("uint8", [-8], 0), [8]),
    "dim 2**62": forge(tensor_ext("uint8", [2**62], 0), [8]),
    "dim 2**64-1": forge(tensor_ext("uint8", [2**64 - 1], 0), [8]),
    "float dim": forge(tensor_ext("uint8", [8.0], 0), [8]),
    "bool dim": forge(tensor_ext("uint8", [True] * 8, 0), [8]),
    "65 dims": forge(tensor_ext("uint8", [1] * 65, 0), [1]),
    "shape is a dict": forge(tensor_ext("uint8", {"a": 1}, 0), [8]),
    "shape is an int": forge(array_ext("|u1", 8, 0), [8]),
    "buffer index out of range": forge(tensor_ext("uint8", [8], 1), [8]),
    "negative buffer index": forge(tensor_ext("uint8", [8], -1), [8]),
    "bool buffer index": forge(tensor_ext("uint8", [8], True), [8, 8]),
    "str buffer index": forge(array_ext("|u1", [8], "0"), [8]),
    "bytes index out of range": forge(E(codec.EXT_BYTES, packb(3)), [600]),
    "bytes index is a list": forge(E(codec.EXT_BYTES, packb([0])), [600]),
    "buffer smaller than the tensor": forge(tensor_ext("float32", [8], 0), [16]),
    "buffer larger than the tensor": forge(tensor_ext("float32", [2], 0), [16]),
    "unknown torch dtype": forge(tensor_ext("float128", [1], 0), [16]),
    "torch-prefixed dtype": forge(tensor_ext("torch.float32", [1], 0), [4]),
    "quantized dtype": forge(tensor_ext("qint8", [1], 0), [1]),
    "sub-byte dtype": forge(tensor_ext("uint4", [2], 0), [1]),
    "dtype is an int": forge(tensor_ext(5, [1], 0), [4]),
    "dtype is bytes": forge(tensor_ext(b"float32", [1], 0), [4]),
    "numpy object dtype": forge(array_ext("|O", [1], 0), [8]),
    "numpy object dtype O": forge(array_ext("O", [1], 0), [8]),
    "numpy void dtype": forge(array_ext("|V8", [1], 0), [8]),
    "numpy record dtype": forge(array_ext("i4,i4", [1], 0), [8]),
    "numpy subarray dtype": forge(array_ext("(2,)i4", [1], 0), [8]),
    "numpy zero-size dtype": forge(array_ext("<U0", [4], 0), [0]),
    "numpy giant itemsize": forge(array_ext("S2000000000", [512], 0), [64]),
    "numpy dtype garbage": forge(array_ext("<<<nonsense", [1], 0), [8]),
    "numpy dtype too long": forge(array_ext("<" + "i4" * 40, [1], 0), [8]),
    "numpy scalar object dtype": forge(E(codec.EXT_NPSCALAR, packb(["|O", b"\x00" * 8]))),
    "numpy scalar wrong size": forge(E(codec.EXT_NPSCALAR, packb(["<f8", b"\x00" * 3]))),
    "numpy scalar raw is str": forge(E(codec.EXT_NPSCALAR, packb(["<f8", "12345678"]))),
    "tensor fields a dict": forge(E(codec.EXT_TENSOR, packb({"dtype": "uint8"}))),
    "tensor fields an int": forge(E(codec.EXT_TENSOR, packb(3))),
    "tensor fields too few": forge(E(codec.EXT_TENSOR, packb(["uint8", [1]]))),
    "tensor fields too many": forge(E(codec.EXT_TENSOR, packb(["uint8", [1], 0, 0])), [1]),
    "array fields a str": forge(E(codec.EXT_NDARRAY, packb("<f4"))),
    "numpy scalar fields a dict": forge(E(codec.EXT_NPSCALAR, packb({}))),
    "tuple holds a dict": forge(E(codec.EXT_TUPLE, packb({"a": 1}))),
    "tuple holds an int": forge(E(codec.EXT_TUPLE, packb(1))),
    "tuple holds garbage": forge(E(codec.EXT_TUPLE, b"\xc1")),
    "tensor fields not msgpack": forge(E(codec.EXT_TENSOR, b"\xdd\xff\xff\xff\xff")),
    "CUDA IPC fields too few": forge(E(codec.EXT_CUDA_IPC, packb(["float32", [4]]))),
    "CUDA IPC unknown dtype": forge(cuda_ipc_ext(dtype="float99")),
    "CUDA IPC stride rank differs": forge(cuda_ipc_ext(stride=[1, 1])),
    "CUDA IPC negative offset": forge(cuda_ipc_ext(storage_offset=-1)),
    "CUDA IPC device a str": forge(cuda_ipc_ext(device="0")),
    "CUDA IPC handle a str": forge(cuda_ipc_ext(handle="h" * 64)),
    "CUDA IPC handle too long": forge(cuda_ipc_ext(handle=b"h" * 1000)),
    "CUDA IPC no ref counter": forge(cuda_ipc_ext(ref_counter_handle=None)),
    "CUDA IPC event sync an int": forge(cuda_ipc_ext(event_sync_required=1)),
    "CUDA IPC view beyond storage": forge(cuda_ipc_ext(shape=[4], storage_size_bytes=12)),
    "CUDA IPC strided view beyond storage": forge(cuda_ipc_ext(shape=[2, 2], stride=[4, 1], storage_size_bytes=16)),
    "set holds an int": forge(E(codec.EXT_SET, packb(1))),
    "frozenset holds a dict": forge(E(codec.EXT_FROZENSET, packb({"a": 1}))),
    "set holds garbage": forge(E(codec.EXT_SET, b"\xc1")),
    "set member a list": forge(E(codec.EXT_SET, packb([[1, 2]]))),
    "frozenset member a dict": forge(E(codec.EXT_FROZENSET, packb([{"a": 1}]))),
    "set member a set": forge(E(codec.EXT_SET, packb([E(codec.EXT_SET, packb([1]))]))),
    "set member an array": forge(E(codec.EXT_SET, packb([array_ext("|u1", [8], 0)])), [8]),
    "set member an image": forge(E(codec.EXT_FROZENSET, packb([image_ext()])), [8]),
    "set member a list in a tuple": forge(E(codec.EXT_SET, packb([E(codec.EXT_TUPLE, packb([[1]]))]))),
    "set as a map key": forge({E(codec.EXT_SET, packb([1])): 1}),
    "tensor as a map key": forge({tensor_ext("uint8", [1], 0): 1}, [1]),
    "tuple of bytes out of band as a map key": forge(
        {E(codec.EXT_TUPLE, packb([E(codec.EXT_BYTES, packb(0))])): 1}, [600]
    ),
    "image as a map key": forge({image_ext(): 1}, [8]),
    "frozenset of tensors as a map key": forge(
        {E(codec.EXT_FROZENSET, packb([tensor_ext("uint8", [1], 0)])): 1}, [1]
    ),
    "nested sets 65": forge(nested_sets(codec.MAX_TUPLE_DEPTH + 1)),
    "nested sets 100k": forge(nested_sets(100_000)),
    "slice fields too few": forge(E(codec.EXT_SLICE, packb([1, 2]))),
    "slice fields a dict": forge(E(codec.EXT_SLICE, packb({"start": 1}))),
    "slice bound a list": forge(E(codec.EXT_SLICE, packb([[1], None, None]))),
    "slice bound bytes": forge(E(codec.EXT_SLICE, packb([b"x", None, None]))),
    "slice bound a tensor": forge(E(codec.EXT_SLICE, packb([tensor_ext("uint8", [1], 0), None, None])), [1]),
    "slice bound not msgpack": forge(E(codec.EXT_SLICE, b"\xc1")),
    "image fields too few": forge(E(codec.EXT_IMAGE, packb(["L", [4, 2], 0])), [8]),
    "image fields a dict": forge(E(codec.EXT_IMAGE, packb({"mode": "L"})), [8]),
    "image unknown mode": forge(image_ext(mode="XYZ"), [8]),
    "image mode not a str": forge(image_ext(mode=1), [8]),
    "image mode bytes": forge(image_ext(mode=b"L"), [8]),
    "image buffer smaller than the size": forge(image_ext(size=(4, 4)), [8]),
    "image buffer larger than the size": forge(image_ext(mode="RGB", size=(2, 2)), [16]),
    "image 1-bit rows unpadded": forge(image_ext(mode="1", size=(9, 2)), [3]),
    "image claims a terabyte": forge(image_ext(mode="RGBA", size=(2**20, 2**18)), [64]),
    "image claims a terabyte in its table": forge(
        image_ext(mode="L", size=(2**20, 2**20)), [64], lengths=[2**40]
    ),
    "image side past Pillow's bound": forge(image_ext(size=(2**31, 1)), [8]),
    "image huge side": forge(image_ext(size=(2**64 - 1, 0)), [0]),
    "image negative size": forge(image_ext(size=(-4, -2)), [8]),
    "image float size": forge(image_ext(size=(4.0, 2)), [8]),
    "image bool size": forge(image_ext(size=(True, 8)), [8]),
    "image three dims": forge(image_ext(size=(2, 2, 2)), [8]),
    "image size a dict": forge(image_ext(size={"w": 4}), [8]),
    "image index out of range": forge(image_ext(index=1), [8]),
    "image index a str": forge(image_ext(index="0"), [8]),
    "image palette on an L image": forge(image_ext(palette=["RGB", b"\x00" * 3]), [8]),
    "image palette bad mode": forge(image_ext(mode="P", palette=["CMYK", b"\x00" * 4]), [8]),
    "image palette not bytes": forge(image_ext(mode="P", palette=["RGB", [0, 0, 0]]), [8]),
    "image palette ragged": forge(image_ext(mode="P", palette=["RGB", b"\x00" * 4]), [8]),
    "image palette too long": forge(image_ext(mode="P", palette=["RGB", b"\x00" * 771]), [8]),
    "image palette a str": forge(image_ext(mode="P", palette="RGB"), [8]),
    "unknown ext 0": forge(E(0, b"x")),
    "unknown ext 12": forge(E(12, b"x")),
    "unknown ext 127": forge(E(127, b"")),
    "negative ext -2": forge(raw_ext(-2, b"x")),
    "negative ext -128": forge(raw_ext(-128, b"x")),
    "timestamp ext -1 of a bad size": forge(raw_ext(-1, b"\x00" * 5)),
    "nested lists 100k": forge(nested_arrays(100_000)),
    "nested maps 100k": forge(b"\x81\xc0" * 100_000 + b"\xc0"),
    "nested tuples 100k": forge(nested_tuples(100_000)),
    "nested tuples 65": forge(nested_tuples(codec.MAX_TUPLE_DEPTH + 1)),
    "header not msgpack": forge(b"\xc1"),
    "header trailing data": forge(b"\xc0\xc0"),
    "header truncated array": forge(b"\x93\x01"),
    "header array32 claims 4G items": forge(b"\xdd\xff\xff\xff\xff\x01"),
    "header map32 claims 4G items": forge(b"\xdf\xff\xff\xff\xff\x01\x01"),
    "header bin32 claims 4 GiB": forge(b"\xc6\xff\xff\xff\xff\x01"),
    "header str32 claims 4 GiB": forge(b"\xdb\xff\xff\xff\xff\x01"),
    "header ext32 claims 4 GiB": forge(b"\xc9\xff\xff\xff\xff\x04\x01"),
    "invalid utf-8 str": forge(b"\xa2\xff\xfe"),
    "unhashable map key": forge(b"\x81\x91\x01\x01"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_frame_raises_frame_error(name: str) -> None:
    frame = HOSTILE[name]
    with pytest.raises(FrameError):
        codec.decode(frame)
    with pytest.raises(FrameError):
        codec.decode(bytes(frame), copy=True)
    shifted = bytearray(b"\x00" * 5) + frame
    with pytest.raises(FrameError):
        codec.decode(shifted, 5)


def test_frame_error_is_a_value_error_with_a_clear_message() -> None:
    assert issubclass(FrameError, ValueError)
    with pytest.raises(FrameError, match="not an omni-mesh frame"):
        codec.decode(b"GARBAGE" * 10)
    with pytest.raises(FrameError, match="truncated"):
        codec.decode(VALID_FRAME[:10])
    with pytest.raises(FrameError, match="unknown extension type"):
        codec.decode(HOSTILE["unknown ext 12"])
    with pytest.raises(FrameError, match="dtype"):
        codec.decode(HOSTILE["numpy object dtype"])


TIMESTAMPS = {
    "top level": forge(raw_ext(-1, b"\x00\x00\x00\x05")),
    "in a list": forge(b"\x92\x01" + bytes([0xD6, 0xFF]) + b"\x00" * 4),
    "as a map key": forge(b"\x81" + bytes([0xD7, 0xFF]) + b"\x00" * 8 + b"\x01"),
    "in a tuple": forge(E(codec.EXT_TUPLE, b"\x91" + bytes([0xD6, 0xFF]) + b"\x00" * 4)),
    "96-bit": forge(b"\x91" + raw_ext(-1, b"\x00" * 4 + b"\x7f" * 8)),
}


@pytest.mark.parametrize("where", sorted(TIMESTAMPS))
def test_msgpack_timestamps_bring_no_foreign_type(where: str) -> None:
    # Ext type -1 is msgpack's own timestamp, decoded by msgpack without asking the codec.
    decode_or_frame_error(TIMESTAMPS[where])


def test_valid_frame_decodes() -> None:
    assert_same(codec.decode(VALID_FRAME), expected(VALID))


def test_every_truncation_is_refused() -> None:
    for n in range(len(VALID_FRAME)):
        cut = VALID_FRAME[:n]
        with pytest.raises(FrameError):
            codec.decode(cut)
        if n >= 24:  # the same cut, with its prefix claiming exactly what is left
            patched = bytearray(cut)
            struct.pack_into("<Q", patched, 16, n)
            with pytest.raises(FrameError):
                codec.decode(patched)


def test_frame_length_checks_the_prefix() -> None:
    assert codec.frame_length(VALID_FRAME) == len(VALID_FRAME)
    with pytest.raises(FrameError):
        codec.frame_length(VALID_FRAME[:23])
    with pytest.raises(FrameError):
        codec.frame_length(b"X" + VALID_FRAME[1:])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("set member a list", "a set cannot hold a list"),
        ("tensor as a map key", "a dict key holds a buffer reference"),
        ("set member an image", "a set cannot hold a PIL image"),
        ("set member a list in a tuple", "not hashable"),
        ("nested sets 65", "nest deeper"),
        ("slice bound a list", "slice bounds"),
        ("image unknown mode", "unknown mode 'XYZ'"),
        ("image buffer smaller than the size", "buffer 0 holds 8 bytes, its leaf needs 16"),
        ("image claims a terabyte", "its leaf needs 1099511627776"),
        ("image side past Pillow's bound", "bad size"),
        ("image palette on an L image", "bad palette for mode 'L'"),
    ],
)
def test_hostile_new_types_say_what_is_wrong(name: str, message: str) -> None:
    with pytest.raises(FrameError, match=re.escape(message)):
        codec.decode(HOSTILE[name])


def decode_or_frame_error(frame: bytes | bytearray) -> None:
    try:
        value = codec.decode(frame)
    except FrameError:
        return
    assert_carried_only(value)


@settings(FAST, max_examples=300)
@given(st.lists(st.tuples(st.integers(0, len(VALID_FRAME) - 1), st.integers(0, 7)), min_size=1, max_size=4))
def test_bit_flips_give_frame_error_or_a_value(flips: list[tuple[int, int]]) -> None:
    frame = bytearray(VALID_FRAME)
    for position, bit in flips:
        frame[position] ^= 1 << bit
    decode_or_frame_error(frame)


def test_every_single_bit_flip_of_prefix_table_and_header() -> None:
    _m, _v, _f, count, header_len, _n = struct.unpack_from("<4sHHIIQ", VALID_FRAME)
    for position in range(24 + 8 * count + header_len):
        for bit in range(8):
            frame = bytearray(VALID_FRAME)
            frame[position] ^= 1 << bit
            decode_or_frame_error(frame)


@settings(FAST, max_examples=200)
@given(st.binary(max_size=400))
def test_random_bytes_give_frame_error(data: bytes) -> None:
    with pytest.raises(FrameError):
        codec.decode(data)


@settings(FAST, max_examples=300)
@given(
    st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
    st.one_of(st.integers(0, 400), st.integers(0, 2**32 - 1)),
    st.binary(max_size=400),
)
def test_random_body_behind_a_valid_prefix(count: int, header_len: int, body: bytes) -> None:
    frame = bytearray(24) + body
    struct.pack_into("<4sHHIIQ", frame, 0, b"OMF1", 1, 0, count, header_len, len(frame))
    decode_or_frame_error(frame)


@settings(FAST, max_examples=200)
@given(st.binary(max_size=300))
def test_random_header_bytes(header: bytes) -> None:
    decode_or_frame_error(forge(header, [16, 600]))


_MEMORY_GUARD = r"""
import re, resource, sys
import msgpack
from omni_mesh import codec

frames = msgpack.unpackb(sys.stdin.buffer.read())
status = open("/proc/self/status").read()
vm = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
limit = vm + (768 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:  # the guard works: a 2 GiB allocation fails under it
    bytearray(2 << 30)
    sys.exit("RLIMIT_AS does not limit allocations here")
except MemoryError:
    pass
for name, frame in frames:
    try:
        codec.decode(frame)
        codec.decode(bytes(frame), copy=True)
    except codec.FrameError as exc:
        if "MemoryError" in str(exc):
            sys.exit(f"{name}: tried to allocate: {exc}")
    else:
        sys.exit(f"{name}: decoded")
print("ok", len(frames))
"""


def test_forged_terabyte_claims_allocate_nothing_large() -> None:
    names = [
        name
        for name in HOSTILE
        if "terabyte" in name or "claims" in name or "huge" in name or "giant" in name or "100k" in name
    ]
    frames = [(name, bytes(HOSTILE[name])) for name in names]
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_GUARD],
        input=msgpack.packb(frames),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.decode().split() == ["ok", str(len(frames))]


def test_nested_tuples_do_not_amplify_memory() -> None:
    # Every tuple level hands its body to the next as a fresh bytes object; a hostile frame must not
    # turn that into depth x frame-size allocations.
    frame = forge(nested_tuples(100_000, packb("x" * 200_000)))
    tracemalloc.start()
    try:
        with pytest.raises(FrameError):
            codec.decode(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(frame), f"decoding a {len(frame)}-byte frame peaked at {peak} bytes"


# --------------------------------------------------------------------------- CUDA tensors by IPC handle


def test_asking_for_cuda_ipc_changes_nothing_for_host_payloads() -> None:
    value = {"x": torch.arange(100_000), "y": [np.ones(3), b"z" * 600, (1, "a")]}
    policy = codec.CudaIpcExports()
    assert codec.split(value, device=policy)[0] == codec.split(value)[0]
    assert policy.exports == []


def test_an_empty_cuda_storage_is_shared_with_no_handle() -> None:
    """torch shares an empty storage with handle, reference counter, event and sync flag all None."""
    empty = {"handle": None, "ref_counter_handle": None, "event_handle": None, "event_sync_required": None}
    frame = forge({"e": cuda_ipc_ext(shape=[0], storage_size_bytes=0, **empty)})
    if torch.cuda.is_available():
        assert codec.decode(frame)["e"].shape == (0,)
    else:
        with pytest.raises(cuda_ipc.CudaIpcUnavailable):  # well-formed: only the mapping is missing
            codec.decode(frame)
    with pytest.raises(FrameError, match="without a handle"):
        codec.decode(forge({"e": cuda_ipc_ext(storage_size_bytes=16, **empty)}))


def test_the_exporting_process_decodes_its_own_cuda_ipc_entries_from_its_tensors() -> None:
    """CUDA cannot map a process's own IPC handle: a get in the putting process hands its tensors over
    (CPU tensors stand in for CUDA ones here, the frame is the same)."""
    frame = forge({"a": cuda_ipc_ext(), "n": 1, "b": [cuda_ipc_ext(dtype="int16", shape=[2], storage_size_bytes=4)]})
    mine = [torch.arange(4, dtype=torch.float32), torch.arange(2, dtype=torch.int16)]
    decoded = codec.decode(frame, cuda_local=mine)
    assert decoded["a"] is mine[0] and decoded["b"][0] is mine[1] and decoded["n"] == 1
    assert codec.decode(frame, copy=True, cuda_local=mine)["a"] is not mine[0]
    with pytest.raises(FrameError, match="does not match its export"):
        codec.decode(frame, cuda_local=[mine[1], mine[0]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a process without CUDA")
def test_a_cuda_ipc_tensor_in_a_process_without_cuda_is_a_clear_error() -> None:
    frame = forge({"hidden": cuda_ipc_ext()})
    with pytest.raises(cuda_ipc.CudaIpcUnavailable, match=r"cuda:0.*no CUDA device.*cuda_ipc: false"):
        codec.decode(frame)
    # A well-formed entry is not a malformed frame, and it is never cached (handles are single-use).
    with pytest.raises(cuda_ipc.CudaIpcUnavailable):
        codec.decode(frame)


# --------------------------------------------------------------------------- device tensors (DeviceLeaves)


def test_device_leaves_travel_outside_the_frame_and_decode_from_their_buffers() -> None:
    value = {"big": torch.randn(64, 64), "odd": torch.arange(30, dtype=torch.int16).view(5, 6).t(), "small": torch.ones(2)}
    policy = codec.DeviceLeaves(host_min_bytes=32)  # CPU tensors stand in for CUDA ones here
    header, leaves, lengths = codec.split(value, device=policy)
    assert len(policy.tensors) == 2 and all(t.is_contiguous() for t in policy.tensors)
    frame = bytearray(codec.FramePlan(header, leaves, lengths).nbytes)
    codec.FramePlan(header, leaves, lengths).write_into(frame)
    assert len(frame) < 1024  # the device tensors' bytes are not in it
    received = [t.reshape(-1).view(torch.uint8).clone() for t in policy.tensors]
    decoded = codec.decode(frame, device_buffers=received)
    assert_same(decoded, value)
    assert decoded["big"].data_ptr() == received[0].data_ptr()  # a view over the received buffer
    copied = codec.decode(frame, copy=True, device_buffers=received)
    assert copied["big"].data_ptr() != received[0].data_ptr()
    with pytest.raises(FrameError, match="no received buffer"):
        codec.decode(frame)
    with pytest.raises(FrameError, match="holds 3 bytes"):
        codec.decode(frame, device_buffers=[torch.zeros(3, dtype=torch.uint8), received[1]])
    with pytest.raises(FrameError, match="device tensor extension needs 3 fields"):
        codec.decode(forge(E(codec.EXT_DEVICE_TENSOR, packb(["float32", [1]]))))
