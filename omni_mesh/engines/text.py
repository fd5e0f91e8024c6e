"""Text in and out of a thinker: the chat template over a request's inputs, and the reply decoded
token by token (a delta per token, held back while a character is still incomplete)."""

from __future__ import annotations

from typing import Any

from omni_mesh.errors import InvalidInput


def chat_messages(inputs: Any, *, media: bool = False) -> list[dict[str, Any]]:
    """`{"prompt": str, "system"?: str}` or `{"messages": [{"role", "content"}, ...]}` -> chat messages.

    A message's content is a string, or a list of OpenAI content parts. Without `media` (an engine
    with no processor that takes media) every content becomes its text, and a media part is refused
    (InvalidInput naming the message and the part). With `media`, a content of parts becomes a list of
    canonical parts (omni_mesh.media: text, audio, image, video, bytes decoded from base64), in order;
    a message of media alone is valid. A part of any other type is refused either way, never dropped.
    """
    if not isinstance(inputs, dict):
        raise InvalidInput(f'inputs must be a mapping such as {{"prompt": "Hello"}}, got {type(inputs).__name__}')
    if "messages" in inputs:
        messages = inputs["messages"]
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("inputs.messages must be a non-empty list of {role, content}")
        out = []
        for index, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = _parts(content, f"inputs.messages[{index}].content", media)
            if not isinstance(content, (str, list)) or not isinstance(message.get("role"), str):
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


def _parts(content: list[Any], where: str, media: bool) -> str | list[dict[str, Any]]:
    """OpenAI content parts -> their text (not `media`), or canonical parts."""
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidInput(f"{at}.text: a text part needs a string `text`")
            texts.append(text)
            parts.append({"type": "text", "text": text})
            continue
        from omni_mesh.media.parts import MEDIA_PARTS

        if kind not in MEDIA_PARTS:
            known = ", ".join(["text", *MEDIA_PARTS])
            raise InvalidInput(f"{at}: a part of type {kind!r} cannot be used here (part types: {known})")
        if not media:
            raise InvalidInput(
                f"{at}: a {kind} part, but this model's engine takes text only (no processor that takes media); "
                "send text, or serve a model with audio and vision inputs"
            )
        from omni_mesh.media import MediaError, canonical

        try:
            parts.append(canonical(part))
        except MediaError as exc:
            raise MediaError(f"{at}: {exc}") from None
    return parts if media else "".join(texts)


def prompt_ids(tokenizer: Any, inputs: Any) -> Any:
    """The chat template over the request's messages, as int64 ids [1, P]."""
    encoded = tokenizer.apply_chat_template(
        chat_messages(inputs), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"]


def _fast_decode(tokenizer: Any) -> Any:
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens=True)`: the Rust tokenizer's own decode
    where the wrapper would add nothing (no clean-up of spaces), about 4x cheaper a call (every streamed
    token decodes twice)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


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
        self.decode = _fast_decode(tokenizer)
        self.ids: list[int] = []
        self.start = 0  # where the decoded window starts
        self.read = 0  # ids up to here are sent
        self.held = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def extend(self, tokens: list[int]) -> None:
        """Ids whose text `advance()` (or `flush()`) gives later, all in one delta."""
        self.ids.extend(tokens)

    def advance(self) -> str:
        """The text of the ids added since the last delta (what `add` returns, for several ids at once)."""
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self.decode
        sent = decode(self.ids[self.start : self.read])
        text = decode(self.ids[self.start :])
        if not final and text.endswith("\ufffd") and self.held < self.MAX_HELD:  # a character split across tokens
            self.held += 1
            return ""
        self.held = 0
        # decoding changed text already sent (rare): send nothing more of it
        delta = text[len(sent) :] if text.startswith(sent) else ""
        self.read = len(self.ids)
        self.start = max(0, self.read - self.CONTEXT)
        return delta
