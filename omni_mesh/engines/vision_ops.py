"""torchvision that imports on a CPU torch.

transformers' Qwen-Omni processors cannot be built without torchvision (their video processor imports
it) and use only its pure-Python transforms. PyPI's torchvision wheels are CUDA builds: next to a CPU
torch their compiled ops (`torchvision._C`) fail to load, torchvision swallows that, and then its import
fails anyway registering a fake kernel for `torchvision::nms`, an op that was never declared. A CUDA
install loads `_C` and never needs this.

`install()` (called when `omni_mesh.engines` is imported) puts a finder in front of the import system:
on the first `import torchvision` it checks whether `_C` loads and, only when it does not, declares the
schemas of the two ops torchvision registers fakes for unconditionally. The ops have no kernel: calling
them fails as torchvision says when its ops are missing; nothing the processors use calls them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path
from typing import Any

#: torchvision's schemas of the ops its `_meta_registrations` registers fakes for whether `_C` loaded or not.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list[Any] = []  # a torch.library.Library un-declares its ops when collected: kept for the process


def compiled_ops_load(package_dir: Path) -> bool:
    """Whether torchvision's compiled ops (`_C`) load next to this torch."""
    import torch

    for path in sorted(package_dir.glob("_C*.so")) + sorted(package_dir.glob("_C*.pyd")):
        try:
            torch.ops.load_library(str(path))
            return True
        except (OSError, ImportError, RuntimeError):
            return False
    return False


def declare_missing_ops() -> None:
    """Declare `torchvision::nms` / `qnms` (no kernel) unless something declared them already."""
    import torch

    if hasattr(torch.ops.torchvision, "nms"):  # resolving an op that is not there raises AttributeError
        return
    library = torch.library.Library("torchvision", "DEF")  # noqa: TOR901 (schemas only, on purpose)
    for schema in _SCHEMAS:
        library.define(schema)
    _LIBRARIES.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Finds nothing itself: before the first import of torchvision it prepares torch, then steps aside."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname == "torchvision" and self in sys.meta_path:
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("torchvision")
            if spec is not None and spec.submodule_search_locations:
                package_dir = Path(next(iter(spec.submodule_search_locations)))
                if not compiled_ops_load(package_dir):
                    declare_missing_ops()
        return None


def install() -> None:
    """Idempotent; a no-op once torchvision is imported."""
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())
