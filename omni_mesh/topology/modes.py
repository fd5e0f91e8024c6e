"""vllm-omni's `modes:` section: which of a stage config's stages one deployment runs.

vllm-omni (`filter_stages` in vllm_omni/entrypoints/utils.py) keeps only the stages of one mode,
chosen by the `mode=` argument of its entry point, `text-to-image` when none is given; a mode the
file does not list, or one whose stage ids match no stage, runs every stage. It skips entries
without `mode` and `stages`. omni-mesh has no mode argument: it runs every stage, so the section is
reported, never silently dropped.
"""

from __future__ import annotations

from typing import Any

from omni_mesh.topology.model import StageSpec, describe_stage

#: The mode vllm-omni runs when its caller names none.
DEFAULT_MODE = "text-to-image"


def modes_warning(modes: Any, stages: dict[int, StageSpec]) -> str | None:
    """What `modes:` means in vllm-omni and that omni-mesh runs every stage; None without the section."""
    if modes is None:
        return None
    listed = _modes(modes)
    if not listed:
        return f"modes: {modes!r} lists no {{mode: <name>, stages: [<id>, ...]}} entry; ignored, as vllm-omni ignores it"
    described = "; ".join(f"{name}: {_describe_ids(ids, stages)}" for name, ids in listed.items())
    default = listed.get(DEFAULT_MODE)
    runs = [sid for sid in default or () if sid in stages]
    vllm_runs = (
        f"by default ({DEFAULT_MODE!r}) only {', '.join(describe_stage(stages[sid]) for sid in runs)}"
        if runs
        else "by default every stage (no mode matches its default, 'text-to-image')"
    )
    return (
        f"modes: ({described}): vllm-omni runs one mode's stages per deployment, chosen by its mode= argument, "
        f"{vllm_runs}; omni-mesh has no modes and runs all {len(stages)} stages, each entry stage taking every "
        "request: to run one mode alone, keep only its stages in a copy of this file"
    )


def _modes(modes: Any) -> dict[str, list[Any]]:
    """{mode: stage ids} as vllm-omni reads the section (entries without mode and stages skipped)."""
    found: dict[str, list[Any]] = {}
    for entry in modes if isinstance(modes, list) else ():
        if not isinstance(entry, dict) or entry.get("mode") is None or entry.get("stages") is None:
            continue
        ids = entry["stages"]
        found[str(entry["mode"])] = [ids] if not isinstance(ids, list) else list(ids)
    return {name: [_stage_id(sid) for sid in ids] for name, ids in found.items()}


def _stage_id(value: Any) -> Any:
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _describe_ids(ids: list[Any], stages: dict[int, StageSpec]) -> str:
    named = [
        describe_stage(stages[sid]) if sid in stages else f"stage {sid!r} (not in the file)" for sid in ids
    ]
    return ", ".join(named) or "no stage"
