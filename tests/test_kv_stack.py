"""The running batch's KV cache changed in place (omni_mesh.engines.kv_stack.restack) holds the very
tensors and mask a whole restack (`stack`) makes of the same rows: rows leaving, joining, both, the
batch getting wider and narrower."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omni_mesh.engines import kv_stack  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 4


def own(length: int) -> list:
    return [(torch.randn(1, HEADS, length, DIM), torch.randn(1, HEADS, length, DIM)) for _ in range(LAYERS)]


def same(a: tuple, b: tuple) -> None:
    (cache_a, mask_a), (cache_b, mask_b) = a, b
    assert torch.equal(mask_a, mask_b) and mask_a.dtype == mask_b.dtype
    for x, y in zip(cache_a.layers, cache_b.layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize(
    ("keep", "joining"),
    [
        ([0, 1, 2, 3], [3]),  # one joins, shorter than the batch
        ([0, 1, 2, 3], [9, 2]),  # a longer one joins: every row gets wider
        ([1, 3], []),  # the longest left: the padding only it needed goes
        ([0, 2], [1]),  # rows leave and one joins
        ([3], [7, 7, 1]),
    ],
)
def test_restack_is_a_whole_stack(keep: list[int], joining: list[int]) -> None:
    torch.manual_seed(0)
    config = None
    lengths = [5, 2, 8, 3]
    batch, mask = kv_stack.stack([(own(n), -1, n) for n in lengths], None, config)
    new = [(own(n), -1, n) for n in joining]
    kept = [lengths[i] for i in keep]
    whole = kv_stack.stack([(None, i, lengths[i]) for i in keep] + new, batch, config)
    same(kv_stack.restack(batch, mask, keep, kept, new, config), whole)
