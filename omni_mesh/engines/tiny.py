"""`omni-mesh models tiny ARCH DIR`: a tiny random checkpoint of a real architecture, to run the real
code path without weights (tests, demos, benchmarks of the mesh itself)."""

from __future__ import annotations

import importlib
from pathlib import Path

#: Architecture -> (module, builder).
BUILDERS = {
    "qwen2_5_omni": ("omni_mesh.engines.tiny_qwen2_5_omni", "build_tiny_qwen2_5_omni"),
    "qwen3_omni": ("omni_mesh.engines.tiny_qwen3_omni", "build_tiny_qwen3_omni"),
}


def build_tiny(arch: str, directory: Path, seed: int = 0) -> Path:
    if arch not in BUILDERS:
        raise ValueError(f"no tiny model for {arch!r}; choose one of: {', '.join(BUILDERS)}")
    module, name = BUILDERS[arch]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    getattr(importlib.import_module(module), name)(directory, seed)
    return directory
