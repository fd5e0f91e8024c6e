"""A payload as one self-contained frame (our codec: no pickle), and plain tensors for outputs:
the defaults of `OmniConnectorBase.serialize_obj`, `deserialize_obj` and `empty`."""

from __future__ import annotations

from typing import Any


def serialize_obj(obj: Any) -> bytes:
    from omni_mesh import codec  # not at import time: the registry and topology checks stay light

    return bytes(codec.encode(obj))


def deserialize_obj(data: Any) -> Any:
    """The object `serialize_obj` made; bytes from another process are untrusted (no class is imported)."""
    from omni_mesh import codec

    # A read-only buffer (bytes) is copied once and decoded as views; a writable one the caller may
    # reuse, so every leaf is copied out of it.
    return codec.decode(data, copy=not memoryview(data).readonly)


def plain_empty(shape: tuple[int, ...] | list[int], dtype: Any) -> Any:
    """An uninitialized CPU torch.Tensor (connectors without memory of their own hand these out)."""
    import torch  # not at import time: connector modules without tensors stay light

    return torch.empty(tuple(shape), dtype=dtype)
