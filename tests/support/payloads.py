"""The payloads tests hand connectors, and the one comparison of what arrives.

Every entry of PAYLOADS builds the same value in every process (fixed seeds), so a peer process can
check what it received by name. `mismatch` says where and how two values differ; `assert_same` fails
with that text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

MiB = 1 << 20


def _every_kind() -> dict[Any, Any]:
    """Every kind of value a stage hands a connector (with a 4 MiB tensor), built the same way in every process."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(6, 8, generator=gen)
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "f64": base.double(),
        "i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "zero_d": torch.tensor(3.5),
        "zero_d_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 5),
        "empty_i32": torch.empty(3, 0, dtype=torch.int32),
        "transposed": base.t(),
        "strided": base[:, ::3],
        "big": torch.randn(1 << 20, generator=gen),  # 4 MiB
        "np_f64": np.arange(10, dtype=np.float64).reshape(2, 5),
        "np_i16": np.array([1, -2, 3], dtype=np.int16),
        "np_fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "np_empty": np.zeros((0, 2), dtype=np.uint16),
        "np_scalar": np.float32(1.5),
        "bytes_small": b"\x00\x01hi",
        "bytes_big": bytes(range(256)) * 40,
        "str": "héllo wörld ✓",
        "int": 2**62,
        "neg": -7,
        "float": 0.1,
        "true": True,
        "none": None,
        1: "an int key",
        "list": [1, "two", torch.ones(2, dtype=torch.float16), [None, 3.0]],
        "tuple": (torch.zeros(3, dtype=torch.int32), ("nested", 1.5), ()),
        "nested": {"a": {"b": [torch.arange(3), {"c": (b"x" * 600,)}]}},
    }


def _mixed() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    return {
        "hidden": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, generator=g).half(),
        "ids": torch.randint(0, 1000, (17,), generator=g, dtype=torch.int64),
        "mask": torch.rand(6, generator=g) > 0.5,
        "bytes_tensor": torch.arange(256, dtype=torch.uint8),
        "complex": torch.randn(3, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.arange(24.0).reshape(4, 6).t(),
        "strided": torch.arange(100, dtype=torch.int32)[::3],
        "array": np.arange(12, dtype=np.float64).reshape(3, 4),
        "array_f16": np.linspace(0, 1, 5, dtype=np.float16),
        "array_strided": np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2],
        "array_empty": np.zeros((2, 0), dtype=np.int8),
        "np_scalar": np.float32(2.5),
        "blob": bytes(range(256)) * 4,
        "small_blob": b"abc",
        "text": "héllo wörld",
        "big_int": 2**40,
        "negative": -7,
        "ratio": 1.25,
        "flag": True,
        "nothing": None,
        "nested": [{"a": (1, "x", None)}, [torch.ones(2)], (), {}],
        "pair": (torch.zeros(2, dtype=torch.float64), "t"),
        7: "int key",
    }


@dataclasses.dataclass
class Chunk:
    """A dataclass as vllm-omni's stages hand them over: it arrives as a dict of its fields."""

    tokens: torch.Tensor
    window: slice
    inner: Any = None


def _vllm_omni_types(as_received: bool = False) -> dict[str, Any]:
    """The types vllm-omni's serializer carries; `as_received`: what a get returns (dataclasses as
    dicts of their fields, torch.Size as a tuple)."""
    from PIL import Image

    tokens = torch.arange(12).reshape(3, 4)
    chunk: Any = Chunk(tokens, slice(0, 8, 2), Chunk(tokens[0], slice(None)))
    if as_received:
        chunk = {"tokens": tokens, "window": slice(0, 8, 2), "inner": {"tokens": tokens[0], "window": slice(None), "inner": None}}
    palette = Image.frombytes("P", (16, 16), bytes(range(256)))
    palette.putpalette(bytes(range(256)) * 3)
    return {
        "set": {1, "two", (3, None), b"s" * 600},
        "frozenset": frozenset({2.5, frozenset({"x"})}),
        "slice": slice(-1, None, -1),
        "chunk": chunk,
        "rgb": Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36),
        "palette": palette,
        "tuple": ((2, 3) if as_received else torch.Size([2, 3]), ()),
    }


PAYLOADS: dict[str, Callable[[], Any]] = {
    "vllm_omni_types": _vllm_omni_types,
    "vllm_omni_types_received": lambda: _vllm_omni_types(as_received=True),
    "every_kind": _every_kind,
    "mixed": _mixed,
    "none": lambda: None,
    "bytes": lambda: b"\x00\xff" * 3000,
    "str": lambda: "plain text " * 10,
    "int": lambda: 123456789,
    "float": lambda: 3.14159,
    "bool": lambda: False,
    "tensor": lambda: torch.arange(1000, dtype=torch.float32).reshape(10, 100),
    "bf16_0d": lambda: torch.tensor(1.5, dtype=torch.bfloat16),
    "ndarray": lambda: np.arange(64, dtype=np.uint32).reshape(8, 8),
    "list": lambda: [1, "two", 3.0, None, [torch.ones(3, dtype=torch.int8)]],
    "tuple": lambda: (torch.full((2, 2), 9, dtype=torch.int16), b"x" * 600),
    "8mib": lambda: {"audio": torch.arange(2 * MiB, dtype=torch.float32), "sr": 24000},
    "16mib": lambda: torch.ones(16 * MiB, dtype=torch.uint8),
}


def payload(name: str) -> Any:
    return PAYLOADS[name]()


#: The payloads a test puts; `received(name)` names what a get of each returns.
SENT = [name for name in PAYLOADS if not name.endswith("_received")]


def received(name: str) -> str:
    return f"{name}_received" if f"{name}_received" in PAYLOADS else name


def mismatch(expected: Any, got: Any, path: str = "payload") -> str | None:
    """Where and how `got` differs from `expected` (types, dtypes, shapes and values), or None."""
    both_tensors = isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
    if type(expected) is not type(got) and not both_tensors:
        return f"{path}: type {type(got).__name__}, expected {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        if (expected.dtype, expected.shape) != (got.dtype, got.shape):
            return f"{path}: {got.dtype}{tuple(got.shape)}, expected {expected.dtype}{tuple(expected.shape)}"
        return None if torch.equal(expected, got) else f"{path}: tensor values differ"
    if isinstance(expected, np.ndarray):
        if (expected.dtype, expected.shape) != (got.dtype, got.shape):
            return f"{path}: {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
        return None if np.array_equal(expected, got) else f"{path}: array values differ"
    if isinstance(expected, dict):
        if list(expected) != list(got):
            return f"{path}: keys {list(got)}, expected {list(expected)}"
        for key in expected:
            found = mismatch(expected[key], got[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(got):
            return f"{path}: {len(got)} items, expected {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            found = mismatch(e, g, f"{path}[{i}]")
            if found:
                return found
        return None
    if hasattr(expected, "getpalette") and hasattr(expected, "tobytes"):  # a PIL image
        same = (expected.mode, expected.size, expected.tobytes(), expected.getpalette()) == (
            got.mode, got.size, got.tobytes(), got.getpalette())
        return None if same else f"{path}: image {got.mode} {got.size} differs from {expected.mode} {expected.size}"
    return None if expected == got else f"{path}: {got!r}, expected {expected!r}"


def assert_same(got: Any, want: Any, path: str = "payload") -> None:
    """Exact equality of type, dtype, shape and values, recursively (the difference in the message)."""
    found = mismatch(want, got, path)
    assert found is None, found
