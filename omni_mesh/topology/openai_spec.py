"""The optional `openai:` section of a topology: how OpenAI's chat completions map onto the mesh.

```yaml
openai:
  model: qwen-omni-demo                  # the `model` clients send; /v1/models lists it (default: the topology's name)
  inputs:                                # the request's inputs, built from the chat request
    prompt: last_user_message            #   inputs.prompt = the text of the last user message
  text_output: {stage: code2wav, field: text}            # the reply text: that field of the stage's output
  audio_output: {stage: code2wav, field: audio_pcm16, encoding: pcm16, sample_rate_field: sample_rate}
  usage_output: {stage: code2wav, field: usage}          # optional: {prompt_tokens, completion_tokens}
```

- `inputs` maps each input name to one of SOURCES: `last_user_message` (its text parts joined),
  `messages` (the whole message list, as sent), `system_message` (the system and developer messages'
  text, "" if none).
- Each `*_output` names a final stage (by name or id) and a field of its output. When that stage
  streams, the field is read from every chunk and the pieces are joined (text concatenated, audio
  appended, usage summed); a stage that returns one output is one piece.
- `audio_output.encoding` says what the field holds: `pcm16` (16-bit little-endian mono samples, bytes),
  `float` (a 1-D array or tensor of samples in [-1, 1]) or `wav` (the bytes of a WAV file). pcm16 and
  float need the rate: `sample_rate: 24000`, or `sample_rate_field` naming the output field with it.
- At least one of `text_output` and `audio_output` is required.

This module holds the specs the coordinator's OpenAI room (omni_mesh.coordinator.openai) reads;
`omni_mesh.topology.openai` reads the section into them. Both stay in `topology/` (schema.py needs the
names below): topology is imported by every process, and the coordinator by none but its own.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCES = ("last_user_message", "messages", "system_message")
ENCODINGS = ("pcm16", "float", "wav")


@dataclass(frozen=True)
class OutputRef:
    """A field of a final stage's output (of each chunk, when the stage streams)."""

    stage: str  # the stage's name
    field: str


@dataclass(frozen=True)
class AudioRef(OutputRef):
    encoding: str = "pcm16"
    sample_rate: int | None = None  # a fixed rate, or
    sample_rate_field: str | None = None  # the output field that holds it


@dataclass(frozen=True)
class OpenAISpec:
    model: str
    inputs: dict[str, str]  # input name -> one of SOURCES
    text_output: OutputRef | None
    audio_output: AudioRef | None
    usage_output: OutputRef | None
