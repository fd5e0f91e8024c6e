"""Loading one part of a whole-model Hugging Face checkpoint: only that part's tensors are read, and a
part whose weights are missing is an error naming them, never a silent random initialisation."""

from __future__ import annotations

import json
from pathlib import Path
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
    """The safetensors files holding tensors under `prefix` (a sharded checkpoint: only those shards)."""
    index = model_dir / _INDEX
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({name for key, name in weight_map.items() if key.startswith(prefix)})
        return [model_dir / name for name in files]
    single = model_dir / _SINGLE
    if single.exists():
        return [single]
    raise CheckpointError(f"{model_dir}: no {_SINGLE} or {_INDEX}: the checkpoint has no safetensors weights")


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
