"""Where a model's checkpoint is: `engine.model` and `omni-mesh serve MODEL` take a directory or a
Hugging Face hub id (`Qwen/Qwen2.5-Omni-3B`), `$VAR`/`${VAR}` expanded.

A hub id is resolved through huggingface_hub's cache ($HF_HUB_CACHE, $HF_HOME): a cached snapshot
is used as it is; online, what is missing is downloaded (only what a stage reads: configs, tokenizer
files, safetensors); with HF_HUB_OFFLINE=1 an id that is not cached is an error saying so. Torch-free:
`validate` and `serve` resolve models before any stage starts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: What the engines read of a checkpoint (no PyTorch .bin, no ONNX, no GGUF: a download gets none of them).
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")
#: A hub id: a repository name, or owner/name (the hub's own characters).
_HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


class ModelNotFound(ValueError):
    """The model is neither a directory nor a resolvable hub id; the message says which and why."""


def expand(model: str) -> str:
    """`model` with `$VAR`/`${VAR}` from the environment; ModelNotFound naming a variable that is unset."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise ModelNotFound(f"model {model!r}: environment variable {name} is not set")
        return os.environ[name]

    return _VAR.sub(value, model)


def is_hub_id(model: str) -> bool:
    """Whether `model` (expanded) reads as a hub id and not a path (no ./, no leading /, one slash at most)."""
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "~")) and ".." not in model


def resolve(model: str) -> Path:
    """The checkpoint directory of `model` (a directory, or a hub id from the cache or downloaded)."""
    expanded = expand(model)
    path = Path(expanded).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(expanded):
        raise ModelNotFound(f"model {model!r}: {path} is not a directory")
    return _from_hub(expanded, model)


def _from_hub(repo_id: str, given: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise ModelNotFound(
            f"model {given!r} is not a directory, and a hub id needs huggingface_hub: pip install 'omni-mesh[engines]'"
        ) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=PATTERNS))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise ModelNotFound(
            f"model {given!r}: not a directory, and the hub id is not in the cache ({_cache()}) and {why}; "
            "download it once online, or point at a checkpoint directory"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFound(
            f"model {given!r}: no such directory, and the hub has no such repository (or it is gated: "
            "`hf auth login`)"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFound(f"model {given!r}: could not download it from the hub: {exc}") from None


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
