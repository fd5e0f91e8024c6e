"""Qwen2.5-Omni's token2wav DiT's attention mask, as small as it can be, and with padded rows masked.

The DiT builds its mask from block distances (`block_diff`, handed to each of its layers), expanded to
[rows x 2 (guidance), heads, L, L]; each layer compares it (>=, <=, &) and torch's attention turns the
result into an additive mask: on the tiny model, at 16 rows of 100 codes, 40% of a decode went into those
[32, heads, 200, 200] tensors, the same for every row and head. A forward pre-hook on each layer
(torch's `register_forward_pre_hook`, no model code forked) hands it `block_diff` as [1, 1, L, L] (the
attention broadcasts it: the same mask, the same numbers), or, for rows of different lengths right-padded
to the longest, [rows x 2, 1, L, L] with real and padded positions out of each other's reach: a real
position attends to real ones only, a padded one to padded ones only (never to nothing: no NaN to leak).
Everything else in the DiT works position by position.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def compact_mask(dit: Any, durations: list[int] | None = None) -> Iterator[None]:
    """While inside: the DiT's layers get the compact mask (module docstring); `durations`: each row's mel
    frames when the rows are right-padded to the longest (None or all equal: no padding)."""
    apart = None
    if durations is not None and len(set(durations)) > 1:
        frames = torch.arange(max(durations), device=dit.device)
        valid = frames[None, :] < torch.tensor(durations, device=dit.device)[:, None]
        valid = torch.cat([valid, valid])  # the rows, then their unconditioned twins (guidance)
        apart = (valid[:, :, None] != valid[:, None, :]).unsqueeze(1)  # [2B, 1, L, L]

    def compact(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        block_diff = kwargs["block_diff"]
        if apart is None:
            return args, {**kwargs, "block_diff": block_diff[:1, :1]}
        far = block_diff.shape[-1] + 1  # past any look-ahead or look-back
        return args, {**kwargs, "block_diff": block_diff[:, :1].masked_fill(apart, far)}

    hooks = [layer.register_forward_pre_hook(compact, with_kwargs=True) for layer in dit.transformer_blocks]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
