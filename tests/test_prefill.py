"""Chunked prefill (omni_mesh/engines/prefill.py) gives the one-call path's results: for both models'
thinker and talker on tiny random checkpoints, the logits of every generated step agree within float
noise, the greedy tokens (codes) are equal, and what the thinker hands the talker (its prompt's hidden
states, 3-D rope positions included) agrees. A stop flag set during the prefill ends it before the next
piece; a prompt too long for the context is refused before any compute, naming the limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoTokenizer  # noqa: E402

from omni_mesh.engines import qwen2_5_omni, qwen3_omni, qwen3_omni_thinker  # noqa: E402
from omni_mesh.engines.prefill import PrefillStopped, prefill  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402
from omni_mesh.errors import InvalidInput  # noqa: E402

F32 = torch.float32
#: float32 noise of attention summed in another order (measured: up to ~5e-7 on these checkpoints)
LOGITS_ATOL = 1e-4
PROMPT = "Hello there, how are you? Tell me about the weather today, and tomorrow. " * 4
CHUNKS = (1, 7, 64)  # one token at a time, pieces that split the chat template anywhere, few pieces


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test of the module with torch on one thread (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def q25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("q25"))


@pytest.fixture(scope="module")
def q3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen3_omni", tmp_path_factory.mktemp("q3"))


def ids_of(checkpoint: Path, content: str) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]


def with_logits(model: Any, call: Any) -> tuple[Any, list[torch.Tensor]]:
    """`call()`'s result and the last-row logits of each forward of `model` itself during it."""
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(
        lambda module, args, out: logits.append(out.logits[0, -1].float().clone())
    )
    try:
        return call(), logits
    finally:
        hook.remove()


def assert_same_steps(one: list[torch.Tensor], chunked: list[torch.Tensor]) -> None:
    """Every generation step's logits agree; the chunked path's prefill pieces (for a talker, forwards of
    the model itself) come before its steps."""
    steps = chunked[len(chunked) - len(one) :]
    assert len(one) > 1 and len(steps) == len(one)
    worst = max(float((a - b).abs().max()) for a, b in zip(one, steps, strict=True))
    assert worst < LOGITS_ATOL, f"logits differ by {worst}"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_qwen2_5_thinker_and_talker_chunked_equal_one_call(q25: Path, chunk: int) -> None:
    thinker = qwen2_5_omni.Thinker.load(q25, F32, "cpu")
    talker = qwen2_5_omni.Talker.load(q25, F32, "cpu")
    ids = ids_of(q25, PROMPT)
    assert ids.shape[1] > 3 * chunk or chunk == 64

    def think(prefill_chunk: int | None) -> Any:
        return with_logits(
            thinker.model, lambda: thinker.generate(ids, max_tokens=12, prefill_chunk=prefill_chunk)
        )

    (one, one_logits), (out, out_logits) = think(None), think(chunk)
    assert_same_steps(one_logits, out_logits)
    assert out.reply_ids.tolist() == one.reply_ids.tolist()
    for name in ("prompt_rows", "reply_rows", "text_embeds"):  # what the talker reads
        a, b = getattr(one, name), getattr(out, name)
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), name

    def talk(prefill_chunk: int | None) -> Any:
        return with_logits(
            talker.model,
            lambda: talker.generate(one, max_codes=16, temperature=0, prefill_chunk=prefill_chunk),
        )

    (codes_one, talk_one), (codes, talk_chunked) = talk(None), talk(chunk)
    assert_same_steps(talk_one, talk_chunked)
    assert codes.tolist() == codes_one.tolist() and len(codes) > 0


