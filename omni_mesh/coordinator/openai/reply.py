"""The reply's text, audio and token counts, read from the final stages' outputs as the topology's
`openai:` section says (see omni_mesh.topology.openai_spec).

A final stage that streams is read chunk by chunk, as each arrives; one that does not is read once,
when the request completes. Either way the reply is a sequence of Pieces, and the chat completion
(or its stream of deltas) is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_mesh.coordinator.openai.audio import AudioError, to_pcm16
from omni_mesh.topology.openai_spec import OpenAISpec, OutputRef


class ReplyError(ValueError):
    """A final stage's output does not hold what the `openai:` section says; names the stage and field."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


@dataclass
class Piece:
    text: str = ""
    pcm: bytes = b""  # 16-bit little-endian mono
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens)


class Reply:
    """Reads the pieces of one request's reply and keeps their totals."""

    def __init__(self, spec: OpenAISpec, final_stages: list[str], *, audio: bool = True) -> None:
        self.spec = spec
        self.final_stages = final_stages
        self.want_audio = audio  # False: the client asked for text only, so audio is not decoded
        self.sample_rate: int | None = spec.audio_output.sample_rate if spec.audio_output else None
        self.text = ""
        self.pcm = bytearray()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        #: "length" when a stage says max_tokens cut the reply (its `finish_reason` field), else "stop".
        self.finish_reason = "stop"
        self._streamed: set[str] = set()

    @property
    def stages(self) -> set[str]:
        refs = (self.spec.text_output, self.spec.audio_output, self.spec.usage_output)
        return {ref.stage for ref in refs if ref is not None}

    def chunk(self, stage: str, value: Any) -> Piece | None:
        """The piece in one streamed chunk of `stage` (None: the reply reads nothing from that stage)."""
        if stage not in self.stages:
            return None
        self._streamed.add(stage)
        return self._read(stage, value)

    def done(self, outputs: Any) -> list[Piece]:
        """The pieces of the stages that did not stream, from the request's `outputs`."""
        pieces = []
        for stage in sorted(self.stages - self._streamed):
            value = outputs if len(self.final_stages) == 1 else (outputs or {}).get(stage)
            items = value if isinstance(value, list) else [value]  # a stream with no chunk is []
            pieces.extend(self._read(stage, item) for item in items)
        return pieces

    @property
    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

    def _read(self, stage: str, value: Any) -> Piece:
        if not isinstance(value, dict):
            raise ReplyError(stage, f"stage {stage!r} output is a {type(value).__name__}, not a mapping of fields")
        piece = Piece()
        text_ref, audio_ref, usage_ref = self.spec.text_output, self.spec.audio_output, self.spec.usage_output
        if _reads(text_ref, stage, value):
            piece.text = _typed(value, text_ref, str, "a string")
            self.text += piece.text
        if text_ref is not None and stage == text_ref.stage and value.get("finish_reason") in ("stop", "length"):
            self.finish_reason = value["finish_reason"]
        if self.want_audio and _reads(audio_ref, stage, value):
            piece.pcm = self._audio(stage, value)
            self.pcm += piece.pcm
        if _reads(usage_ref, stage, value) and value[usage_ref.field] is not None:
            piece.usage = _usage(_typed(value, usage_ref, dict, "a mapping"), usage_ref)
            self.prompt_tokens += piece.usage[0]
            self.completion_tokens += piece.usage[1]
        return piece

    def _audio(self, stage: str, value: dict) -> bytes:
        ref = self.spec.audio_output
        assert ref is not None
        try:
            pcm, rate = to_pcm16(value[ref.field], ref.encoding)
        except AudioError as exc:
            raise ReplyError(stage, f"stage {stage!r} field {ref.field!r} (openai.audio_output): {exc}") from None
        if ref.sample_rate_field is not None:
            rate = _typed(value, OutputRef(stage, ref.sample_rate_field), int, "an integer (Hz)")
        if not pcm:
            return pcm
        rate = rate or ref.sample_rate
        if self.sample_rate is None or not self.pcm:
            self.sample_rate = rate
        elif rate != self.sample_rate:
            raise ReplyError(stage, f"stage {stage!r} changed its audio sample rate mid-reply ({self.sample_rate} -> {rate} Hz)")
        return pcm


def _reads(ref: OutputRef | None, stage: str, value: dict) -> bool:
    """Whether `ref` reads this output of `stage`: a chunk may leave out a field it has nothing for."""
    return ref is not None and ref.stage == stage and ref.field in value


def _typed(value: dict, ref: OutputRef, kind: type, described: str) -> Any:
    field = value.get(ref.field)
    if not isinstance(field, kind) or isinstance(field, bool):
        raise ReplyError(
            ref.stage, f"stage {ref.stage!r} field {ref.field!r} must be {described}, got {type(field).__name__}"
        )
    return field


def _usage(counts: dict, ref: OutputRef) -> tuple[int, int]:
    found = []
    for name in ("prompt_tokens", "completion_tokens"):
        count = counts.get(name, 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ReplyError(ref.stage, f"stage {ref.stage!r} field {ref.field}.{name} must be a count, got {count!r}")
        found.append(count)
    return found[0], found[1]
