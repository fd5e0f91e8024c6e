"""The settings of a vllm-omni stage entry that mean nothing here (GPU placement and memory, vLLM's
workers and schedulers, sampling a part does not do): `validate` and `up` warn naming them, so a user
does not believe they took effect.

Only stages that run an engine are looked at: a handler gets the stage's other keys as its options,
and may read them, and a stage with neither runs nothing anyway (`validate` says so).
"""

from __future__ import annotations

from omni_mesh.engines.settings import SAMPLING_CHECKS
from omni_mesh.topology.model import StageSpec

#: default_sampling_params an engine takes as its defaults, by part (the talker's max_tokens counts codes).
SAMPLING_TAKEN = {
    "thinker": frozenset(SAMPLING_CHECKS) - {"max_audio_tokens", "speaker", "logit_bias"},
    "talker": frozenset({"temperature", "top_p", "max_tokens"}),
    "code2wav": frozenset(),
}
#: What a user would expect to act, and does not here: where and how vLLM places, sizes and schedules
#: its engine, and vllm-omni's hooks between stages (a stage's own keys, or under runtime: or engine_args:).
NO_EFFECT = frozenset({
    "devices", "gpu_memory_utilization", "tensor_parallel_size", "pipeline_parallel_size",
    "data_parallel_size", "enforce_eager", "max_batch_size",
    "async_scheduling", "model_runner", "attention_backend", "moe_backend", "linear_backend", "numa_bind",
    "numa_bind_nodes", "numa_bind_cpus", "worker_cls", "scheduler_cls", "enable_prefix_caching", "quantization",
    "custom_process_input_func", "custom_process_next_stage_input_func", "async_chunk_process_next_stage_input_func",
})
#: default_sampling_params that say nothing here (the text is always detokenized).
SAMPLING_MOOT = frozenset({"detokenize"})


def no_effect_warning(entry: dict, stage: StageSpec) -> str | None:
    """One line naming the keys of `entry` that have no effect on `stage`, or None."""
    if stage.engine is None or not isinstance(entry, dict):
        return None
    ignored = [key for key in entry if key in NO_EFFECT and entry[key] is not None]
    for section in ("runtime", "engine_args"):
        values = entry.get(section)
        if isinstance(values, dict) and not (section == "engine_args" and entry.get("engine") is not None):
            ignored += [f"{section}.{key}" for key in values if key in NO_EFFECT]
    sampling = entry.get("default_sampling_params")
    if isinstance(sampling, dict) and entry.get("engine") is None:
        taken = SAMPLING_TAKEN.get(stage.engine["part"], frozenset()) | SAMPLING_MOOT
        ignored += [f"default_sampling_params.{key}" for key in sampling if key not in taken]
    if not ignored:
        return None
    return (
        f"stage {stage.stage_id} {stage.name!r}: vllm-omni settings with no effect here: {', '.join(ignored)} "
        f"(the stage runs on engine.device {stage.engine['device']!r}, one process per replica; docs/vllm-omni.md)"
    )
