"""A batched step that prefills the prompts joining the batch and decodes the running rows in one forward
(omni_mesh.engines.thinker_batch), as vLLM's and transformers' continuous batching mix them: a step that
admits requests costs one pass through the model, not a prefill forward and then a decode forward (on a
CPU, a small model's forward is mostly per-op overhead: ~1.4 ms for the tiny thinker, whatever its rows).

Every row's new tokens (a running row's one, a joining prompt's all) go end to end as one sequence
[1, T], each token with its own positions, so the linear layers see the T real tokens and no padding.
The model's attention layers write their keys and values through `FlatCache.update`: each row's go
right after its cached ones in the batch's right-aligned layout (omni_mesh.engines.kv_stack). For the
forward, the language model's config names the attention `ATTENTION` (transformers' AttentionInterface,
no model code forked), which attends row by row as the batch's two forwards would: the running rows'
tokens over their rows of the cache (one SDPA call, the batch's padding masked), the joining prompts'
over themselves (one SDPA call, causal, left-padded to the longest). The cache it leaves is the one the
next decode step continues from (`FlatCache.stacked`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from omni_mesh.engines import kv_stack

#: The attention implementation a mixed step's forward runs under (registered below).
ATTENTION = "omni_mesh_mixed"

#: The step being computed in this thread (its layers' attention reads where each token goes).
_current = threading.local()


@dataclass
class Layout:
    """Where a step's new tokens go. Row b holds `cached[b]` tokens right-aligned in the batch's cache
    and gets `new[b]` more (a running row one, a joining prompt, with no cache yet, all of its own)."""

    cached: list[int]
    new: list[int]

    @property
    def lengths(self) -> list[int]:
        """Each row's tokens after the step."""
        return [c + n for c, n in zip(self.cached, self.new, strict=True)]

    @property
    def width(self) -> int:
        """The cache's width after the step: the longest row's."""
        return max(self.lengths)

    @property
    def last(self) -> list[int]:
        """The index, in the step's sequence, of each row's last new token (the one its logits come from)."""
        out, end = [], 0
        for n in self.new:
            end += n
            out.append(end - 1)
        return out


def fits(layout: Layout, config: Any) -> bool:
    """Whether the step may be one forward: rows with a cache get one token (a joining prompt's cache is
    empty), and the model attends through SDPA over its whole context (kv_stack: no sliding window)."""
    return all(
        c == 0 or n == 1 for c, n in zip(layout.cached, layout.new, strict=True)
    ) and kv_stack.plain_sdpa(config)


