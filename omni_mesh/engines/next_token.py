"""A request's next token as generate() picks it: the logits processors generate() builds for it alone,
then argmax or a draw (omni_mesh.engines.thinker_batch; draw_rows picks many rows' at once)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessorList


def draw(
    processors: LogitsProcessorList,
    sequence: torch.Tensor,
    logits: torch.Tensor,
    greedy: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """`sequence` [1, n] with the next token as generate() picks it: its processors over the sequence so
    far, then argmax or a draw (from the request's own generator when it is seeded)."""
    scores = processors(sequence, logits)
    if greedy:
        token = torch.argmax(scores, dim=-1)
    else:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        token = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    return torch.cat([sequence, token[:, None].to(sequence.dtype)], dim=-1)


def logits_processors(model: Any, generation: dict[str, Any], input_ids: torch.Tensor) -> LogitsProcessorList:
    """The logits processors generate() builds for one request (the model's generation_config, the
    request's sampling `generation`; generate()'s private helpers, so the two paths cannot drift apart)."""
    kwargs = dict(generation)
    custom = kwargs.pop("logits_processor", None)
    config, _ = model._prepare_generation_config(None, **kwargs)
    model._prepare_special_tokens(config, True, device=input_ids.device, batch_size=1)
    return model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=int(input_ids.shape[1]),
        encoder_input_ids=input_ids,
        logits_processor=custom,
        device=input_ids.device,
        model_kwargs={},
    )
