"""Chunked prefill: a prompt goes through a model in pieces, the request's stop flag checked before
each, then `generate()` continues from the filled cache.

One forward over a long prompt cannot be interrupted: a cancelled request (deadline, client gone) would
keep a core busy for as long as the whole prompt takes. In pieces of `chunk` tokens, a stop ends the
compute within one piece. The result is the one-call path's: the position ids (3-D rope included) are
computed once for the whole prompt, as generate() computes them, and each piece gets its slice; the
cache is transformers' own, and generate() runs the last `keep` rows itself (so it makes the first
token's logits, streams and stops as always). tests/test_prefill.py compares logits and tokens.

Also here: the check that a prompt fits the model's context (and the stage's `max_prompt_tokens`),
made before any compute, so a prompt too long is a 4xx naming the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from omni_mesh.errors import InvalidInput

T = TypeVar("T")

#: Tokens per piece: small enough that one piece of a long prompt takes well under a second on a CPU,
#: large enough that the pieces cost no more than one call (measured: docs/engines.md).
DEFAULT_CHUNK = 512


@dataclass
class Prepared:
    """A thinker's prompt made ready for generate(): the ids [1, P], generate()'s extra arguments (the
    filled cache and positions of a chunked prefill, the media, eos, ...), the prefilled tokens' hidden
    states per kept layer, and what the architecture reads back when it builds its output."""

    input_ids: torch.Tensor
    kwargs: dict[str, Any]
    hidden: list[torch.Tensor] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class PrefillStopped(Exception):
    """The request was cancelled while its prompt was being prefilled (nothing to return)."""


def check_prompt(tokens: int, *, context: int | None, limit: int | None, who: str, room: int = 1) -> None:
    """InvalidInput (a 4xx) when `tokens` of input do not fit `who`'s context (with `room` tokens left to
    generate) or exceed the stage's `max_prompt_tokens`."""
    if limit is not None and tokens > limit:
        raise InvalidInput(
            f"{who}: the prompt is {tokens} tokens, more than this stage's engine.max_prompt_tokens of {limit}"
        )
    if context is not None and tokens + room > context:
        raise InvalidInput(
            f"{who}: the prompt is {tokens} tokens and does not fit the model's context of {context} tokens "
            f"(max_position_embeddings, with {room} left to generate); shorten the prompt"
        )


def prefill(
    length: int, *, chunk: int, should_stop: Callable[[], bool] | None, step: Callable[[int, int], T]
) -> list[T]:
    """`step(start, end)` over [0, length) in pieces of `chunk`; PrefillStopped as soon as `should_stop()`
    is true before a piece. Returns what each piece's step returned."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    outputs = []
    for start in range(0, length, chunk):
        if should_stop is not None and should_stop():
            raise PrefillStopped(f"stopped after {start} of {length} prompt tokens")
        outputs.append(step(start, min(start + chunk, length)))
    return outputs


def new_cache(model: Any) -> DynamicCache:
    return DynamicCache(config=model.config.get_text_config())


def generation_positions(model: Any, inputs: torch.Tensor, **model_kwargs: Any) -> torch.Tensor:
    """The position ids generate() computes for the whole prompt `inputs` (ids, or embeddings with the ids
    in `model_kwargs`): for these models 3-D rope rows after the text row, [4, 1, L]."""
    mask = torch.ones(inputs.shape[:2], dtype=torch.long, device=inputs.device)
    return model._prepare_position_ids_for_generation(inputs, {"attention_mask": mask, **model_kwargs})


def thinker_prefill(
    model: Any,
    input_ids: torch.Tensor,
    *,
    chunk: int,
    should_stop: Callable[[], bool] | None,
    layers: tuple[int, ...] = (),
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A thinker's prompt (ids [1, P]) but its last token through the thinker's decoder in pieces. Returns
    generate()'s extra arguments (the filled cache, the whole prompt's position ids) and, per layer in
    `layers`, the hidden states of the prefilled tokens [1, P - 1, H] (generate()'s first step adds the
    last token's)."""
    cache = new_cache(model)
    positions = generation_positions(model, input_ids)

    def step(start: int, end: int) -> list[torch.Tensor]:
        out = model.model(
            input_ids=input_ids[:, start:end],
            position_ids=positions[..., start:end],
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        return [out.hidden_states[layer] for layer in layers]

    pieces = prefill(input_ids.shape[1] - 1, chunk=chunk, should_stop=should_stop, step=step)
    return {"cache": cache, "position_ids": positions}, [
        torch.cat(layer, dim=1) for layer in zip(*pieces, strict=True)
    ]


def whole_prompt(prefilled: list[torch.Tensor], index: int, first_step: torch.Tensor) -> torch.Tensor:
    """One layer's hidden states of the whole prompt: the prefilled rows (none for a one-token prompt),
    then those of generate()'s first step."""
    return torch.cat([prefilled[index], first_step], dim=1) if prefilled else first_step
