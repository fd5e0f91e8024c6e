"""One stage or connector entry of a topology file, read and checked on its own."""

from __future__ import annotations

import re
from typing import Any

from omni_mesh.connectors import connector_type
from omni_mesh.connectors.config.values import read_extra
from omni_mesh.engines.kv_budget import rows_within_budget
from omni_mesh.engines.settings import DTYPES, PART_ALIASES, PARTS, parse_engine
from omni_mesh.topology.autoscale import read_autoscale
from omni_mesh.topology.model import ConnectorSpec, StageSpec, TopologyError
from omni_mesh.topology.schema import NAME, ConnectorEntry, Defaults, StageOwnKeys, known_keys
from omni_mesh.topology.validation import validated

_OWN_STAGE_KEYS = known_keys(StageOwnKeys)
_NAME = re.compile(NAME)


def parse_stage(entry: Any, index: int, defaults: Defaults) -> StageSpec:
    """One entry of stages:, its values checked by StageOwnKeys; what it leaves out comes from `defaults`."""
    if not isinstance(entry, dict):
        raise TopologyError(f"stage #{index}: a stage is a mapping with a stage_id, got {entry!r}")
    own = validated(StageOwnKeys, entry, _who(entry, index))
    sid, name = own.stage_id, own.name or f"stage_{own.stage_id}"
    who = f"stage {sid} {name!r}"
    engine = _engine(entry, who)
    replicas = own.replicas or defaults.replicas
    autoscale, replicas = read_autoscale(
        own.autoscale, defaults.autoscale, replicas, who, max_queued=own.max_queued
    )
    if engine is not None and own.handler is not None and own.engine is not None:
        raise TopologyError(
            f"{who}: set handler: or engine:, not both (engine: runs a model part as the handler)"
        )
    return StageSpec(
        stage_id=sid,
        name=name,
        handler=own.handler,
        replicas=replicas or 1,
        autoscale=autoscale,
        max_inflight=own.max_inflight or defaults.max_inflight or _inflight(engine),
        max_queued=own.max_queued,
        final_output=bool(own.final_output),
        options={key: value for key, value in entry.items() if key not in _OWN_STAGE_KEYS},
        # a handler given with vllm-omni's engine_args runs the handler
        engine=engine if own.handler is None else None,
    )


def _inflight(engine: dict | None) -> int:
    """A replica's max_inflight where none is set: 8, or for a batching engine a full batch running and
    as many ready to join it (no hop to wait for when a row leaves); with a KV budget in tokens, the rows
    it holds and as many waiting in the replica's queue (omni_mesh.engines.kv_budget): more wait in the
    coordinator's queue (max_queued), and beyond it get 429."""
    if engine is None:
        return 8
    if engine.get("kv_cache_tokens") is not None:
        return 2 * rows_within_budget(engine)
    return max(8, 2 * engine["max_batch"])


def _who(entry: dict, index: int) -> str:
    """The stage as errors name it: by id and name, by id while its name is wrong, by position while its
    id is."""
    sid = entry.get("stage_id")
    sid = int(sid) if isinstance(sid, str) and sid.isdigit() else sid
    if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
        return f"stage #{index}"
    name = entry.get("name", f"stage_{sid}")
    return f"stage {sid} {name!r}" if isinstance(name, str) and _NAME.match(name) else f"stage {sid}"


def _engine(entry: dict, who: str) -> dict | None:
    """The stage's checked `engine:` settings; from vllm-omni's `engine_args.model_stage` (and `model`,
    `dtype`) when the stage has neither engine: nor handler:; None when it names no model part."""
    raw = entry.get("engine")
    if raw is None:
        args = entry.get("engine_args")
        stage = args.get("model_stage") if isinstance(args, dict) else None
        if PART_ALIASES.get(stage, stage) not in PARTS:
            return None
        raw = {"part": stage, "model": args.get("model") or "${OMNI_MESH_MODEL}"}
        if args.get("dtype") in DTYPES:
            raw["dtype"] = args["dtype"]
        if args.get("max_model_len") is not None and PART_ALIASES.get(stage, stage) == "thinker":
            raw["max_model_len"] = args["max_model_len"]
        raw.update(_sampling_defaults(entry.get("default_sampling_params"), PART_ALIASES.get(stage, stage)))
        raw.update({ours: args[theirs] for theirs, ours in _VLLM_ENGINE_KEYS.items() if args.get(theirs) is not None})
    if isinstance(raw, dict):  # a vllm-omni deploy file's stage-level keys
        raw = {**{ours: entry[theirs] for theirs, ours in _VLLM_ENGINE_KEYS.items() if entry.get(theirs) is not None},
               **raw}
    try:
        spec = parse_engine(raw, who)
    except ValueError as exc:
        raise TopologyError(str(exc)) from None
    return {key: list(value) if isinstance(value, tuple) else value for key, value in vars(spec).items()}


#: vLLM's engine settings that mean the same here, by our name: the running batch's size, the KV cache's
#: budget in bytes, and the tokens one step takes (our prefill's piece: decode steps take one per row).
_VLLM_ENGINE_KEYS = {
    "max_num_seqs": "max_batch",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "max_num_batched_tokens": "prefill_tokens",
}


def _sampling_defaults(params: Any, part: str) -> dict:
    """vllm-omni's `default_sampling_params` as engine defaults: the thinker takes vLLM's sampling
    (temperature, top_p, top_k, penalties, stop, stop_token_ids, seed, max_tokens), the talker
    temperature, top_p and max_tokens (its codes); what a part does not take is warned about
    (topology.no_effect)."""
    if not isinstance(params, dict):
        return {}
    from omni_mesh.topology.no_effect import SAMPLING_TAKEN

    out = {key: params[key] for key in SAMPLING_TAKEN.get(part, ()) if key in params and key != "max_tokens"}
    if "max_tokens" in params and part != "code2wav":
        out["max_audio_tokens" if part == "talker" else "max_tokens"] = params["max_tokens"]
    return out


def parse_connector_entry(entry: Any, ref: str, who: str, *, unknown_keys_ok: bool = False) -> ConnectorSpec:
    """One connector; `extra` with variables expanded and numeric strings read as vllm-omni reads them.
    `unknown_keys_ok`: keys other than name and extra are left out (vllm-omni's loader reads only those)."""
    if not isinstance(entry, dict):
        raise TopologyError(
            f"{who}: a connector is a mapping {{name: <type>, extra: {{...}}}}, got {entry!r}"
        )
    if unknown_keys_ok:
        entry = {key: value for key, value in entry.items() if key in known_keys(ConnectorEntry)}
    spec = validated(ConnectorEntry, entry, who)
    extra = read_extra(spec.extra or {}, _config_class_of(spec.name))
    return ConnectorSpec(ref=ref, name=spec.name, extra=extra, auto=False)


def _config_class_of(connector_name: str) -> Any:
    """The config dataclass of a connector type (None for a type that does not load)."""
    try:
        return connector_type(connector_name).config_class
    except (ValueError, ImportError):
        return None  # reported with the edges that use it
