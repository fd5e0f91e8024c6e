"""A stage's `engine:` mapping and a request's sampling params, read and checked without torch
(`omni-mesh validate` reads them too)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from omni_mesh.errors import InvalidInput
from omni_mesh.model_source import resolve

#: The parts a model is split into; vllm-omni's `model_stage` names (token2wav: Qwen2.5-Omni's name).
PARTS = ("encoder", "thinker", "talker", "code2wav")
PART_ALIASES = {"token2wav": "code2wav"}
#: Architectures by the checkpoint's config.json `model_type`.
ARCHS = ("qwen2_5_omni", "qwen3_omni_moe")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class EngineSpec:
    """What a stage's `engine:` says (docs/engines.md)."""

    part: str
    model: str  # a checkpoint directory or a hub id; `$VAR`/`${VAR}` expanded when the stage loads it
    arch: str | None = None  # None: the checkpoint's config.json says
    dtype: str = "auto"  # auto: the checkpoint's (token2wav/code2wav always run in float32)
    device: str = "cpu"
    threads: int | None = None  # torch's intra-op threads in this stage; None: torch's default
    max_tokens: int = 256  # thinker: reply tokens
    max_audio_tokens: int = 2048  # talker: codec codes
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    # thinker sampling as vLLM has it (docs/engines.md); None: the checkpoint's generation_config decides
    top_k: int | None = None  # -1 or 0: every token
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()  # strings that end the reply (left out of its text)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the reply besides the model's eos
    seed: int | None = None
    speaker: str | None = None  # None: the model's default voice
    chunk_codes: int = 25  # talker -> code2wav: codes per streamed chunk
    first_chunk_codes: int = 10  # the first chunk is shorter: the first audio comes sooner
    context_codes: int = 25  # code2wav streaming: codes of left context decoded again with each chunk
    num_steps: int = 10  # Qwen2.5-Omni token2wav: ODE steps of its DiT
    encoder_cache: int = 256  # encoder (or a thinker that encodes): media items whose embeddings are kept
    max_model_len: int | None = None  # thinker: prompt + reply tokens (vLLM's); None: no limit but max_tokens
    max_prompt_tokens: int | None = None  # thinker: prompt tokens, talker: input rows; None: the model's context
    prefill_tokens: int = 512  # a prompt goes through in pieces this long: a cancel stops within one piece
    max_batch: int = 1  # requests decoded together in one forward per step (vLLM's max_num_seqs); 1: one at a time
    # thinker, to a streaming client: tokens per streamed text chunk (vLLM's); the first token and the reply's
    # end go at once. More than 1: fewer chunks through the stage and the coordinator per token.
    stream_interval: int = 1
    # The KV cache a replica's requests may hold at once (omni_mesh.engines.kv_budget); None: no limit but
    # max_batch. A request reserves its prompt plus its max tokens; one that does not fit waits in the queue.
    kv_cache_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None  # vLLM's name; turned into tokens from the model's shape
    # A thinker with max_batch > 1 runs its model and running batch in a process of its own, its engine core
    # (omni_mesh.engines.core, as vLLM's), so that the stage's per-token work and the forward passes do not
    # take turns on one GIL; false: both in the replica's process.
    core_process: bool = True

    def model_dir(self) -> Path:
        """The checkpoint directory: a directory, or a hub id resolved through huggingface_hub's cache
        (omni_mesh.model_source), variables expanded; ModelNotFound (a ValueError) saying why not."""
        return resolve(self.model)


def parse_engine(raw: Any, who: str) -> EngineSpec:
    """An `engine:` mapping -> EngineSpec; ValueError naming the stage and the key."""
    if not isinstance(raw, dict):
        raise ValueError(f"{who}: engine must be a mapping such as {{part: thinker, model: ${{OMNI_MESH_MODEL}}}}")
    values = dict(raw)
    if "model_stage" in values and "part" not in values:  # vllm-omni's name for it
        values["part"] = values.pop("model_stage")
    known = {f.name for f in fields(EngineSpec)}
    for key in values:
        if key not in known:
            from difflib import get_close_matches

            close = get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise ValueError(f"{who}: unknown engine key {key!r}{hint}")
    part = PART_ALIASES.get(values.get("part"), values.get("part"))
    if part not in PARTS:
        raise ValueError(f"{who}: engine.part must be one of {', '.join(PARTS)} (or token2wav), got {values.get('part')!r}")
    values["part"] = part
    if not isinstance(values.get("model"), str) or not values["model"]:
        raise ValueError(f"{who}: engine.model must be a checkpoint directory or a hub id (or ${{OMNI_MESH_MODEL}}), got {values.get('model')!r}")
    _check(values, "arch", lambda v: v is None or v in ARCHS, f"one of {', '.join(ARCHS)}", who)
    _check(values, "dtype", lambda v: v in DTYPES, f"one of {', '.join(DTYPES)}", who)
    _check(values, "device", lambda v: isinstance(v, str) and bool(_DEVICE.match(v)), "cpu or cuda:N", who)
    for name in ("max_tokens", "max_audio_tokens", "chunk_codes", "first_chunk_codes", "num_steps", "prefill_tokens",
                 "max_batch", "stream_interval"):
        _check(values, name, _positive_int, "an integer >= 1", who)
    for name in ("max_model_len", "kv_cache_tokens", "kv_cache_memory_bytes"):
        _check(values, name, lambda v: v is None or _positive_int(v), "an integer >= 1", who)
    for name in ("context_codes", "encoder_cache"):
        _check(values, name, lambda v: _int(v) and v >= 0, "an integer >= 0", who)
    _check(values, "core_process", lambda v: isinstance(v, bool), "true or false", who)
    _check(values, "threads", lambda v: v is None or _positive_int(v), "an integer >= 1", who)
    _check(values, "max_prompt_tokens", lambda v: v is None or _positive_int(v), "an integer >= 1", who)
    _check(values, "speaker", lambda v: v is None or isinstance(v, str), "a speaker name", who)
    defaults = {f.name: f.default for f in fields(EngineSpec)}
    for name in SAMPLING_CHECKS.keys() & known - {"max_tokens", "max_audio_tokens", "speaker"}:
        if name in values and not (values[name] is None and defaults[name] is None):
            ok, what = SAMPLING_CHECKS[name]
            _check(values, name, ok, what, who)
            values[name] = _normal(name, values[name])
    return EngineSpec(**values)


