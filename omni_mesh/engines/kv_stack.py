"""The running batch's KV cache (omni_mesh.engines.thinker_batch): every row's cache right-aligned behind
zeros to the longest row's length, stacked into one DynamicCache, with the attention mask [rows, width]
that hides the padding.

`stack` builds it from each row's own cache (or its rows of the batch so far): a pad and a copy per row
and layer. A running batch changes most steps (requests end and arrive one or two at a time), so
`restack` changes the batch in place instead when the rows that stay keep their order and the new ones
come after them: the rows that left are taken out and the padding no row needs any more cut, in a few
tensor operations per layer, whatever the number of rows. Both give the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

#: A row of the batch to be: its own cache (a list of (keys, values) per layer, [1, heads, n, d]), or
#: None and its index in the batch so far; and its length.
Row = tuple[list[tuple[torch.Tensor, torch.Tensor]] | None, int, int]


def pad_left(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """`x` with zeros before, along `dim`, to `width`."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def padding_mask(lengths: list[int], width: int, device: Any) -> torch.Tensor:
    """[rows, width] int64: 0 over each row's left padding, 1 over its tokens."""
    starts = torch.tensor([width - n for n in lengths], device=device)
    return (torch.arange(width, device=device)[None, :] >= starts[:, None]).long()


def stack(rows: list[Row], cache: DynamicCache | None, config: Any) -> tuple[DynamicCache, torch.Tensor]:
    """The batch of `rows` (the batch so far in `cache`, for rows given by index): (cache, mask)."""
    width = max(length for _, _, length in rows)
    old_width = 0 if cache is None else cache.layers[0].keys.shape[2]
    first = rows[0][0]
    layers = len(first) if first is not None else len(cache.layers)  # type: ignore[union-attr]
    out = DynamicCache(config=config)
    for layer in range(layers):
        keys, values = [], []
        for kv, index, length in rows:
            if kv is not None:
                k, v = kv[layer]
            else:  # its rows of the batch so far, without their padding
                k = cache.layers[layer].keys[index : index + 1, :, old_width - length :]  # type: ignore[union-attr]
                v = cache.layers[layer].values[index : index + 1, :, old_width - length :]  # type: ignore[union-attr]
            keys.append(pad_left(k, width))
            values.append(pad_left(v, width))
        out.update(torch.cat(keys), torch.cat(values), layer)
    return out, padding_mask([length for *_, length in rows], width, out.layers[0].keys.device)


def restack(
    cache: DynamicCache,
    mask: torch.Tensor,
    keep: list[int],
    kept_lengths: list[int],
    joining: list[Row],
    config: Any,
) -> tuple[DynamicCache, torch.Tensor]:
    """The batch so far (`cache`, `mask`) with only its rows `keep` (in that order: increasing), then the
    `joining` rows (their own caches) after them: what `stack` would make of the same rows."""
    old_rows, old_width = mask.shape
    width = max(kept_lengths + [length for *_, length in joining])
    select = None if keep == list(range(old_rows)) else torch.tensor(keep, device=mask.device)

    def fit(x: torch.Tensor, dim: int) -> torch.Tensor:
        if select is not None:
            x = x.index_select(0, select)
        if width < old_width:  # the padding that only rows which left needed
            return x.narrow(dim, old_width - width, width)
        return pad_left(x, width, dim)

    out = DynamicCache(config=config)
    for layer, old in enumerate(cache.layers):
        keys = [fit(old.keys, 2)] + [pad_left(kv[layer][0], width) for kv, _, _ in joining]  # type: ignore[index]
        values = [fit(old.values, 2)] + [pad_left(kv[layer][1], width) for kv, _, _ in joining]  # type: ignore[index]
        out.update(
            torch.cat(keys) if len(keys) > 1 else keys[0],
            torch.cat(values) if len(values) > 1 else values[0],
            layer,
        )
    masks = [fit(mask, 1)]
    if joining:
        masks.append(padding_mask([length for *_, length in joining], width, mask.device))
    return out, torch.cat(masks) if len(masks) > 1 else masks[0]


def step_mask(mask: torch.Tensor, config: Any) -> torch.Tensor:
    """The attention mask of a decode step (one new token a row; `mask` [rows, width + 1] with its
    column). transformers builds the 4-D mask from the 2-D one at every forward, checks and all, which
    cost about a tenth of a small model's step; where padding hides part of the cache from some row and
    the model attends through SDPA over full attention only, this is the 4-D boolean mask that comes to
    (each cached token is before the new one: only the padding is hidden), made at once. Else `mask`
    (no padding: transformers gives SDPA no mask at all)."""
    if not plain_sdpa(config) or bool(mask[:, 0].all()):
        return mask
    return mask[:, None, None, :].bool()


def prefill_mask(mask: torch.Tensor, config: Any) -> torch.Tensor:
    """As `step_mask`, for prompts left-padded into one forward over an empty cache (`mask` [rows, width]):
    causal, and the padding hidden. The tokens of a row's prompt see the same keys either way."""
    if not plain_sdpa(config) or bool(mask[:, 0].all()):
        return mask
    width = mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
    return causal[None, None] & mask.bool()[:, None, None, :]


def plain_sdpa(config: Any) -> bool:
    """Whether the model attends through SDPA, every layer over the whole context (no sliding window)."""
    text = config.get_text_config()
    if text._attn_implementation != "sdpa" or getattr(text, "use_sliding_window", False):
        return False
    return all(kind == "full_attention" for kind in getattr(text, "layer_types", None) or ())
