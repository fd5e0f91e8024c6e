"""A request's `stop` strings and `stop_token_ids`, with vLLM's semantics: the reply ends at the first
token that is a stop id (kept in the reply, and in its text unless it is a special token) or that
completes a stop string (the text ends right before the stop string, streamed or not).

`StopWatch` runs in the model thread: generate()'s stopping criterion shows it each new token
(omni_mesh.engines.generation.StopWhen), so generation ends on that very token. `StopText` runs on
the text the client reads: it cuts the text at the first stop string, and while streaming holds back
the few last characters that could still begin one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_mesh.engines.text import Detokenizer


class StopWatch:
    """Called with no argument, as a stop flag: true once the request is cancelled (`cancelled()`) or
    a stop token or string came; `saw(token)` is shown every new token first."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], stop_token_ids: tuple[int, ...]) -> None:
        self.stop = stop
        self.ids = frozenset(stop_token_ids)
        self.detok = Detokenizer(tokenizer) if stop else None
        self.text = ""
        self.hit = False  # a stop token or string ended the reply
        self.cancelled: Callable[[], bool] | None = None

    def until(self, cancelled: Callable[[], bool]) -> StopWatch:
        """This watch, also true once `cancelled()` is."""
        self.cancelled = cancelled
        return self

    def saw(self, token: int) -> None:
        if self.hit:
            return
        if token in self.ids:
            self.hit = True
        if self.detok is not None and (delta := self.detok.add(token)):
            self.text += delta
            # a stop string completed by this delta lies in its characters and the ones just before
            self.hit = self.hit or first_stop(self.text, self.stop, len(self.text) - len(delta) - _longest(self.stop)) is not None

    def __call__(self) -> bool:
        return self.hit or bool(self.cancelled and self.cancelled())


class StopText:
    """Text deltas in, text deltas out that end before the first stop string (none: all of it)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.hold = max(_longest(stop) - 1, 0)  # characters that could be the start of a stop string
        self.text = ""
        self.sent = 0
        self.done = False

    def add(self, delta: str) -> str:
        if self.done or not delta:
            return ""
        self.text += delta
        # nothing sent holds a stop string's start (held back): look from there on
        cut = first_stop(self.text, self.stop, self.sent)
        if cut is not None:
            self.done = True
            return self._send(cut)
        return self._send(max(self.sent, len(self.text) - self.hold))

    def flush(self) -> str:
        return "" if self.done else self._send(len(self.text))

    def whole(self, text: str) -> str:
        """All of a reply's text at once: `text` up to its first stop string."""
        return self.add(text) + self.flush()

    def _send(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = end
        return out


def first_stop(text: str, stop: tuple[str, ...], start: int = 0) -> int | None:
    """Where the earliest stop string in `text[start:]` begins, or None."""
    found = [at for s in stop if (at := text.find(s, max(start, 0))) >= 0]
    return min(found) if found else None


def _longest(stop: tuple[str, ...]) -> int:
    return max((len(s) for s in stop), default=0)
