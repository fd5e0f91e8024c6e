"""The body of `POST /v1/chat/completions` (OpenAI's schema), and what it asks of the mesh.

OpenAI's sampling fields go to every stage as request params under their OpenAI names
(`max_completion_tokens` as `max_tokens`, `stop` always a list), next to `modalities`, `voice` and
`audio_format`, and `stream: true` (the route always reads the final stage's stream). `params` is our
extension for pipeline-specific params (`extra_body={"params": {...}}` in OpenAI's Python client).
The topology's `openai.inputs` says which inputs the messages become.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from omni_mesh.coordinator.openai.audio import audio_unavailable
from omni_mesh.topology.openai_spec import OpenAISpec

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]

#: Sampling fields passed to the stages as params, under these names.
SAMPLING = (
    "temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty", "logit_bias",
    "top_k", "min_p", "repetition_penalty", "stop_token_ids",
)


class ChatRequestError(ValueError):
    """A request the mesh cannot serve as asked: `param` names the field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, audio, tool_calls, ...: kept, passed on with `messages`

    role: Role
    content: str | list[dict[str, Any]] | None = None


class AudioOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    voice: str | dict[str, Any] | None = Field(default=None, description="passed to the stages as params.voice")
    format: Literal["wav", "pcm16", "flac", "mp3", "opus"] = Field(
        default="wav", description="of message.audio.data and of each audio delta (each a whole file but pcm16)"
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(default=None, min_length=1)
    audio: AudioOptions | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Probability | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, max_length=4)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None  # vLLM's extensions, which its clients send
    min_p: Probability | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: int | None = Field(default=None, description="only 1")
    logprobs: StrictBool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None  # accepted and not used, like metadata, store and service_tier
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM's: passed to the stages as params.mm_processor_kwargs (use_audio_in_video)"
    )
    params: dict[str, Any] = Field(default_factory=dict, description="omni-mesh: more params for the stages")


@dataclass(frozen=True)
class ChatCall:
    """What one chat request asks of the mesh."""

    inputs: dict[str, Any]
    params: dict[str, Any]
    text: bool  # the client wants the text
    audio_format: str | None  # None: no audio wanted
    include_usage: bool


def chat_call(body: ChatRequest, spec: OpenAISpec) -> ChatCall:
    """The inputs and params of `body` for the topology's `spec`; ChatRequestError for what we cannot serve."""
    _refuse_unsupported(body)
    modalities = body.modalities or ["text"]
    if "audio" in modalities and spec.audio_output is None:
        raise ChatRequestError(f"model {spec.model!r} has no audio output; ask for modalities [\"text\"]", "modalities")
    audio_format = (body.audio.format if body.audio else "wav") if "audio" in modalities else None
    if audio_format is not None and (why := audio_unavailable(audio_format)):
        raise ChatRequestError(why, "audio.format", status=501)
    params = _params(body, modalities)
    media = "messages" in spec.inputs.values()  # the whole messages go on: the entry stage reads the media
    inputs = {name: _source(body.messages, source, media) for name, source in spec.inputs.items()}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return ChatCall(inputs, params, "text" in modalities, audio_format, include_usage)


def _refuse_unsupported(body: ChatRequest) -> None:
    if body.n not in (None, 1):
        raise ChatRequestError(f"n={body.n}: only one choice per request is supported (n: 1)", "n")
    if body.logprobs or body.top_logprobs:
        raise ChatRequestError("logprobs are not supported by omni-mesh pipelines; leave logprobs unset", "logprobs")
    if body.tools:
        raise ChatRequestError("tools are not supported by omni-mesh pipelines; leave tools unset", "tools")
    if body.response_format and body.response_format.get("type") != "text":
        raise ChatRequestError("only response_format {\"type\": \"text\"} is supported", "response_format")
    if body.stream_options is not None and not body.stream:
        raise ChatRequestError("stream_options is only allowed with stream: true", "stream_options")


def _params(body: ChatRequest, modalities: list[str]) -> dict[str, Any]:
    if body.max_tokens and body.max_completion_tokens and body.max_tokens != body.max_completion_tokens:
        raise ChatRequestError(
            f"max_tokens ({body.max_tokens}) and max_completion_tokens ({body.max_completion_tokens}) differ; "
            "send one of them", "max_completion_tokens",
        )
    ours: dict[str, Any] = {name: getattr(body, name) for name in SAMPLING if getattr(body, name) is not None}
    if isinstance(ours.get("stop"), str):
        ours["stop"] = [ours["stop"]]
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None:
        ours["max_tokens"] = max_tokens
    ours["modalities"] = modalities
    if "audio" in modalities:
        ours["audio_format"] = body.audio.format if body.audio else "wav"
        if body.audio and body.audio.voice is not None:
            ours["voice"] = body.audio.voice
    if body.mm_processor_kwargs is not None:
        use = body.mm_processor_kwargs.get("use_audio_in_video")
        if use is not None and not isinstance(use, bool):
            raise ChatRequestError(
                "mm_processor_kwargs.use_audio_in_video must be true or false", "mm_processor_kwargs.use_audio_in_video"
            )
        ours["mm_processor_kwargs"] = body.mm_processor_kwargs
    ours["stream"] = True
    for name, value in ours.items():
        if name in body.params and body.params[name] != value:
            raise ChatRequestError(f"params.{name} conflicts with the request's own {name}; send it once", f"params.{name}")
    return {**body.params, **ours}


def _source(messages: list[Message], source: str, media: bool) -> Any:
    if source == "messages":
        return [message.model_dump(exclude_none=True) for message in messages]
    if not media:  # only text reaches the pipeline: a media part anywhere would be lost
        for index, message in enumerate(messages):
            _text(message, index, strict=True)
    if source == "system_message":
        return "\n".join(_text(m, i) for i, m in enumerate(messages) if m.role in ("system", "developer"))
    users = [(i, m) for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise ChatRequestError("messages: there is no user message to reply to; add {\"role\": \"user\", ...}", "messages")
    index, message = users[-1]
    text = _text(message, index)
    if not text.strip():
        raise ChatRequestError(f"messages[{index}].content: the last user message has no text", f"messages[{index}].content")
    return text


def _text(message: Message, index: int, *, strict: bool = False) -> str:
    """A message's text: its content string, or its text parts joined by newlines; `strict`: a part
    of another type is refused (the pipeline would never see it)."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part_index, part in enumerate(message.content):
        if part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                where = f"messages[{index}].content[{part_index}].text"
                raise ChatRequestError(f"{where}: a text part needs a string `text`", where)
            texts.append(text)
        elif strict:
            where = f"messages[{index}].content[{part_index}]"
            raise ChatRequestError(
                f"{where}: a {part.get('type')!r} part, but this model takes only text (its openai.inputs pass "
                "no `messages` on); send text parts", where,
            )
    return "\n".join(texts)
