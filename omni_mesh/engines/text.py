"""Text in and out of a thinker: the chat template over a request's inputs, and the reply decoded
token by token (a delta per token, held back while a character is still incomplete)."""

from __future__ import annotations

from typing import Any

from omni_mesh.errors import InvalidInput


def chat_messages(inputs: Any) -> list[dict[str, str]]:
    """`{"prompt": str, "system"?: str}` or `{"messages": [{"role", "content"}, ...]}` -> chat messages."""
    if not isinstance(inputs, dict):
        raise InvalidInput(f'inputs must be a mapping such as {{"prompt": "Hello"}}, got {type(inputs).__name__}')
    if "messages" in inputs:
        messages = inputs["messages"]
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("inputs.messages must be a non-empty list of {role, content}")
        out = []
        for index, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # OpenAI content parts: the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            if not isinstance(content, str) or not isinstance(message.get("role"), str):
                raise InvalidInput(f"inputs.messages[{index}] must have a string role and text content")
            out.append({"role": message["role"], "content": content})
        return out
    prompt = inputs.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidInput('inputs.prompt: missing or not a non-empty string; send {"prompt": "Hello"}')
    messages = []
    system = inputs.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise InvalidInput("inputs.system must be a string")
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return messages


def prompt_ids(tokenizer: Any, inputs: Any) -> Any:
    """The chat template over the request's messages, as int64 ids [1, P]."""
    encoded = tokenizer.apply_chat_template(
        chat_messages(inputs), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"]


class Detokenizer:
    """Reply ids -> text deltas whose concatenation is `decode(all ids, skip_special_tokens=True)` for
    any reply that is text (bytes that make no character, as a random model emits, may come out as
    other replacement characters).

    Each step decodes only the ids not sent yet and a few before them (decoding a token can depend
    on its neighbours): the whole reply again at every token would cost its length squared."""

    #: A UTF-8 character spans at most 4 bytes, so at most 3 more tokens complete it; bytes that never
    #: make a character (a random model emits such) are sent as they are after that.
    MAX_HELD = 3
    CONTEXT = 5  # ids decoded again before the unsent ones

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # where the decoded window starts
        self.read = 0  # ids up to here are sent
        self.held = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self.tokenizer.decode
        sent = decode(self.ids[self.start : self.read], skip_special_tokens=True)
        text = decode(self.ids[self.start :], skip_special_tokens=True)
        if not final and text.endswith("\ufffd") and self.held < self.MAX_HELD:  # a character split across tokens
            self.held += 1
            return ""
        self.held = 0
        # decoding changed text already sent (rare): send nothing more of it
        delta = text[len(sent) :] if text.startswith(sent) else ""
        self.read = len(self.ids)
        self.start = max(0, self.read - self.CONTEXT)
        return delta
