"""torch where a tensor is, and nowhere else: importing it costs seconds of CPU, which the coordinator,
the launcher and stages whose handlers hold no tensor never need to pay.

A process that never imported torch cannot hold a tensor, so asking "is this a tensor?" imports
nothing: `tensor_class()` is `torch.Tensor` once torch is in `sys.modules`, else a class no value is an
instance of. Code that builds or reads a tensor (a frame whose header names one, a connector's
`empty()`) calls `import_torch()`, which imports torch the first time and is a global read after.
"""

from __future__ import annotations

import sys
from types import ModuleType


class NoTensor:
    """Stands for torch.Tensor in a process without torch: no value is an instance of it."""

    __slots__ = ()


_TENSOR: type | None = None  # torch.Tensor, once seen
_TORCH: ModuleType | None = None


def tensor_class() -> type:
    """torch.Tensor if torch is imported here, else NoTensor. Cheap (a global read, or a dict lookup
    while torch is not there): walkers call it once per payload, never per leaf."""
    global _TENSOR
    if _TENSOR is None:
        found = getattr(sys.modules.get("torch"), "Tensor", None)
        if found is None:
            return NoTensor
        _TENSOR = found
    return _TENSOR


def loaded_torch() -> ModuleType | None:
    """The torch module if it is imported here (its Tensor class defined), else None: never imports."""
    return _TORCH if _TORCH is not None or tensor_class() is NoTensor else import_torch()


def import_torch() -> ModuleType:
    """The torch module, imported on first use."""
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = torch
    return _TORCH
