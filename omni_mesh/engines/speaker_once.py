"""Qwen2.5-Omni's token2wav DiT's speaker encoder run once per decode call, not per row and per ODE step.

The DiT's input embedding runs its speaker encoder (ECAPA-TDNN) on the reference mel in every forward:
rows x 2 (guidance: the reference, then zeros for the unconditioned twin), in each of the ODE's
forwards (10 steps of RK4: 36 of them), the same input each time. Its rows do not mix (eval mode: the
batch norms use their running statistics), so while inside `speaker_once` the encoder's `forward` is
wrapped (an instance attribute over the class's method, no model code forked): its distinct input rows
(per speaker: the reference mel and zeros) are encoded once, in one call, in order of first appearance,
and every row gets its twin's output; a forward with the same input as the last returns the last output.
A decode alone encodes the same two rows in the same call as before, so its output is unchanged bit for
bit, and a row of a batch gets the same speaker embedding as it gets alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def speaker_once(dit: Any) -> Iterator[None]:
    """While inside: `dit`'s speaker encoder encodes each distinct input row once (module docstring)."""
    encoder = dit.input_embed.spk_encoder
    encode = type(encoder).forward.__get__(encoder)  # the model's own forward, not a wrapper around it
    last: list[torch.Tensor] = []  # [input, output] of the last forward

    def once(hidden_states: torch.Tensor) -> torch.Tensor:
        if last and last[0].shape == hidden_states.shape and torch.equal(last[0], hidden_states):
            return last[1]
        distinct, which = _distinct_rows(hidden_states)
        output = encode(hidden_states[distinct])[which]
        last[:] = [hidden_states, output]
        return output

    before = encoder.__dict__.get("forward")
    encoder.forward = once
    try:
        yield
    finally:
        if before is None:
            del encoder.forward
        else:
            encoder.forward = before


def _distinct_rows(rows: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The index of each distinct row's first appearance, and for every row the position of its twin
    among them (int64 [rows])."""
    distinct: list[int] = []
    which: list[int] = []
    for i, row in enumerate(rows):
        twin = next((k for k, j in enumerate(distinct) if torch.equal(rows[j], row)), None)
        if twin is None:
            twin = len(distinct)
            distinct.append(i)
        which.append(twin)
    return distinct, torch.tensor(which, device=rows.device)