class FlatCache:
    """The cache the model's attention layers update during a mixed step: `cache`, the batch's stacked
    cache before the step (right-aligned rows), each row's new keys and values put after its cached ones;
    and, for `attend`, which of the step's tokens are the running rows' and which the joining prompts'."""

    def __init__(self, cache: DynamicCache, layout: Layout, device: Any) -> None:
        self.cache = cache
        self.before = int(cache.layers[0].keys.shape[2]) if cache.layers else 0
        lengths, last = layout.lengths, layout.last
        self.rows, self.width = len(lengths), max(lengths)
        width = self.width
        running = [b for b, c in enumerate(layout.cached) if c > 0]
        joining = [b for b, c in enumerate(layout.cached) if c == 0]
        self.longest = longest = max((layout.new[b] for b in joining), default=0)
        # the joining prompts left-padded to the longest: the step's token at each place, and those held
        places: list[int] = []
        held: list[int] = []
        for b in joining:
            first, size = last[b] - layout.new[b] + 1, layout.new[b]
            places.extend([first] * (longest - size) + list(range(first, first + size)))
            held.extend(range(first, first + size))
        # every index list in one tensor (a tensor made costs more than the few ints in it), then views
        parts = [
            [b for b, n in enumerate(layout.new) for _ in range(n)],  # each new token's row
            [width - n + i for n in layout.new for i in range(n)],  # and column: after the row's cached ones
            [width - n for n in lengths],  # where each row starts after the step
            running,
            [last[b] for b in running],  # a running row's token in the step's sequence
            joining,
            [longest - layout.new[b] for b in joining],  # where each joining prompt starts, padded
            places,
            held,
        ]
        packed = torch.tensor([i for part in parts for i in part], dtype=torch.long, device=device)
        (
            self.token_rows,
            self.token_columns,
            starts,
            self.running,
            self.running_tokens,
            self.joining,
            padded,
            self.joining_places,
            self.joining_tokens,
        ) = packed.split([len(part) for part in parts])
        self.mask = (
            torch.arange(width, device=device)[None, :] >= starts[:, None]
        )  # [rows, width] after the step
        self.running_mask = self.mask.index_select(0, self.running)[:, None, None]
        at = torch.arange(longest, device=device)
        self.joining_held = (at[None, :] >= padded[:, None]).flatten()
        # causal within each prompt, its padding hidden; a padding place sees what is before it (no empty row)
        query, key, start = at[None, :, None], at[None, None, :], padded[:, None, None]
        self.joining_mask = ((key <= query) & ((key >= start) | (query < start)))[:, None]
        # the usual order (the batch's rows run first, the prompts that join come after them): the
        # attention takes its rows and tokens as views, not copies
        self.ordered = running == list(range(len(running)))
        self.uniform = all(layout.new[b] == longest for b in joining)  # no prompt padded
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's new keys and values [1, heads, T, d] put in their rows: the batch's cache after the
        step, [rows, heads, width, d] each (what `attend` reads)."""
        old = self.cache.layers[layer] if layer < len(self.cache.layers) else None
        k = self._place(None if old is None else old.keys, keys)
        v = self._place(None if old is None else old.values, values)
        self.layers.append((k, v))
        return k, v

    def _place(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """[rows, heads, width, d]: the rows' cached tokens (right-aligned, each to end one before the last
        column: a row with a cache gets one new token), then the new tokens in their columns."""
        width = self.width
        if self.ordered and old is not None:  # the running rows' block, then the prompts' block
            running, parts = len(self.running), []
            if running:
                cached = old[:running]
                cached = (
                    cached[:, :, self.before - (width - 1) :]
                    if self.before >= width - 1
                    else kv_stack.pad_left(cached, width - 1)
                )
                parts.append(torch.cat([cached, new[0, :, :running].transpose(0, 1)[:, :, None]], dim=2))
            if len(self.joining):
                prompts = new[0, :, running:] if self.uniform else new[0].index_select(1, self.joining_places)
                prompts = prompts.reshape(new.shape[1], len(self.joining), self.longest, -1).transpose(0, 1)
                parts.append(kv_stack.pad_left(prompts, width))  # a padded prompt's padding: copies, masked
            return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        out = new.new_zeros(self.rows, new.shape[1], width, new.shape[3])
        keep = min(self.before, width - 1)
        if old is not None and keep > 0:
            out[:, :, width - 1 - keep : width - 1] = old[:, :, self.before - keep :]
        out[self.token_rows, :, self.token_columns] = new[0].transpose(0, 1)
        return out

    def attend(
        self, module: Any, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """The attention of the step's tokens (`query` [1, heads, T, d]; `keys`, `values` from `update`),
        row by row: [1, T, heads, d], as transformers' SDPA attention returns it."""
        if not self.ordered:
            return self._attend_any(module, query, keys, values, **kwargs)
        running, heads = len(self.running), query.shape[1]
        parts = []
        if running:  # the first tokens of the step, one a row
            q = query[0, :, :running].transpose(0, 1)[:, :, None]  # [R, heads, 1, d]
            done, _ = sdpa_attention_forward(
                module, q, keys[:running], values[:running], self.running_mask, **kwargs
            )
            parts.append(done[:, 0])
        if len(self.joining):
            q = query[0, :, running:] if self.uniform else query[0][:, self.joining_places]
            q = q.reshape(heads, len(self.joining), self.longest, -1).transpose(0, 1)
            k, v = keys[running:, :, -self.longest :], values[running:, :, -self.longest :]
            done, _ = sdpa_attention_forward(
                module, q, k, v, self.joining_mask, **kwargs
            )  # [J, longest, heads, d]
            parts.append(done.flatten(0, 1) if self.uniform else done.flatten(0, 1)[self.joining_held])
        return (torch.cat(parts) if len(parts) > 1 else parts[0])[None]

    def _attend_any(
        self, module: Any, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """`attend` for rows in any order (a prefilled prompt's row after one that joins unprefilled)."""
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, d]
        if len(self.running):
            q = query[0][:, self.running_tokens].transpose(0, 1)[:, :, None]  # [R, heads, 1, d]
            k, v = keys.index_select(0, self.running), values.index_select(0, self.running)
            done, _ = sdpa_attention_forward(module, q, k, v, self.running_mask, **kwargs)
            out[self.running_tokens] = done[:, 0]
        if len(self.joining):
            q = query[0][:, self.joining_places].reshape(query.shape[1], len(self.joining), self.longest, -1)
            k = keys.index_select(0, self.joining)[:, :, -self.longest :]
            v = values.index_select(0, self.joining)[:, :, -self.longest :]
            done, _ = sdpa_attention_forward(module, q.transpose(0, 1), k, v, self.joining_mask, **kwargs)
            out[self.joining_tokens] = done.flatten(0, 1)[self.joining_held]
        return out[None]

    def stacked(self) -> tuple[DynamicCache, torch.Tensor]:
        """The batch's cache after the step (`cache`, its layers' tensors replaced), as a decode step
        continues from it, and its mask [rows, width]."""
        for layer, (k, v) in zip(self.cache.layers, self.layers, strict=True):
            layer.keys, layer.values = k, v
        return self.cache, self.mask.long()


@contextlib.contextmanager
def mixed(config: Any, flat: FlatCache) -> Iterator[None]:
    """The language model of `config` (its text config: its attention layers') attends through `flat`
    while in the block, in this thread. The batch thread is the only one running the language model (a
    forward of another thread meanwhile would take plain SDPA without its mask); the towers' configs are
    not touched."""
    before = config._attn_implementation
    _current.flat = flat
    _name_attention(config, ATTENTION)
    try:
        yield
    finally:
        _name_attention(config, before)
        _current.flat = None


def _name_attention(config: Any, name: str) -> None:
    """`config._attn_implementation = name`, as its setter does for a config without sub-configs (a
    language model's), without the strict dataclass checks of every attribute set (~0.1 ms a step)."""
    if config.sub_configs or "_attn_implementation_internal" not in vars(config):
        config._attn_implementation = name
    else:
        vars(config)["_attn_implementation_internal"] = name


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    flat: FlatCache | None = getattr(_current, "flat", None)
    if flat is None:  # not a mixed step's (another thread's forward while one runs): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    kwargs.pop("position_ids", None)
    return flat.attend(module, query, key, value, **kwargs), None


AttentionInterface.register(ATTENTION, _attention)
