"""A replica's KV-cache budget: `engine.kv_cache_tokens` and/or vLLM's `kv_cache_memory_bytes` (the
smaller one counts, bytes turned into tokens from the model's layers, KV heads, head size and dtype).

Each request reserves the KV it may come to hold: its prompt plus its max tokens (a talker: its input
rows plus its max codes). The running batch takes a queued request only while the padded batch it would
make stays within the budget: (rows + 1) x the longest reservation among them, since the batch keeps
every row's cache left-padded to the longest (omni_mesh.engines.thinker_batch). Requests that do not
fit wait in the replica's queue, first come first served; that queue is bounded by the replica's
max_inflight (the coordinator sends no more), and beyond the stage's queue the coordinator answers 429.
A request that could not fit even alone is refused at once (a 4xx saying what to lower).

Torch-free: the topology reads `rows_within_budget` to derive max_inflight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omni_mesh.engines.settings import within_model_len
from omni_mesh.errors import InvalidInput

log = logging.getLogger("omni_mesh.engines")


@dataclass(frozen=True)
class KvBudget:
    tokens: int
    bytes_per_token: int

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token takes in `model`'s KV cache: keys and values of every layer, in its dtype."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def budget_of(spec: Any, bytes_per_token: int, who: str) -> KvBudget | None:
    """The stage's budget in tokens (the smaller of the two settings), None when it sets neither;
    ValueError when the bytes do not hold one token."""
    limits = []
    if spec.kv_cache_tokens is not None:
        limits.append(spec.kv_cache_tokens)
    if spec.kv_cache_memory_bytes is not None:
        tokens = spec.kv_cache_memory_bytes // bytes_per_token
        if tokens < 1:
            raise ValueError(
                f"{who}: engine.kv_cache_memory_bytes {spec.kv_cache_memory_bytes} holds no token of this model's "
                f"KV cache ({bytes_per_token} bytes per token)"
            )
        limits.append(tokens)
    return KvBudget(min(limits), bytes_per_token) if limits else None


def stage_budget(spec: Any, loaded: Any, stage: str) -> KvBudget | None:
    """A stage's budget once its part is loaded (`loaded`: the part, its `.model` the transformers one);
    a part without a KV cache (an encoder, code2wav) gets a warning that the settings have no effect."""
    if spec.kv_cache_tokens is None and spec.kv_cache_memory_bytes is None:
        return None
    model = getattr(loaded, "model", None)
    if spec.part not in ("thinker", "talker") or not hasattr(model, "config"):
        log.warning("stage %s: engine.kv_cache_tokens / kv_cache_memory_bytes have no effect on a %s", stage, spec.part)
        return None
    budget = budget_of(spec, kv_bytes_per_token(model), f"stage {stage!r}")
    assert budget is not None
    log.info("stage %s: KV cache budget %d tokens (%d bytes)", stage, budget.tokens, budget.bytes)
    return budget


def checked_sampling(spec: Any, budget: KvBudget | None, sampling: Any, prompt_tokens: int) -> Any:
    """A thinker request's `sampling` within engine.max_model_len; InvalidInput (a 4xx, before any
    generation) when the request could never fit the KV budget."""
    sampling = within_model_len(spec, sampling, prompt_tokens)
    check_request(budget, prompt_tokens + sampling.max_tokens,
                  f"a prompt of {prompt_tokens} tokens and max_tokens {sampling.max_tokens}", "max_tokens")
    return sampling


def check_request(budget: KvBudget | None, tokens: int, what: str, limit: str) -> None:
    """InvalidInput (4xx, the runtime names the stage) when a request alone needs more KV than the
    budget: it could never run. `limit`: the param that would make it fit."""
    if budget is not None and tokens > budget.tokens:
        raise InvalidInput(
            f"the request needs {tokens} tokens of KV cache ({what}), more than this stage's budget of "
            f"{budget.tokens} (engine.kv_cache_tokens / kv_cache_memory_bytes): lower {limit} or shorten the prompt"
        )


def talker_kv_tokens(payload: Any, max_codes: int) -> int:
    """A talker request's reservation: the thinker's prompt and reply rows, the few it adds, its codes
    (an upper bound for both models' layouts)."""
    rows = sum(
        len(payload[key])
        for key in ("prompt_ids", "reply_ids")
        if isinstance(payload, dict) and key in payload
    )
    return rows + 3 + max_codes


def fits(reserved: list[int], tokens: int, budget: int) -> bool:
    """Whether a request reserving `tokens` may join rows reserving `reserved` within `budget`: the
    padded batch they would make, (rows + 1) x the longest, stays within it. An empty batch takes any
    request (check_request refused those larger than the budget)."""
    if not reserved:
        return True
    return (len(reserved) + 1) * max(*reserved, tokens) <= budget


def rows_within_budget(engine: dict) -> int:
    """Rows a stage's budget in tokens holds at the engine's default reply length (prompts make them
    fewer), at most max_batch: what a replica's max_inflight follows from. A budget in bytes only is
    known in tokens once the model loads: max_batch then."""
    rows = engine["max_batch"]
    budget = engine.get("kv_cache_tokens")
    if budget is None:
        return rows
    if engine["part"] == "talker":
        reply = engine["max_audio_tokens"]
    else:
        reply = engine.get("max_model_len") or engine["max_tokens"]
    return max(1, min(rows, budget // reply))
