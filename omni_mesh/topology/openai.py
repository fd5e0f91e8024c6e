"""The `openai:` section of a topology file read into `omni_mesh.openai_section`'s specs (the section's
format is described there)."""

from __future__ import annotations

import difflib
from typing import Any

from omni_mesh.openai_section import ENCODINGS, SOURCES, AudioRef, OpenAISectionError, OpenAISpec, OutputRef
from omni_mesh.topology.model import Topology, TopologyError

_SECTION_KEYS = ("model", "inputs", "text_output", "audio_output", "usage_output")
_OUTPUT_KEYS = ("stage", "field")
_AUDIO_KEYS = (*_OUTPUT_KEYS, "encoding", "sample_rate", "sample_rate_field")


def read_openai_section(raw: Any, topology: Topology) -> OpenAISpec | None:
    """parse_openai_section, its errors as TopologyError (with the key at fault, for its line)."""
    try:
        return parse_openai_section(raw, topology)
    except OpenAISectionError as exc:
        raise TopologyError(str(exc), key_of=getattr(exc, "key_of", None)) from None


def parse_openai_section(raw: Any, topology: Topology) -> OpenAISpec | None:
    """The validated `openai:` section of `topology` (None when the file has none)."""
    if raw is None:
        return None
    section = _mapping(raw, "openai", _SECTION_KEYS)
    model = section.get("model", topology.name)
    if not isinstance(model, str) or not model.strip():
        raise OpenAISectionError(f"openai.model: must be a non-empty string, got {model!r}")
    spec = OpenAISpec(
        model=model,
        inputs=_inputs(section.get("inputs")),
        text_output=_output(section.get("text_output"), "text_output", topology),
        audio_output=_audio(section.get("audio_output"), topology),
        usage_output=_output(section.get("usage_output"), "usage_output", topology),
    )
    if spec.text_output is None and spec.audio_output is None:
        raise OpenAISectionError(
            "openai: names neither text_output nor audio_output; add e.g. "
            "`text_output: {stage: <final stage>, field: text}`"
        )
    return spec


def _mapping(raw: Any, where: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(raw, dict):
        raise OpenAISectionError(f"{where}: must be a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            error = OpenAISectionError(f"{where}: unknown key {key!r}; {hint}the keys are {', '.join(allowed)}")
            error.key_of = (raw, key)  # type: ignore[attr-defined]  # for the loader's line number
            raise error
    return raw


def _inputs(raw: Any) -> dict[str, str]:
    if raw is None:
        raise OpenAISectionError("openai.inputs: missing; e.g. `inputs: {prompt: last_user_message}`")
    if not isinstance(raw, dict) or not raw:
        raise OpenAISectionError(
            f"openai.inputs: must map input names to sources ({', '.join(SOURCES)}), got {raw!r}"
        )
    for name, source in raw.items():
        if not isinstance(name, str) or source not in SOURCES:
            close = difflib.get_close_matches(str(source), SOURCES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise OpenAISectionError(
                f"openai.inputs.{name}: unknown source {source!r}; {hint}the sources are {', '.join(SOURCES)}"
            )
    return dict(raw)


def _output(raw: Any, key: str, topology: Topology) -> OutputRef | None:
    if raw is None:
        return None
    where = f"openai.{key}"
    section = _mapping(raw, where, _OUTPUT_KEYS)
    return OutputRef(stage=_final_stage(section, where, topology), field=_field(section, "field", where))


def _audio(raw: Any, topology: Topology) -> AudioRef | None:
    if raw is None:
        return None
    where = "openai.audio_output"
    section = _mapping(raw, where, _AUDIO_KEYS)
    encoding = section.get("encoding", "pcm16")
    if encoding not in ENCODINGS:
        raise OpenAISectionError(f"{where}.encoding: {encoding!r} is not one of {', '.join(ENCODINGS)}")
    rate = section.get("sample_rate")
    rate_field = _field(section, "sample_rate_field", where) if "sample_rate_field" in section else None
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or rate < 1):
        raise OpenAISectionError(f"{where}.sample_rate: must be a positive integer (Hz), got {rate!r}")
    if encoding != "wav" and (rate is None) == (rate_field is None):
        raise OpenAISectionError(
            f"{where}: {encoding} audio needs its rate: set exactly one of sample_rate (Hz) and sample_rate_field"
        )
    return AudioRef(
        stage=_final_stage(section, where, topology),
        field=_field(section, "field", where),
        encoding=encoding,
        sample_rate=rate,
        sample_rate_field=rate_field,
    )


def _field(section: dict, key: str, where: str) -> str:
    value = section.get(key)
    if not isinstance(value, str) or not value:
        raise OpenAISectionError(f"{where}.{key}: must name a field of the stage's output, got {value!r}")
    return value


def _final_stage(section: dict, where: str, topology: Topology) -> str:
    """The name of the stage `section` names: it must be a final stage, whose outputs reach the coordinator."""
    if "stage" not in section:
        raise OpenAISectionError(f"{where}.stage: missing; name the final stage whose output holds the field")
    stage = topology.stage(section["stage"])  # TopologyError naming the stages when there is no such one
    finals = [s.name for s in topology.final_stages]
    if stage.name not in finals:
        raise OpenAISectionError(
            f"{where}.stage: stage {stage.name!r} is not a final stage, and only final stages' outputs reach "
            f"the coordinator; final stages: {', '.join(finals)}"
        )
    return stage.name
