"""The stage graphs of the pipelines vllm-omni ships, as data.

vllm-omni's newer deploy files (`vllm_omni/deploy/*.yaml`) keep only per-stage settings; the graph
(which stage feeds which, which stages are final) lives in vllm-omni's code, one `PipelineConfig`
per pipeline, registered under the model's `model_type`. vllm-omni picks the pipeline from the
model's HF config, or from the deploy file's `pipeline:` key, or, for a model whose config names no
type, by matching the model's name against the registered keys (the longest match wins).
omni-mesh has no model at hand, so it matches the file's `pipeline:`, its `model:` or its name.

Each graph below restates one of vllm-omni's pipelines: stage ids, vllm-omni's `model_stage` as the
stage name, `input_sources` as inputs and `final_output`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PIPELINES", "GraphStage", "PipelineGraph", "match_pipeline"]


@dataclass(frozen=True)
class GraphStage:
    stage_id: int
    name: str
    inputs: tuple[int, ...] = ()
    final: bool = False


@dataclass(frozen=True)
class PipelineGraph:
    key: str  # vllm-omni's pipeline registry key (the model_type)
    title: str
    stages: tuple[GraphStage, ...]

    @property
    def edges(self) -> list[tuple[int, int]]:
        return [(src, stage.stage_id) for stage in self.stages for src in stage.inputs]

    def describe_edges(self) -> str:
        return ", ".join(f"{src}->{dst}" for src, dst in self.edges) or "none"

    def describe_stages(self) -> str:
        return ", ".join(f"{stage.stage_id} {stage.name!r}" for stage in self.stages)


# Thinker (text, final) -> Talker -> Code2Wav (audio, final): Qwen2.5-Omni and Qwen3-Omni alike.
_THINKER_TALKER_CODE2WAV = (
    GraphStage(0, "thinker", final=True),
    GraphStage(1, "talker", inputs=(0,)),
    GraphStage(2, "code2wav", inputs=(1,), final=True),
)
_THINKER_ONLY = (GraphStage(0, "thinker", final=True),)

_GRAPHS = (
    PipelineGraph("qwen2_5_omni", "Qwen2.5-Omni", _THINKER_TALKER_CODE2WAV),
    PipelineGraph("qwen2_5_omni_thinker_only", "Qwen2.5-Omni, thinker only", _THINKER_ONLY),
    # vllm-omni resolves qwen3_omni_moe to the thinker-only graph when the checkpoint has no audio
    # output (the Captioner); the full graph is its default, and the one used here.
    PipelineGraph("qwen3_omni_moe", "Qwen3-Omni", _THINKER_TALKER_CODE2WAV),
    PipelineGraph("qwen3_omni_moe_duplex", "Qwen3-Omni, duplex sessions", _THINKER_TALKER_CODE2WAV),
    PipelineGraph("qwen3_omni_moe_thinker_only", "Qwen3-Omni, thinker only", _THINKER_ONLY),
    # BAGEL: the thinker's KV cache goes to the DiT, which makes the image (vllm-omni's bagel
    # pipeline.py); its single-stage variant runs everything in one DiT stage.
    PipelineGraph(
        "bagel",
        "BAGEL",
        (GraphStage(0, "thinker", final=True), GraphStage(1, "dit", inputs=(0,), final=True)),
    ),
    PipelineGraph("bagel_single_stage", "BAGEL, single stage", (GraphStage(0, "dit", final=True),)),
    PipelineGraph(
        "qwen3_tts",
        "Qwen3-TTS",
        (GraphStage(0, "qwen3_tts"), GraphStage(1, "code2wav", inputs=(0,), final=True)),
    ),
)

#: Built-in graphs by vllm-omni's pipeline key.
PIPELINES: dict[str, PipelineGraph] = {graph.key: graph for graph in _GRAPHS}


def _squash(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "").replace(".", "")


def match_pipeline(name: str) -> PipelineGraph | None:
    """The graph whose key occurs in `name` (a model or file name), as vllm-omni matches names: case,
    '-' and '_' ignored, only the last path component, the longest key wins. Dots are ignored too,
    so that a model name such as Qwen/Qwen2.5-Omni-7B finds qwen2_5_omni."""
    wanted = _squash(name.rstrip("/").rsplit("/", 1)[-1])
    found = [graph for graph in _GRAPHS if _squash(graph.key) in wanted]
    return max(found, key=lambda graph: len(_squash(graph.key)), default=None)
