"""A checkpoint directory opened for one stage: which architecture it holds, its tokenizer, and how
that architecture's parts are loaded and read (the stage handlers stay the same for every model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni_mesh.engines.checkpoint import CheckpointError, read_config
from omni_mesh.engines.settings import ARCHS, EngineSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelParts:
    """One checkpoint, one architecture: loads a part and reads what its parts return."""

    arch = ""

    def __init__(self, directory: Path, spec: EngineSpec, config: dict) -> None:
        self.directory = directory
        self.spec = spec
        self.config = config
        self._tokenizer: Any = None

    @property
    def dtype(self) -> torch.dtype:
        if self.spec.dtype != "auto":
            return _DTYPES[self.spec.dtype]
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "float32"
        return _DTYPES.get(str(name), torch.float32)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.directory))
        return self._tokenizer

    def load(self, part: str) -> Any:
        if part == "thinker":
            self.tokenizer  # noqa: B018 (loaded now, not by the first request)
        return self._load(part)

    def _load(self, part: str) -> Any:
        raise NotImplementedError

    @staticmethod
    def seed(seed: int | None) -> None:
        if seed is not None:
            torch.manual_seed(seed)

    def eos_token_ids(self, thinker: Any) -> list[int]:
        eos = thinker.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def reply_ids(self, output: Any) -> torch.Tensor:
        raise NotImplementedError

    def talker_payload(self, output: Any) -> dict:
        raise NotImplementedError

    def code_stop_ids(self, talker: Any) -> list[int]:
        return []

    @staticmethod
    def codes_tensor(codes: list[Any]) -> torch.Tensor:
        if codes and isinstance(codes[0], torch.Tensor):
            return torch.cat([c.reshape(-1) if c.dim() <= 1 else c for c in codes]).to(torch.int64)
        return torch.tensor(codes, dtype=torch.int64)

    @staticmethod
    def join_codes(chunks: list[torch.Tensor]) -> torch.Tensor:
        if not chunks:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.as_tensor(c) for c in chunks]).to(torch.int64)

    @staticmethod
    def code_frames(codes: Any) -> int:
        return int(torch.as_tensor(codes).shape[0])


class Qwen2_5Omni(ModelParts):
    arch = "qwen2_5_omni"

    def _load(self, part: str) -> Any:
        from omni_mesh.engines import qwen2_5_omni as model

        if part == "thinker":
            return model.Thinker.load(self.directory, self.dtype, self.spec.device)
        if part == "talker":
            return model.Talker.load(self.directory, self.dtype, self.spec.device)
        return model.Token2Wav.load(self.directory, self.dtype, self.spec.device, self.spec.num_steps)

    def reply_ids(self, output: Any) -> torch.Tensor:
        return output.reply_ids

    def talker_payload(self, output: Any) -> dict:
        return output.to_payload()

    def code_stop_ids(self, talker: Any) -> list[int]:
        return talker.stop_ids


#: Architectures by config.json model_type.
ARCHITECTURES: dict[str, type[ModelParts]] = {"qwen2_5_omni": Qwen2_5Omni}


def open_model(spec: EngineSpec) -> ModelParts:
    """The checkpoint a stage's engine names, with the parts class of its architecture."""
    if spec.threads is not None:  # process-wide: every part of this stage computes with this many
        torch.set_num_threads(spec.threads)
    directory = spec.model_dir()
    if not directory.is_dir():
        raise CheckpointError(f"engine.model {spec.model!r}: {directory} is not a directory")
    config = read_config(directory)
    arch = spec.arch or config.get("model_type")
    if arch not in ARCHITECTURES:
        known = ", ".join(ARCHS)
        raise CheckpointError(f"{directory}: model_type {arch!r} has no engine here; engines exist for: {known}")
    return ARCHITECTURES[arch](directory, spec, config)
