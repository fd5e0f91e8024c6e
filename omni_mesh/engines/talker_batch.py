"""Qwen2.5-Omni's talker in a running batch (omni_mesh.engines.batching): the thinkers' batch
(omni_mesh.engines.thinker_batch) over the talker's forward."""

from __future__ import annotations

from typing import Any

import torch

from omni_mesh.engines.thinker_batch import Sequence, ThinkerBatch


class TalkerBatch(ThinkerBatch):
    """`batching.Engine` over Qwen2.5-Omni's talker: each step feeds a row its last code's embedding plus
    its next thinker reply row (`prepared.extra["reply_part"]`, the last one repeated once they run out),
    as the talker's forward does for one request; positions from the cache length, as generate() leaves
    them (it gives the talker no attention mask)."""

    position_rows = 3
    direct_first_step = False  # its inputs are the thinker's rows: generate() builds them

    def _rope_delta(self) -> int:
        delta = getattr(self.model, "rope_deltas", None)
        return 0 if delta is None else int(delta.reshape(-1)[0])

    def _forward(
        self, states: list[Sequence], tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        model = self.model
        rows = []
        for s in states:
            part = s.begun.prepared.extra["reply_part"]
            fed = (
                int(s.sequence.shape[1] - s.begun.prepared.input_ids.shape[1]) - 1
            )  # decode steps before this one
            rows.append(part[:, min(fed, part.shape[1] - 1)])
        embeds = model.get_input_embeddings()(tokens) + torch.stack(rows)
        out = model.model(
            inputs_embeds=model.thinker_to_talker_proj(embeds),
            position_ids=positions,
            attention_mask=self.mask,
            cache=self.cache,
            use_cache=True,
        )
        return out, model.codec_head(out.last_hidden_state[:, -1]).to(torch.float32)
