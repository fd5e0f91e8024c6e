"""One stage or connector entry of a topology file, read and checked on its own."""

from __future__ import annotations

import re
from typing import Any

from omni_mesh.connectors import available_connectors, connector_type
from omni_mesh.connectors.config.values import read_extra
from omni_mesh.engines.settings import DTYPES, PART_ALIASES, PARTS, parse_engine
from omni_mesh.topology.autoscale import read_autoscale
from omni_mesh.topology.model import AUTO_CONNECTOR, ConnectorSpec, StageSpec, TopologyError
from omni_mesh.topology.schema import (
    CONNECTOR_KEYS,
    HANDLER,
    NAME,
    STAGE_KEYS,
    StageOwnKeys,
    check_spelling,
    known_keys,
    near_miss,
)

_OWN_STAGE_KEYS = known_keys(StageOwnKeys)
_NAME = re.compile(NAME)
_HANDLER = re.compile(HANDLER)


def parse_stage(entry: Any, index: int, defaults: dict[str, Any]) -> StageSpec:
    if not isinstance(entry, dict):
        raise TopologyError(f"stage #{index}: a stage is a mapping with a stage_id, got {entry!r}")
    if "stage_id" not in entry:
        raise TopologyError(f"stage #{index} has no stage_id; give every stage an integer stage_id")
    sid = entry["stage_id"]
    if isinstance(sid, str) and sid.isdigit():  # vllm-omni compares stage ids as strings: "1" is 1
        sid = int(sid)
    if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
        raise TopologyError(f"stage #{index}: stage_id must be a non-negative integer, got {sid!r}")
    name = entry.get("name", f"stage_{sid}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise TopologyError(
            f"stage {sid}: name must be letters, digits, '_', '.' or '-' (starting with a letter or digit), "
            f"got {name!r}"
        )
    who = f"stage {sid} {name!r}"
    check_spelling(entry, STAGE_KEYS, who, "other keys go to the stage's handler as options")
    handler = entry.get("handler")
    if handler is not None and (not isinstance(handler, str) or not _HANDLER.match(handler)):
        raise TopologyError(f"{who}: handler must look like 'package.module:function', got {handler!r}")
    engine = _engine(entry, who)
    if engine is not None and handler is not None and "engine" in entry:
        raise TopologyError(f"{who}: set handler: or engine:, not both (engine: runs a model part as the handler)")
    if handler is not None:
        engine = None  # a handler given with vllm-omni's engine_args runs the handler
    final_output = entry.get("final_output", False)
    if not isinstance(final_output, bool):
        raise TopologyError(f"{who}: final_output must be true or false, got {final_output!r}")
    replicas = entry["replicas"] if "replicas" in entry else defaults.get("replicas")
    replicas = None if "replicas" not in entry and replicas is None else positive_int(replicas, f"{who}: replicas")
    autoscale, replicas = read_autoscale(
        entry.get("autoscale"), defaults.get("autoscale"), replicas, who, max_queued=entry.get("max_queued")
    )
    return StageSpec(
        stage_id=sid,
        name=name,
        handler=handler,
        replicas=replicas or 1,
        autoscale=autoscale,
        max_inflight=positive_int(
            entry.get("max_inflight", defaults.get("max_inflight", 8)), f"{who}: max_inflight"
        ),
        max_queued=_optional_count(entry.get("max_queued"), f"{who}: max_queued"),
        final_output=final_output,
        options={key: value for key, value in entry.items() if key not in _OWN_STAGE_KEYS},
        engine=engine,
    )


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
        raw.update(_sampling_defaults(entry.get("default_sampling_params"), PART_ALIASES.get(stage, stage)))
    try:
        spec = parse_engine(raw, who)
    except ValueError as exc:
        raise TopologyError(str(exc)) from None
    return dict(vars(spec))


def _sampling_defaults(params: Any, part: str) -> dict:
    """vllm-omni's `default_sampling_params` as engine defaults: temperature, top_p, and max_tokens (the
    talker's counts codes). Others (seed, stop ids, ...) have no engine default here and are left out."""
    if not isinstance(params, dict):
        return {}
    out = {key: params[key] for key in ("temperature", "top_p") if key in params}
    if "max_tokens" in params:
        out["max_audio_tokens" if part == "talker" else "max_tokens"] = params["max_tokens"]
    return out if part != "code2wav" else {}


def parse_connector_entry(entry: Any, ref: str, who: str, *, unknown_keys_ok: bool = False) -> ConnectorSpec:
    """One connector; `extra` with variables expanded and numeric strings read as vllm-omni reads them."""
    if not isinstance(entry, dict):
        raise TopologyError(
            f"{who}: a connector is a mapping {{name: <type>, extra: {{...}}}}, got {entry!r}"
        )
    if "name" not in entry:
        raise TopologyError(
            f"{who} has no name: key; set it to a connector type ({', '.join(available_connectors())})"
        )
    name = entry["name"]
    if not isinstance(name, str) or not name:
        raise TopologyError(f"{who}: name must be a connector type such as {AUTO_CONNECTOR!r}, got {name!r}")
    unknown = sorted(set(entry) - CONNECTOR_KEYS, key=str)
    if unknown and not unknown_keys_ok:
        meant = near_miss(unknown[0], CONNECTOR_KEYS)
        hint = f"; did you mean {meant!r}?" if meant else ""
        raise TopologyError(
            f"{who}: unknown key {unknown[0]!r}{hint} (a connector has name: and extra:)", key_of=(entry, unknown[0])
        )
    extra = entry.get("extra") or {}
    if not isinstance(extra, dict):
        raise TopologyError(f"{who}: extra must be a mapping, got {extra!r}")
    extra = read_extra(extra, _config_class_of(name))
    return ConnectorSpec(ref=ref, name=name, extra=extra, auto=False)


def _config_class_of(connector_name: str) -> Any:
    """The config dataclass of a connector type (None for a type that does not load)."""
    try:
        return connector_type(connector_name).config_class
    except (ValueError, ImportError):
        return None  # reported with the edges that use it


def positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def _optional_count(value: Any, what: str) -> int | None:
    """An optional integer >= 0 (null or absent: the default applies)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TopologyError(
            f"{what} must be an integer >= 0 (0: never queue), got {value!r}; or leave it out"
        )
    return value
