"""A batched step that prefills the prompts joining the batch and decodes the running rows in one forward
(omni_mesh.engines.mixed_step, thinker_batch) on tiny random checkpoints of both thinkers:

- requests that join a running batch mid-way get the replies they get alone, as do the rows already
  running, with their prompts prefilled in the decode step's forward (no forward of their own), greedy
  and sampled with a seed and penalties; and the same where the step is too large to mix (the prompts
  prefilled in a forward of their own first);
- the layout: where each new token goes, what it attends to, and the cache a decode step continues from.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.batch_requests import PROMPTS, REPLY_TOKENS  # noqa: E402
from support.thinker_parts import ARCHS, alone, assert_same, ids_of, load  # noqa: E402

from omni_mesh.engines import mixed_step  # noqa: E402
from omni_mesh.engines.batching import Batcher  # noqa: E402
from omni_mesh.engines.settings import Sampling  # noqa: E402
from omni_mesh.engines.thinker_batch import ThinkerBatch  # noqa: E402


@pytest.fixture(scope="module", params=ARCHS)
def parts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(the model, its loaded thinker), per thinker."""
    return load(request.param, tmp_path_factory)


@pytest.fixture(autouse=True)
def _torch_threads(one_torch_thread: None) -> None:
    """As the stages run torch: on one thread (tests/conftest.py)."""


