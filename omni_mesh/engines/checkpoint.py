"""Loading one part of a whole-model Hugging Face checkpoint: only that part's tensors are read, and a
part whose weights are missing is an error naming them, never a silent random initialisation."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

#: Where a checkpoint's weights may live (save_pretrained writes one of them).
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint directory cannot give what a stage needs; the message says what and where."""


def read_config(model_dir: Path) -> dict:
    """The checkpoint's config.json as a dict."""
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{model_dir}: no config.json; point the stage's engine.model at a Hugging Face checkpoint "
            "directory (or make one: omni-mesh models tiny qwen2_5_omni DIR)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the config: {exc}") from None


def weight_files(model_dir: Path, prefix: str) -> list[Path]:
    """The safetensors files holding tensors under `prefix` (a sharded checkpoint: only those shards).
    Every one lies inside the checkpoint directory (`_inside`)."""
    index = model_dir / _INDEX
    if index.exists():
        weight_map = _weight_map(index)
        files = sorted({name for key, name in weight_map.items() if key.startswith(prefix)})
        return [_inside(model_dir, name, index) for name in files]
    single = model_dir / _SINGLE
    if single.exists():
        return [_inside(model_dir, _SINGLE, single)]
    raise CheckpointError(f"{model_dir}: no {_SINGLE} or {_INDEX}: the checkpoint has no safetensors weights")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor key -> shard file name), checked for its shape."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{index}: cannot read the index: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


def _inside(model_dir: Path, name: str, named_by: Path) -> Path:
    """`model_dir / name`, refused (naming the file that names it and the shard) unless it stays inside
    the checkpoint directory: a relative name without `..`, and no symlink leading out of it. A
    checkpoint is data from whoever published it; it must not make a stage read other files."""
    relative = PurePosixPath(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(
            f"{named_by}: shard {name!r} names a file outside the checkpoint directory {model_dir} (shard names "
            "are relative to it, without '..'); refusing to read it"
        )
    path = model_dir / relative
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in _roots(model_dir)):
        raise CheckpointError(
            f"{named_by}: shard {name!r} is a symlink to {resolved}, outside the checkpoint directory "
            f"{model_dir}; refusing to read it (copy the file into the directory)"
        )
    return path


def _roots(model_dir: Path) -> list[Path]:
    """Where a checkpoint's files may resolve to: its own directory, and for a Hugging Face cache
    snapshot (models--ORG--NAME/snapshots/REV, whose files are symlinks into the repository's blobs/)
    that blobs/ directory."""
    real = model_dir.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def read_part(model_dir: Path, prefix: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every tensor whose key starts with `prefix` (but not with `prefix` + one of `skip`), the prefix
    stripped; the rest is never read."""
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    for path in weight_files(model_dir, prefix):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.startswith(prefix) and not key[len(prefix) :].startswith(skip or ("\0",)):
                    tensors[key[len(prefix) :]] = handle.get_tensor(key)
    return tensors


def load_part(
    model_class: Any, config: Any, model_dir: Path, prefix: str, *, dtype: Any, device: str, skip: tuple[str, ...] = (),
) -> Any:
    """`model_class` built from `config` with the checkpoint's tensors under `prefix` (nothing else is
    read), on `device` in `dtype`, in eval mode. transformers renames the keys as it would for the whole
    model. CheckpointError naming the missing keys when the checkpoint lacks any of this part's weights.
    `skip`: sub-prefixes (`audio_tower.`) not read; their modules are left out of the model (None)."""
    from transformers.utils import logging as hf_logging

    tensors = read_part(model_dir, prefix, skip)
    if not tensors:
        raise CheckpointError(
            f"{model_dir}: the checkpoint has no weights under {prefix!r}: it does not hold this part "
            f"({model_class.__name__})"
        )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would print the missing keys as a table: we raise
    try:
        model, info = model_class.from_pretrained(
            None, config=config, state_dict=tensors, output_loading_info=True, dtype=dtype
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    skipped = {name.strip(".") for name in skip}
    missing = sorted(key for key in info.get("missing_keys") or [] if not skipped & set(key.split(".")))
    if missing:
        shown = ", ".join(missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{model_dir}: {len(missing)} weight(s) of {model_class.__name__} (checkpoint prefix {prefix!r}) "
            f"missing: {shown}{more}; refusing to run on random weights"
        )
    for name in [name for name, _ in model.named_modules()]:
        parent, _, leaf = name.rpartition(".")
        if leaf in skipped:  # random weights nothing may run: dropped
            setattr(model.get_submodule(parent), leaf, None)
    return model.to(device=device).eval()
