"""The running batch under a KV-cache budget (omni_mesh.engines.kv_budget), in one process, tiny random
checkpoints of both architectures: 8 greedy requests against a budget of twice the largest one's
reservation get the replies generate() gives each alone; the batch's KV cache, measured at every token,
never passes the budget yet holds several rows at once; its bytes are the model's KV bytes per token
(keys and values of every layer) times its tokens.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.batch_requests import PROMPTS, REPLY_TOKENS, alone_texts, chat  # noqa: E402

from omni_mesh.engines.batching import Batcher  # noqa: E402
from omni_mesh.engines.kv_budget import KvBudget, kv_bytes_per_token  # noqa: E402
from omni_mesh.engines.models import open_model  # noqa: E402
from omni_mesh.engines.settings import Sampling, parse_engine  # noqa: E402
from omni_mesh.engines.text import prompt_ids  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread, as the stages run (tests/conftest.py)."""


def params(n: int) -> dict:
    return {"temperature": 0, "max_tokens": n, "seed": 1}


@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni"])
def test_the_batch_stays_within_its_kv_budget_and_replies_as_alone(arch: str, tmp_path: Path) -> None:
    from omni_mesh.engines.tiny import build_tiny

    directory = build_tiny(arch, tmp_path / arch)
    texts = alone_texts(directory, [params(n) for n in REPLY_TOKENS])
    model = open_model(parse_engine({"part": "thinker", "model": str(directory)}, "test"))
    thinker = model.load("thinker")
    engine = model.batch_engine(thinker, "thinker")
    per_token = kv_bytes_per_token(thinker.model)
    ids = [prompt_ids(model.tokenizer, chat(prompt)) for prompt in PROMPTS]
    reserved = [int(i.shape[-1]) + n for i, n in zip(ids, REPLY_TOKENS, strict=True)]
    budget = KvBudget(2 * max(reserved), per_token)
    batcher = Batcher("thinker", engine, 8, budget)
    seen: list[tuple[int, int, int]] = []  # (rows, tokens, bytes) at every token made

    def push(token: int) -> None:  # in the model thread, between steps
        seen.append((len(batcher.rows), *engine.kv_usage(batcher.rows)))

    queued = threading.Event()
    futures = []
    for i, n in enumerate(REPLY_TOKENS):
        sampling = Sampling.of(model.spec, params(n))

        def begin(i: int = i, sampling: Sampling = sampling) -> Any:
            queued.wait(30)
            return model.think_begin(thinker, ids[i], sampling, None)

        futures.append(batcher.submit(begin, push, lambda: False, reserved[i]))
    queued.set()
    try:
        outputs = [future.result(120) for future in futures]
    finally:
        batcher.close()
        if batcher.thread is not None:
            batcher.thread.join(30)  # its last step measured
    replies = [model.tokenizer.decode(model.reply_ids(o).tolist(), skip_special_tokens=True) for o in outputs]
    assert replies == texts
    assert max(tokens for _, tokens, _ in seen) <= budget.tokens, (budget, seen)
    assert max(rows for rows, _, _ in seen) >= 2  # the budget still lets requests share a forward
    assert all(size == tokens * per_token for _, tokens, size in seen)
    assert batcher.kv_peak <= budget.tokens and batcher.counters()["kv_cache_used_tokens"] == 0