class Counted(ThinkerBatch):
    """A ThinkerBatch that counts its mixed steps and its prefill forwards."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.mixed_steps = 0
        self.prefills = 0

    def _mixed(self, *args: Any) -> Any:
        self.mixed_steps += 1
        return super()._mixed(*args)

    def _prefill(self, *args: Any) -> Any:
        self.prefills += 1
        return super()._prefill(*args)


def joining_late(
    model: Any, thinker: Any, requests: list[tuple[str, Sampling]], engine: ThinkerBatch
) -> list[Any]:
    """The first half of `requests` submitted together; the second half submitted from the batch thread
    when the first request gets its 3rd token, so they join a running batch at its 4th step."""
    half = len(requests) // 2
    batcher = Batcher("thinker", engine, len(requests))
    futures: list[Any] = []
    queued = threading.Event()

    def submit(prompt: str, sampling: Sampling, push: Any = None) -> None:
        ids = ids_of(model, prompt)

        def begin() -> Any:
            queued.wait(30)
            return model.think_begin(thinker, ids, sampling, None)

        futures.append(batcher.submit(begin, push or (lambda token: None), lambda: False))

    seen: list[int] = []

    def first_push(token: int) -> None:
        seen.append(token)
        if len(seen) == 3:
            for prompt, sampling in requests[half:]:
                submit(prompt, sampling)

    for i, (prompt, sampling) in enumerate(requests[:half]):
        submit(prompt, sampling, first_push if i == 0 else None)
    queued.set()
    try:
        for _ in range(600):  # the late ones are submitted from the batch thread
            if len(futures) == len(requests):
                break
            threading.Event().wait(0.05)
        return [future.result(120) for future in list(futures)]
    finally:
        batcher.close()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 7, "top_k": 20, "presence_penalty": 0.5, "repetition_penalty": 1.2},
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("mix", [True, False], ids=["mixed", "prefilled apart"])
def test_requests_joining_a_running_batch_get_the_replies_they_get_alone(
    parts: Any, params: dict, mix: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, thinker = parts
    if not mix:
        monkeypatch.setattr(mixed_step, "fits", lambda layout, config: False)
    samplings = [Sampling.of(model.spec, {**params, "max_tokens": max(n, 6)}) for n in REPLY_TOKENS]
    requests = list(zip(PROMPTS, samplings, strict=True))
    references = [alone(model, thinker, p, s) for p, s in requests]
    engine = Counted(thinker.model, model.thinker_step_layers)
    outputs = joining_late(model, thinker, requests, engine)
    for reference, output in zip(references, outputs, strict=True):
        assert_same(model, reference, output)
    if mix:  # the first step (4 prompts) and the 4th (4 prompts beside 4 running rows): no prefill forward
        assert engine.mixed_steps == 2 and engine.prefills == 0
    else:
        assert engine.mixed_steps == 0 and engine.prefills == 2


def test_the_layout_puts_each_row_after_its_cache() -> None:
    # rows: a running one (3 cached, 1 new), a joining prompt of 4, a running one (1 cached), a prompt of 2
    layout = mixed_step.Layout(cached=[3, 0, 1, 0], new=[1, 4, 1, 2])
    assert layout.lengths == [4, 4, 2, 2] and layout.width == 4 and layout.last == [0, 4, 5, 7]
    config = SimpleNamespace(_attn_implementation="sdpa", layer_types=["full_attention"])
    config.get_text_config = lambda: config
    assert mixed_step.fits(layout, config)
    assert not mixed_step.fits(
        mixed_step.Layout(cached=[3, 2], new=[1, 2]), config
    )  # a cached row gets one token
    cache = mixed_step.DynamicCache()
    old = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 1, 3, 1) + 100  # width 3 before
    cache.update(old, -old, 0)
    flat = mixed_step.FlatCache(cache, layout, "cpu")
    new = torch.arange(8, dtype=torch.float32).reshape(1, 1, 8, 1)
    k, v = flat.update(new, -new, 0)
    assert torch.equal(v, -k)
    assert k[:, 0, :, 0].tolist() == [
        [100, 101, 102, 0],  # its 3 cached, then its new token
        [1, 2, 3, 4],  # the prompt's 4 tokens
        [106, 107, 108, 5],  # its cached one, then its new token (before them: padding)
        [109, 110, 6, 7],  # the prompt's 2 tokens (before them: padding)
    ]
    stacked, padding = flat.stacked()
    assert stacked is cache and torch.equal(stacked.layers[0].keys, k)
    assert padding.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]


@pytest.mark.parametrize(
    "cached,new",
    [
        ([3, 0, 1, 0], [1, 4, 1, 2]),  # rows in any order
        ([3, 1, 0, 0], [1, 1, 4, 2]),  # the running rows first (views, not copies), prompts of two lengths
        ([2, 1, 0, 0], [1, 1, 3, 3]),  # ... prompts of one length (none padded)
        ([0, 0], [3, 1]),  # prompts only (a batch's first step)
        ([2, 4], [1, 1]),  # running rows only
    ],
)
def test_a_mixed_step_attends_each_token_to_its_own_row_up_to_itself(
    cached: list[int], new: list[int]
) -> None:
    layout = mixed_step.Layout(cached=cached, new=new)
    generator = torch.Generator().manual_seed(0)
    heads, d, rows, tokens, before = 2, 8, len(cached), sum(new), max(cached)
    cache = mixed_step.DynamicCache()
    cache.update(
        torch.randn(rows, 1, before, d, generator=generator),
        torch.randn(rows, 1, before, d, generator=generator),
        0,
    )
    flat = mixed_step.FlatCache(cache, layout, "cpu")
    flat_keys = torch.randn(1, 1, tokens, d, generator=generator)
    old_keys = cache.layers[0].keys
    keys, values = flat.update(flat_keys, torch.randn(1, 1, tokens, d, generator=generator), 0)
    for row, (c, n) in enumerate(
        zip(cached, new, strict=True)
    ):  # each row: its cached tokens, then its new ones
        first, width = sum(new[:row]), layout.width
        assert torch.equal(keys[row, 0, width - n :], flat_keys[0, 0, first : first + n])
        assert torch.equal(keys[row, 0, width - n - c : width - n], old_keys[row, 0, before - c :])
    query = torch.randn(1, heads, tokens, d, generator=generator)
    out = flat.attend(
        SimpleNamespace(num_key_value_groups=heads, is_causal=True), query, keys, values, scaling=d**-0.5
    )
    assert out.shape == (1, tokens, heads, d)
    token = 0
    for row, (c, n) in enumerate(zip(cached, new, strict=True)):
        start = layout.width - c - n  # the row's first column after the step
        for i in range(n):
            seen = list(
                range(start, layout.width - n + i + 1)
            )  # its cached tokens, its new ones up to this one
            k, v = keys[row, 0, seen], values[row, 0, seen]
            for head in range(heads):
                weights = torch.softmax(k @ query[0, head, token] * d**-0.5, dim=0)
                assert torch.allclose(out[0, token, head], weights @ v, atol=1e-6), (token, head)
            token += 1
