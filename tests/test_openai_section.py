"""The topology's optional `openai:` section: parsed, kept, and refused with a message naming the key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from omni_mesh.topology import TopologyError, load_topology, parse_topology
from omni_mesh.topology.openai_spec import AudioRef, OutputRef

DEMO = Path(__file__).resolve().parents[1] / "compose" / "omni-demo.yaml"


def chain(openai: Any) -> dict:
    """thinker -> talker -> code2wav, code2wav final, with `openai` as its section."""
    stages = [
        {"stage_id": 0, "name": "thinker"},
        {"stage_id": 1, "name": "talker", "engine_input_source": [0]},
        {"stage_id": 2, "name": "code2wav", "engine_input_source": [1]},
    ]
    return {"name": "chain", "stages": stages, "openai": openai}


MINIMAL = {"inputs": {"prompt": "last_user_message"}, "text_output": {"stage": "code2wav", "field": "text"}}


def test_the_demo_section_is_parsed_and_kept() -> None:
    spec = load_topology(DEMO).openai
    assert spec is not None and spec.model == "qwen-omni-demo"
    assert spec.inputs == {"prompt": "last_user_message"}
    assert spec.text_output == OutputRef("code2wav", "text")
    assert spec.audio_output == AudioRef("code2wav", "audio_pcm16", "pcm16", None, "sample_rate")
    assert spec.usage_output == OutputRef("code2wav", "usage")


def test_no_section_is_none_and_the_model_defaults_to_the_topology_name() -> None:
    assert parse_topology({"stages": [{"stage_id": 0}]}).openai is None
    spec = parse_topology(chain({**MINIMAL, "text_output": {"stage": 2, "field": "text"}})).openai
    assert spec is not None and spec.model == "chain" and spec.text_output == OutputRef("code2wav", "text")
    assert spec.audio_output is None and spec.usage_output is None


def test_wav_audio_needs_no_rate() -> None:
    audio = {"stage": "code2wav", "field": "wav", "encoding": "wav"}
    spec = parse_topology(chain({**MINIMAL, "audio_output": audio})).openai
    assert spec is not None and spec.audio_output == AudioRef("code2wav", "wav", "wav")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("yes", "openai: must be a mapping, got str"),
        ({**MINIMAL, "modle": "x"}, "openai: unknown key 'modle'; did you mean 'model'?"),
        ({**MINIMAL, "model": ""}, "openai.model: must be a non-empty string"),
        ({"text_output": MINIMAL["text_output"]}, "openai.inputs: missing; input name -> source, e.g. `inputs: {prompt: last_user_message}`"),
        ({**MINIMAL, "inputs": {"prompt": "last_user_mesage"}}, "did you mean 'last_user_message'?"),
        ({"inputs": MINIMAL["inputs"]}, "names neither text_output nor audio_output"),
        ({**MINIMAL, "text_output": {"stage": "thinker", "field": "text"}},
         "openai.text_output.stage: stage 'thinker' is not a final stage"),
        ({**MINIMAL, "text_output": {"stage": "voice", "field": "text"}}, "has no stage 'voice'"),
        ({**MINIMAL, "text_output": {"field": "text"}}, "openai.text_output.stage: missing"),
        ({**MINIMAL, "text_output": {"stage": "code2wav"}}, "openai.text_output.field: missing; it must name a field"),
        ({**MINIMAL, "text_output": {"stage": "code2wav", "field": ""}}, "openai.text_output.field: must name a field"),
        ({**MINIMAL, "usage_output": {"stage": "code2wav", "field": "usage", "sum": True}},
         "openai.usage_output: unknown key 'sum'"),
        ({**MINIMAL, "audio_output": {"stage": "code2wav", "field": "a"}},
         "pcm16 audio needs its rate: set exactly one of sample_rate (Hz) and sample_rate_field"),
        ({**MINIMAL, "audio_output": {"stage": "code2wav", "field": "a", "encoding": "mp3"}},
         "openai.audio_output.encoding: 'mp3' is not one of pcm16, float, wav"),
        ({**MINIMAL, "audio_output": {"stage": "code2wav", "field": "a", "encoding": "float", "sample_rate": 0}},
         "openai.audio_output.sample_rate: must be a positive integer"),
    ],
)
def test_mistakes_are_refused_naming_the_key(section: Any, message: str) -> None:
    with pytest.raises(TopologyError, match="^<topology>: .*" + re.escape(message)):
        parse_topology(chain(section))