@pytest.mark.parametrize("chunk", CHUNKS)
def test_qwen3_thinker_and_talker_chunked_equal_one_call(q3: Path, chunk: int) -> None:
    thinker = qwen3_omni_thinker.Qwen3OmniThinker.load(q3, F32, "cpu")
    talker = qwen3_omni.Qwen3OmniTalker.load(q3, F32, "cpu")
    # an audio placeholder: the talker reads the thinker's hidden state of layer accept_hidden_layer for it
    ids = ids_of(q3, PROMPT + "<|audio_start|><|audio_pad|><|audio_end|>")

    def think(prefill_chunk: int | None) -> Any:
        return with_logits(
            thinker.model, lambda: thinker.generate(ids, max_tokens=12, prefill_chunk=prefill_chunk)
        )

    (one, one_logits), (out, out_logits) = think(None), think(chunk)
    assert_same_steps(one_logits, out_logits)
    assert out["reply_ids"].tolist() == one["reply_ids"].tolist()
    assert bool(one["user_multimodal"].any())
    for key in ("user_rows", "assistant_rows", "tts_rows"):
        assert torch.allclose(one[key], out[key], atol=1e-5), key

    def talk(prefill_chunk: int | None) -> Any:
        return with_logits(
            talker.model,
            lambda: talker.generate(one, max_codes=10, temperature=0, prefill_chunk=prefill_chunk),
        )

    (codes_one, talk_one), (codes, talk_chunked) = talk(None), talk(chunk)
    assert_same_steps(talk_one, talk_chunked)
    assert codes.tolist() == codes_one.tolist() and len(codes) > 0


def test_a_stop_during_the_prefill_ends_it_before_the_next_piece(q25: Path) -> None:
    thinker = qwen2_5_omni.Thinker.load(q25, F32, "cpu")
    ids = ids_of(q25, PROMPT)
    pieces = []
    hook = thinker.model.model.register_forward_hook(lambda *_: pieces.append(1))
    try:
        with pytest.raises(PrefillStopped):
            thinker.generate(ids, max_tokens=4, prefill_chunk=8, should_stop=lambda: len(pieces) >= 3)
    finally:
        hook.remove()
    assert len(pieces) == 3  # and never the whole prompt: generate() was not reached
    assert ids.shape[1] > 8 * 4

    with pytest.raises(ValueError, match="chunk must be >= 1"):
        prefill(10, chunk=0, should_stop=None, step=lambda start, end: None)


def test_a_prompt_past_the_context_is_refused_before_any_compute(q25: Path, q3: Path) -> None:
    thinker = qwen2_5_omni.Thinker.load(q25, F32, "cpu")
    ids = torch.ones(1, thinker.context, dtype=torch.long)
    calls = []
    hook = thinker.model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(
            InvalidInput,
            match=f"{thinker.context} tokens and does not fit the model's context of {thinker.context}",
        ):
            thinker.generate(ids, max_tokens=4)
    finally:
        hook.remove()
    assert calls == []
    q3_thinker = qwen3_omni_thinker.Qwen3OmniThinker.load(q3, F32, "cpu")
    with pytest.raises(InvalidInput, match="max_position_embeddings"):
        q3_thinker.generate(
            torch.ones(1, q3_thinker.context + 5, dtype=torch.long), max_tokens=4, for_talker=False
        )


def test_max_prompt_tokens_is_checked_and_refuses_longer_prompts(q25: Path) -> None:
    from omni_mesh.engines.models import open_model
    from omni_mesh.engines.settings import parse_engine

    with pytest.raises(
        ValueError, match="stage 0 'thinker': engine.max_prompt_tokens must be an integer >= 1"
    ):
        parse_engine({"part": "thinker", "model": str(q25), "max_prompt_tokens": 0}, "stage 0 'thinker'")
    with pytest.raises(ValueError, match="engine.prefill_tokens must be an integer >= 1"):
        parse_engine({"part": "thinker", "model": str(q25), "prefill_tokens": 0}, "stage 0 'thinker'")
    parts = open_model(
        parse_engine({"part": "thinker", "model": str(q25), "max_prompt_tokens": 10}, "stage 0")
    )
    thinker = parts.load("thinker")
    parts.check_prompt(thinker, 10)
    with pytest.raises(
        InvalidInput, match="the prompt is 11 tokens, more than this stage's engine.max_prompt_tokens of 10"
    ):
        parts.check_prompt(thinker, 11)
    talker = qwen2_5_omni.Talker.load(q25, F32, "cpu")
    out = thinker.generate(ids_of(q25, "Hi"), max_tokens=3)
    with pytest.raises(
        InvalidInput,
        match=r"talker: the prompt is \d+ tokens, more than this stage.s engine.max_prompt_tokens of 4",
    ):
        talker.generate(out, max_codes=4, max_input_tokens=4)
