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
    """Reply ids -> text deltas whose concatenation is `decode(all ids, skip_special_tokens=True)`."""

    #: A UTF-8 character spans at most 4 bytes, so at most 3 more tokens complete it; bytes that never
    #: make a character (a random model emits such) are sent as they are after that.
    MAX_HELD = 3

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""
        self.held = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and self.held < self.MAX_HELD:  # a character split across tokens
            self.held += 1
            return ""
        self.held = 0
        return self._delta(text)

    def flush(self) -> str:
        return self._delta(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):  # decoding changed earlier text (rare): send nothing more of it
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
