"""The next token of many rows of a running batch at once, each as `next_token.draw` picks it alone.

A row's draw runs its logits processors over its own sequence, then an argmax (greedy) or a draw from its
own generator. Called row by row, that is a few small tensor ops a row and step: at 16 rows of Qwen3's
talker (a repetition penalty and its suppressed control ids, then the code predictor's 3 groups) ~6 ms
of a ~10 ms step on the tiny model. Greedy rows whose processors do the same thing to any row of the
batch (equal settings, and kinds whose effect does not depend on a sequence's length) share one call: their
sequences left-padded with their own first token (a token the row already has: the repetition penalty
sees the same set of ids), their logits stacked; element-wise ops, so each row's scores, and its argmax,
are bit for bit those of its own call. Any other row (sampling, other processors, an empty sequence) is
drawn alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from omni_mesh.engines.next_token import draw


def shared_key(processors: LogitsProcessorList, generation: dict[str, Any], greedy: bool) -> str | None:
    """What a greedy row's processors do, as a key rows may share a draw by (computed once, when the row
    joins); None: the row draws alone (sampling, or a processor whose effect depends on the sequence's
    length)."""
    if not greedy:
        return None
    for processor in processors:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor):
            if getattr(processor, "prompt_ignore_length", None) is not None:  # cuts the sequence's start
                return None
        elif not isinstance(processor, SuppressTokensLogitsProcessor):
            return None
    # the generate() settings the processors were built from (suppressed ids, penalty): equal settings,
    # equal processors
    return repr(sorted((name, repr(value)) for name, value in generation.items()))


def draw_rows(
    rows: list[tuple[LogitsProcessorList, torch.Tensor, bool, torch.Generator | None, str | None]],
    logits: torch.Tensor,
) -> list[torch.Tensor]:
    """Each row's sequence [1, n] with its next token as `draw` appends it; `rows`: (processors, sequence,
    greedy, generator, shared_key()), `logits` [rows, V] float32 in the same order."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (processors, sequence, greedy, generator, key) in enumerate(rows):
        if key is not None and (sequence.shape[1] > 0 or not processors):
            groups[key].append(i)
        else:
            out[i] = draw(processors, sequence, logits[i : i + 1], greedy, generator)
    for members in groups.values():
        if len(members) == 1:
            i = members[0]
            processors, sequence, greedy, generator, _ = rows[i]
            out[i] = draw(processors, sequence, logits[i : i + 1], greedy, generator)
            continue
        sequences, processors = [rows[i][1] for i in members], rows[members[0]][0]
        scores = logits[members]
        if processors:  # (none: generate()'s plain argmax, whatever the sequences)
            width = max(int(s.shape[1]) for s in sequences)
            padded = torch.cat(
                [torch.cat([s[:, :1].expand(1, width - s.shape[1]), s], dim=1) for s in sequences]
            )
            scores = processors(padded, scores)
        tokens = torch.argmax(scores, dim=-1)
        for j, i in enumerate(members):
            out[i] = torch.cat([sequences[j], tokens[j : j + 1, None].to(sequences[j].dtype)], dim=-1)
    assert all(sequence is not None for sequence in out)
    return out  # type: ignore[return-value]
