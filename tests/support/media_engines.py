"""Skips a test module that runs the engines on media when what they need is not installed."""

from __future__ import annotations

import importlib.util

import pytest


def require_media_engines() -> None:
    """torch, transformers, PyAV (media decoding) and torchvision (the Qwen-Omni processors cannot be built
    without it), or the module is skipped."""
    for name in ("torch", "transformers", "av"):
        pytest.importorskip(name)
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (make test installs it)", allow_module_level=True)
