"""What the engines hand to `transformers`' generate(): a streamer that passes each new token to a
callback, and a stopping criterion that ends generation when the request is cancelled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import StoppingCriteria, StoppingCriteriaList
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
    """Stops every sequence once `should_stop()` is true (checked after each step)."""

    def __init__(self, should_stop: Callable[[], bool] | None) -> None:
        self.should_stop = should_stop

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

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

