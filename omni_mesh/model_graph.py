"""A model's stage graph as a topology (what `omni-mesh serve MODEL` runs and `--print-topology` writes).

The checkpoint's config.json `model_type` picks the graph: each architecture's PARTS, in pipeline order,
become a chain of `engine:` stages (stage i reads stage i-1), the last one final, with the OpenAI API
named after the model. The encoder stage (the processor and the audio and vision towers) comes first, so
the thinker loads no tower weights and media encoding scales on its own (`--replicas encoder=N`).
A checkpoint whose config turns its audio output off (`enable_audio_output: false`) serves the thinker
alone, text only. Torch-free: the topology is built before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_mesh.model_source import ModelNotFound

#: config.json model_type -> the parts of the model, in pipeline order.
PARTS: dict[str, tuple[str, ...]] = {
    "qwen2_5_omni": ("encoder", "thinker", "talker", "code2wav"),
    "qwen3_omni_moe": ("encoder", "thinker", "talker", "code2wav"),
}
#: What a final code2wav stage answers (omni_mesh.engines.stages), as the openai: section reads it.
AUDIO_OUTPUT = {"field": "audio_pcm16", "encoding": "pcm16", "sample_rate_field": "sample_rate"}


@dataclass(frozen=True)
class ServeOptions:
    """vLLM's flags where they mean the same here, and the replicas of each stage."""

    served_model_name: str | None = None  # default: MODEL as given
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # prompt + reply tokens of one request (the thinker's)
    max_audio_tokens: int | None = None  # the talker's codes per reply when a request sets none
    replicas: dict[str, int] = field(default_factory=dict)  # stage name -> replicas (default 1)
    threads: int | None = None  # torch threads per stage (CPU)


def model_parts(directory: Path, model: str) -> tuple[str, tuple[str, ...]]:
    """(model_type, the parts serve runs) of the checkpoint in `directory`; ModelNotFound for one it cannot."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelNotFound(f"model {model!r}: {directory} has no config.json: not a Hugging Face checkpoint") from None
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"model {model!r}: cannot read {path}: {exc}") from None
    arch = config.get("model_type") if isinstance(config, dict) else None
    if arch not in PARTS:
        raise ModelNotFound(
            f"model {model!r}: model_type {arch!r} has no stage graph here; omni-mesh serves {', '.join(PARTS)}"
        )
    parts = PARTS[arch]
    if config.get("enable_audio_output") is False:
        parts = parts[: parts.index("thinker") + 1]
    return arch, parts


def model_topology(model: str, directory: Path, options: ServeOptions) -> dict[str, Any]:
    """The topology (a YAML-ready mapping) that serves `model`, whose checkpoint is in `directory`."""
    arch, parts = model_parts(directory, model)
    unknown = sorted(set(options.replicas) - set(parts))
    if unknown:
        raise ModelNotFound(f"--replicas names stage(s) {', '.join(unknown)}; this model's stages: {', '.join(parts)}")
    stages = []
    for index, part in enumerate(parts):
        engine: dict[str, Any] = {"part": part, "model": model, "device": options.device}
        if options.dtype != "auto":
            engine["dtype"] = options.dtype
        if options.threads is not None:
            engine["threads"] = options.threads
        if part == "thinker" and options.max_model_len is not None:
            engine["max_model_len"] = options.max_model_len
        if part == "talker" and options.max_audio_tokens is not None:
            engine["max_audio_tokens"] = options.max_audio_tokens
        stage: dict[str, Any] = {"stage_id": index, "name": part, "engine": engine, "replicas": options.replicas.get(part, 1)}
        if index:
            stage["engine_input_source"] = [index - 1]
        stages.append(stage)
    stages[-1]["final_output"] = True
    final = parts[-1]
    openai: dict[str, Any] = {
        "model": options.served_model_name or model,
        "inputs": {"messages": "messages"},
        "text_output": {"stage": final, "field": "text"},
        "usage_output": {"stage": final, "field": "usage"},
    }
    if final == "code2wav":
        openai["audio_output"] = {"stage": final, **AUDIO_OUTPUT}
    return {"name": _topology_name(arch), "stages": stages, "openai": openai}


def _topology_name(arch: str) -> str:
    return arch.replace("_moe", "")
