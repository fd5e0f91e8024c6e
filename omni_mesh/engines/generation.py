"""What the engines hand to `transformers`' generate(): a streamer that passes each new token to a
callback, a stopping criterion that ends generation when the request is cancelled (or a stop token
or string came: omni_mesh.engines.stops), and a request's sampling as vLLM has it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer


class TokenCallback(BaseStreamer):
    """Calls `on_token(id)` for every token generate() makes (generate() first puts the prompt: skipped)."""

    def __init__(self, on_token: Callable[[int], None] | None) -> None:
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.on_token is not None:
            for token in value.reshape(-1).tolist():
                self.on_token(int(token))

    def end(self) -> None:
        pass


class StopWhen(StoppingCriteria):
    """Stops every sequence once `should_stop()` is true (checked after each step). A `should_stop`
    with a `saw(token)` method (omni_mesh.engines.stops.StopWatch) is shown each new token first: the
    streamer sees it only after this check, a step too late to stop on it."""

    def __init__(self, should_stop: Callable[[], bool] | None) -> None:
        self.should_stop = should_stop

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        if (saw := getattr(self.should_stop, "saw", None)) is not None:
            saw(int(input_ids[0, -1]))
        stop = bool(self.should_stop and self.should_stop())
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def sampling_kwargs(temperature: float, top_p: float, top_k: int | None = None) -> dict[str, Any]:
    """generate()'s sampling arguments: greedy when temperature is 0."""
    if temperature <= 0:
        return {"do_sample": False}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": temperature, "top_p": top_p}
    if top_k is not None:
        kwargs["top_k"] = top_k
    return kwargs


def streaming(on_token: Callable[[int], None] | None, should_stop: Callable[[], bool] | None) -> dict[str, Any]:
    """generate()'s `streamer` and `stopping_criteria`: each new token to `on_token`, and an end once
    `should_stop()` (the request was cancelled)."""
    return {"streamer": TokenCallback(on_token), "stopping_criteria": StoppingCriteriaList([StopWhen(should_stop)])}



class Penalties(LogitsProcessor):
    """vLLM's presence and frequency penalties, over the reply's tokens only (not the prompt's): a
    token's logit less `frequency * count + presence * (count > 0)`; and OpenAI's logit_bias, added.
    generate() runs it after its repetition penalty and before temperature, top-k and top-p, where
    vLLM applies them."""

    def __init__(self, prompt_length: int, presence: float, frequency: float, bias: tuple[tuple[int, float], ...] = ()) -> None:
        self.prompt_length = prompt_length
        self.presence = presence
        self.frequency = frequency
        self.bias = bias

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.presence or self.frequency:
            reply = input_ids[:, self.prompt_length :]
            counts = torch.zeros_like(scores).scatter_add_(1, reply, torch.ones_like(reply, dtype=scores.dtype))
            scores = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        if self.bias:
            ids = [token for token, _ in self.bias]
            if max(ids) >= scores.shape[-1]:
                from omni_mesh.errors import InvalidInput

                raise InvalidInput(f"param 'logit_bias': token id {max(ids)} is past this model's vocabulary ({scores.shape[-1]} ids)")
            scores = scores.clone()
            scores[:, ids] += torch.tensor([value for _, value in self.bias], dtype=scores.dtype, device=scores.device)
        return scores


def decoding_args(sampling: Any, prompt_length: int) -> dict[str, Any]:
    """generate()'s arguments for a Sampling's top_k, min_p (both only when sampling, as vLLM ignores
    them greedy), repetition_penalty and the Penalties; the rest stays the checkpoint's
    generation_config (as vLLM takes it)."""
    args: dict[str, Any] = {}
    if sampling.temperature > 0:
        if sampling.top_k is not None:
            args["top_k"] = max(sampling.top_k, 0)  # vLLM's -1 (every token) is generate()'s 0
        if sampling.min_p is not None:
            args["min_p"] = sampling.min_p
    if sampling.repetition_penalty is not None:
        args["repetition_penalty"] = sampling.repetition_penalty
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.logit_bias:
        penalties = Penalties(prompt_length, sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias)
        args["logits_processor"] = LogitsProcessorList([penalties])
    return args
