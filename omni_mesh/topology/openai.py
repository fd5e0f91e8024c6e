"""The `openai:` section of a topology file read into `omni_mesh.topology.openai_spec`'s specs (the section's
format is described there; its model, schema.OpenAISection, checks each value)."""

from __future__ import annotations

from typing import Any

from omni_mesh.model_graph import AUDIO_OUTPUT
from omni_mesh.model_source import ModelNotFound, expand
from omni_mesh.topology.model import Topology, TopologyError
from omni_mesh.topology.openai_spec import AudioRef, OpenAISpec, OutputRef
from omni_mesh.topology.schema import OpenAISection, OutputRefModel, StageRef
from omni_mesh.topology.validation import validated


def read_openai_section(raw: Any, topology: Topology) -> OpenAISpec | None:
    """The validated `openai:` section of `topology`; without one, engine_openai's (None if not that either)."""
    if raw is None:
        return engine_openai(topology)
    section = validated(OpenAISection, raw, "openai")
    audio = section.audio_output
    return OpenAISpec(
        model=section.model or topology.name,
        inputs=dict(section.inputs),
        text_output=_output(section.text_output, "text_output", topology),
        audio_output=None
        if audio is None
        else AudioRef(
            stage=_final_stage(audio.stage, "audio_output", topology),
            field=audio.field,
            encoding=audio.encoding,
            sample_rate=audio.sample_rate,
            sample_rate_field=audio.sample_rate_field,
        ),
        usage_output=_output(section.usage_output, "usage_output", topology),
    )


def _output(ref: OutputRefModel | None, key: str, topology: Topology) -> OutputRef | None:
    return None if ref is None else OutputRef(stage=_final_stage(ref.stage, key, topology), field=ref.field)


def _final_stage(stage_ref: StageRef, key: str, topology: Topology) -> str:
    """The name of the stage `stage_ref` names: it must be a final stage, whose outputs reach the coordinator."""
    stage = topology.stage(stage_ref)  # TopologyError naming the stages when there is no such one
    finals = [s.name for s in topology.final_stages]
    if stage.name not in finals:
        raise TopologyError(
            f"openai.{key}.stage: stage {stage.name!r} is not a final stage, and only final stages' outputs "
            f"reach the coordinator; final stages: {', '.join(finals)}"
        )
    return stage.name


def engine_openai(topology: Topology) -> OpenAISpec | None:
    """The OpenAI API of a topology without an `openai:` section whose final stages run engines
    (vllm-omni's stage configs are such): named after its model (variables expanded where they are
    set), the chat's messages in, the engine's text, audio (code2wav) and usage out, as `serve` writes
    them (omni_mesh.model_graph). With a final thinker and a final code2wav (vllm-omni's Qwen-Omni
    configs), the code2wav's: it passes the thinker's text and usage on. None for a topology of
    handlers: its outputs are its own."""
    finals = topology.final_stages
    if not finals or any(f.engine is None or f.engine["part"] not in ("thinker", "code2wav") for f in finals):
        return None
    chosen = [f for f in finals if f.engine["part"] == "code2wav"] or finals
    if len(chosen) != 1:
        return None
    engine, stage = chosen[0].engine, chosen[0].name
    try:
        model = expand(engine["model"])
    except ModelNotFound:  # the coordinator may lack the variable the stages get: the topology's name
        model = topology.name
    audio = AudioRef(stage=stage, **AUDIO_OUTPUT) if engine["part"] == "code2wav" else None
    return OpenAISpec(
        model=model, inputs={"messages": "messages"}, text_output=OutputRef(stage, "text"), audio_output=audio,
        usage_output=OutputRef(stage, "usage"),
    )