@dataclass(frozen=True)
class Sampling:
    """One request's generation settings: the stage's `engine:` defaults, overridden by its params."""

    max_tokens: int
    max_audio_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    speaker: str | None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, added to its logit)

    @classmethod
    def of(cls, spec: EngineSpec, params: dict | None) -> Sampling:
        params = params or {}
        defaults = {f.name: getattr(spec, f.name) for f in fields(cls) if hasattr(spec, f.name)}
        sampling = cls(**defaults)
        changes: dict[str, Any] = {}
        for name, (ok, what) in SAMPLING_CHECKS.items():
            if params.get(name) is not None:
                if not ok(params[name]):
                    raise InvalidInput(f"param {name!r} must be {what}, got {params[name]!r}")
                changes[name] = _normal(name, params[name])
        if "speaker" not in changes and isinstance(params.get("voice"), str):  # OpenAI's audio.voice
            changes["speaker"] = params["voice"]
        return replace(sampling, **changes)


def within_model_len(spec: EngineSpec, sampling: Sampling, prompt_tokens: int) -> Sampling:
    """`sampling` with max_tokens cut to what engine.max_model_len leaves after the prompt (as vLLM
    does); InvalidInput (4xx) when the prompt alone fills it."""
    if spec.max_model_len is None or prompt_tokens + sampling.max_tokens <= spec.max_model_len:
        return sampling
    if prompt_tokens >= spec.max_model_len:
        raise InvalidInput(
            f"the prompt is {prompt_tokens} tokens, and this model's max_model_len is {spec.max_model_len}: "
            "shorten the messages"
        )
    return replace(sampling, max_tokens=spec.max_model_len - prompt_tokens)


def _strings(value: Any) -> bool:
    items = [value] if isinstance(value, str) else value
    return isinstance(items, (list, tuple)) and all(isinstance(s, str) and s for s in items)


def _token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(_int(t) and t >= 0 for t in value)


def _bias(value: Any) -> bool:
    return isinstance(value, dict) and all(
        str(k).isdigit() and _number(v) and -100 <= v <= 100 for k, v in value.items()
    )


def _normal(name: str, value: Any) -> Any:
    """A checked setting as Sampling keeps it: stop always a tuple, ids a tuple, logit_bias pairs."""
    if name == "stop":
        return (value,) if isinstance(value, str) else tuple(value)
    if name == "stop_token_ids":
        return tuple(value)
    if name == "logit_bias":
        return tuple((int(k), float(v)) for k, v in value.items())
    return value


def _check(values: dict, key: str, ok: Any, what: str, who: str) -> None:
    if key in values and not ok(values[key]):
        raise ValueError(f"{who}: engine.{key} must be {what}, got {values[key]!r}")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: Sampling settings an engine takes as defaults and a request as params: vLLM's names and ranges.
SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_positive_int, "an integer >= 1"),
    "max_audio_tokens": (_positive_int, "an integer >= 1"),
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0 (0: greedy)"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _int(v) and v >= -1, "an integer >= 1 (-1 or 0: every token)"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number > 0 (1: none)"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "stop": (_strings, "a non-empty string or a list of them"),
    "stop_token_ids": (_token_ids, "a list of token ids (integers >= 0)"),
    "logit_bias": (_bias, 'a mapping of token id to a number in [-100, 100], such as {"42": -100}'),
    "seed": (lambda v: _int(v) and 0 <= v < 2**63, "an integer >= 0"),
    "speaker": (lambda v: isinstance(v, str) and v != "", "a speaker name"),
}
