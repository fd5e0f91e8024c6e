"""The topology file as typed models: the keys each section knows, with vllm-omni's aliases, and the
JSON Schema `omni-mesh schema` prints for editors.

The models say which keys exist and what they hold; `parse` still checks what ties them together
(stage ids, edges, connectors). A stage keeps keys it does not know (its handler's options,
vllm-omni's engine extras), but a key close to a known one is a misspelling: `near_miss` is the
rule, for `validate` and, as `propertyNames`, for the schema.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SkipValidation,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic_core import PydanticCustomError

from omni_mesh.topology.autoscale import AutoscaleSection
from omni_mesh.topology.model import TopologyError
from omni_mesh.topology.openai_spec import ENCODINGS, SOURCES
from omni_mesh.topology.validation import expect, misspelled, one_of, spelling_message

#: How close (difflib's ratio) an unknown key must be to a known one to be taken as its misspelling.
CUTOFF = 0.85

StageRef = Annotated[
    StrictInt | StrictStr,
    Field(description="a stage id, or (in edges:) a stage name"),
    expect("must be a stage id or name"),
]
#: The keys of input_connectors and output_connectors (the group: the other stage's id).
FROM_KEY = r"^from_stage_(\d+)$"
TO_KEY = r"^to_stage_(\d+)$"
#: Stage names become compose service names, shared-memory name parts and keys of `outputs`.
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
NAME_RULE = "letters, digits, '_', '.' or '-' (starting with a letter or digit)"
HANDLER = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"

Count = Annotated[int, Field(strict=True, ge=1), expect("must be an integer >= 1")]
Queue = Annotated[
    int, Field(strict=True, ge=0), expect("must be an integer >= 0 (0: never queue), or left out")
]
Flag = Annotated[bool, Field(strict=True), expect("must be true or false")]
Text = Annotated[str, Field(strict=True, pattern=r"\S"), expect("must be a non-empty string")]
FieldName = Annotated[
    str, Field(strict=True, min_length=1), expect("must name a field of the stage's output")
]
Name = Annotated[str, Field(strict=True, pattern=NAME), expect(f"must be {NAME_RULE}")]
Handler = Annotated[
    str, Field(strict=True, pattern=HANDLER), expect("must look like 'package.module:function'")
]
FromKey = Annotated[str, Field(pattern=FROM_KEY), expect("must be from_stage_<stage id>, e.g. from_stage_0")]
ToKey = Annotated[str, Field(pattern=TO_KEY), expect("must be to_stage_<stage id>, e.g. to_stage_1")]
ConnectorType = Annotated[
    str, Field(strict=True, min_length=1), expect("must be a connector type such as 'SharedMemoryConnector'")
]


def _digits(value: Any) -> Any:
    """vllm-omni compares stage ids as strings: "1" is stage 1."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


StageId = Annotated[
    int,
    Field(strict=True, ge=0),
    BeforeValidator(
        _digits, json_schema_input_type=Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=r"^\d+$")]
    ),
    expect("must be a non-negative integer"),
]


class _Closed(BaseModel):
    """A section whose keys are all known."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, defer_build=True)


class _Open(BaseModel):
    """A section that also holds keys read by others (vllm-omni, a handler), minus misspellings."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, defer_build=True)
    #: The keys a key of the section must not be a near miss of (None: the model's own), and what the
    #: section's other keys are, for the error.
    spelled_as: ClassVar[frozenset[str] | None] = None
    rule: ClassVar[str] = "other keys are vllm-omni's, ignored here"

    @model_validator(mode="before")
    @classmethod
    def _spelling(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                meant = near_miss(key, cls.spelled_as or known_keys(cls))
                if meant is not None:
                    raise misspelled(key, meant, cls.rule)
        return data


class ConnectorEntry(_Closed):
    name: ConnectorType = Field(description="the connector type, e.g. SharedMemoryConnector")
    extra: Annotated[dict[str, Any], expect("must be a mapping")] | None = Field(
        None, description="the type's settings (docs/connectors.md)"
    )


ConnectorRef = Annotated[
    str | ConnectorEntry, Field(description="a key under connectors:, or an inline {name, extra}")
]
#: Read where an edge names it (parse._resolve_connector), with the edge in the error.
LazyConnectorRef = SkipValidation[ConnectorRef | None]


class EdgeEntry(_Closed):
    # Both required in omni-mesh's layout; vllm-omni's loader skips an entry without them (a warning here).
    src: StageRef | None = Field(None, alias="from")
    dst: StageRef | None = Field(None, alias="to")
    connector: LazyConnectorRef = None
    window_size: Any = Field(None, description="vllm-omni's scheduler setting; ignored here")
    max_inflight: Any = Field(None, description="vllm-omni's scheduler setting; ignored here")


class Defaults(_Open):
    replicas: Count | None = None
    max_inflight: Count | None = None
    autoscale: AutoscaleSection | None = None


class StageOwnKeys(_Open):
    """The stage keys the topology interprets; the others are kept in StageSpec.options."""

    rule: ClassVar[str] = "other keys go to the stage's handler as options"

    stage_id: StageId
    name: Name | None = None
    handler: Handler | None = None
    engine: dict[str, Any] | None = Field(None, description="a model part to run (docs/engines.md)")
    replicas: Count | None = None
    max_inflight: Count | None = None
    max_queued: Queue | None = None
    autoscale: AutoscaleSection | None = Field(None, description="replicas follow the load (docs/topology.md)")
    final_output: Flag | None = None
    engine_input_source: list[StageRef] | None = None
    input_connectors: dict[FromKey, LazyConnectorRef] | None = None
    output_connectors: dict[ToKey, LazyConnectorRef] | None = None


class Stage(StageOwnKeys):
    """One entry of stages: (stage_args: in vllm-omni's files)."""

    resources: dict[str, Any] | None = Field(
        None, description="cpu, memory, gpus, gpu_type (omni-mesh export)"
    )
    # vllm-omni's stage configs (stage_args:)
    stage_type: str | None = None
    runtime: dict[str, Any] | None = None
    engine_args: dict[str, Any] | None = Field(None, description="vllm-omni's engine settings, kept verbatim")
    final_output_type: str | None = None
    is_comprehension: bool | None = None
    default_sampling_params: dict[str, Any] | None = None
    custom_process_input_func: str | None = None
    custom_process_next_stage_input_func: str | None = None
    async_chunk_process_next_stage_input_func: str | None = None
    engine_output_type: str | None = None
    model_stage: str | None = None
    model_arch: str | None = None
    # vllm-omni's deploy files (StageDeployConfig)
    devices: str | int | list[Any] | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    enforce_eager: bool | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    async_scheduling: bool | None = None
    num_replicas: int | None = None
    model_runner: str | None = None
    attention_backend: str | None = None
    moe_backend: str | None = None
    linear_backend: str | None = None
    diffusion_attention_config: dict[str, Any] | None = None
    diffusion_attention_backend: str | None = None
    numa_bind: bool | None = None
    numa_bind_nodes: list[Any] | None = None
    numa_bind_cpus: list[Any] | None = None
    additional_config: dict[str, Any] | None = None
    engine_extras: dict[str, Any] | None = None


class Runtime(_Open):
    """`runtime:`, where vllm-omni's stage configs put connectors:, edges: and defaults:."""

    connectors: dict[str, ConnectorEntry] | None = None
    edges: list[EdgeEntry] | None = None
    defaults: Defaults | None = None
    auto_shm: bool | None = None
    enabled: bool | None = None


class OutputRefModel(_Closed):
    stage: StageRef = Field(description="a final stage, by name or id")
    field: FieldName = Field(description="the field of the stage's output")


class AudioRefModel(OutputRefModel):
    encoding: Annotated[Literal[ENCODINGS], one_of(ENCODINGS)] = "pcm16"  # type: ignore[valid-type]
    sample_rate: (
        Annotated[int, Field(strict=True, ge=1), expect("must be a positive integer (Hz)")] | None
    ) = None
    sample_rate_field: FieldName | None = None

    @model_validator(mode="after")
    def _rate(self) -> AudioRefModel:
        if self.encoding != "wav" and (self.sample_rate is None) == (self.sample_rate_field is None):
            raise PydanticCustomError(
                "audio_rate",
                "{encoding} audio needs its rate: set exactly one of sample_rate (Hz) and sample_rate_field",
                {"encoding": self.encoding},
            )
        return self


class OpenAISection(_Closed):
    """The `openai:` section (omni_mesh.topology.openai_spec)."""

    model: Text | None = None
    inputs: dict[
        Annotated[str, Field(strict=True)], Annotated[Literal[SOURCES], one_of(SOURCES)]  # type: ignore[valid-type]
    ] = Field(min_length=1, description="input name -> source, e.g. `inputs: {prompt: last_user_message}`")
    text_output: OutputRefModel | None = None
    audio_output: AudioRefModel | None = None
    usage_output: OutputRefModel | None = None

    @model_validator(mode="after")
    def _an_output(self) -> OpenAISection:
        if self.text_output is None and self.audio_output is None:
            raise PydanticCustomError(
                "no_output",
                "names neither text_output nor audio_output; add e.g. `text_output: {stage: <final stage>, field: text}`",
            )
        return self


class TopologyFile(_Open):
    """A topology file: ours (stages:) or vllm-omni's stage config (stage_args:) or deploy file."""

    name: str | None = Field(None, min_length=1)
    stages: list[Stage] | None = None
    stage_args: list[Stage] | None = None
    connectors: dict[str, ConnectorEntry] | None = None
    edges: list[EdgeEntry] | None = None
    defaults: Defaults | None = None
    runtime: Runtime | None = None
    auto_shm: bool | None = None
    openai: OpenAISection | None = None
    # vllm-omni's
    modes: list[Any] | None = None
    async_chunk: bool | None = None
    pipeline: str | None = None
    base_config: str | None = None
    platforms: dict[str, Any] | None = None
    session_mode: str | None = None


def known_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys a file writes for `model` (aliases where a field has one)."""
    return frozenset(field.alias or name for name, field in model.model_fields.items())


STAGE_KEYS = known_keys(Stage)
StageOwnKeys.spelled_as = STAGE_KEYS  # a near miss of any stage key, vllm-omni's included, is a misspelling
CONNECTOR_KEYS = known_keys(ConnectorEntry)


def near_miss(key: object, known: Iterable[str]) -> str | None:
    """The known key `key` is a misspelling of, or None (a key of its own, or an exact one)."""
    if not isinstance(key, str) or key in known:
        return None
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=CUTOFF)
    return close[0] if close else None


def check_spelling(section: dict, known: frozenset[str], where: str, rule: str) -> None:
    """TopologyError for the first key of `section` that is a misspelling of a `known` one (schema.near_miss)."""
    for key in section:
        meant = near_miss(key, known)
        if meant is not None:
            raise TopologyError(spelling_message(where, key, meant, rule), key_of=(section, key))


def _typos(known: frozenset[str]) -> list[str]:
    """The one-slip misspellings of `known` (a letter dropped, or swapped with the next) that `near_miss`
    refuses: the schema lists them, as it cannot run difflib (`validate` catches the rest)."""
    found = set()
    for key in known:
        for i in range(len(key)):
            found.add(key[:i] + key[i + 1 :])
            if i + 1 < len(key):
                found.add(key[:i] + key[i + 1] + key[i] + key[i + 2 :])
    return sorted(typo for typo in found if near_miss(typo, known) is not None)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a topology file, with the keys users write (`from`, not `src`)."""
    schema = TopologyFile.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "omni-mesh topology"
    for name, model in (("TopologyFile", TopologyFile), ("Stage", Stage), ("Runtime", Runtime)):
        target = schema if name == "TopologyFile" else schema["$defs"][name]
        target["propertyNames"] = {"not": {"enum": _typos(known_keys(model))}}
    schema["$defs"]["Stage"]["properties"]["engine"] = _engine_schema()
    _add_connector_extras(schema)
    return schema


def _engine_schema() -> dict[str, Any]:
    """A stage's `engine:` mapping, from EngineSpec's fields (parse_engine checks the same)."""
    from omni_mesh.engines.settings import ARCHS, DTYPES, PART_ALIASES, PARTS, EngineSpec

    kinds = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}
    properties: dict[str, Any] = {}
    for field in dataclasses.fields(EngineSpec):
        types = [kinds[name] for name in kinds if name in str(field.type).split(" | ")]
        types += ["null"] if "None" in str(field.type) else []
        properties[field.name] = {"type": types[0] if len(types) == 1 else types}
        if field.default is not dataclasses.MISSING:
            properties[field.name]["default"] = field.default
    properties["part"] = {"enum": [*PARTS, *PART_ALIASES]}
    properties["model_stage"] = {**properties["part"], "description": "vllm-omni's name for part"}
    properties["arch"] = {"enum": [*ARCHS, None], "default": None}
    properties["dtype"] = {"enum": list(DTYPES), "default": "auto"}
    strings = {"type": "array", "items": {"type": "string", "minLength": 1}}
    properties["stop"] = {"anyOf": [{"type": "string", "minLength": 1}, strings], "default": []}
    properties["stop_token_ids"] = {"type": "array", "items": {"type": "integer", "minimum": 0}, "default": []}
    return {
        "anyOf": [
            {"type": "object", "properties": properties, "additionalProperties": False},
            {"type": "null"},
        ],
        "description": "a model part to run instead of a handler (docs/engines.md)",
    }


def _add_connector_extras(schema: dict[str, Any]) -> None:
    """Each built-in connector type's `extra:` keys, chosen by the entry's name (third-party types,
    registered at run time, keep a free-form extra)."""
    from omni_mesh.connectors import available_connectors, connector_type
    from omni_mesh.connectors.config.schema import extra_schema

    entry = schema["$defs"]["ConnectorEntry"]
    names = []
    for name in available_connectors():
        try:
            kind = connector_type(name)
        except (ValueError, ImportError):
            continue  # a third-party type that does not load here
        if kind.cls is not None or kind.config_class is None:
            continue
        names.append(name)
        ref = f"{kind.name}Extra"  # vllm-omni's names of a type (MooncakeConnector) share its schema
        schema["$defs"].setdefault(ref, extra_schema(kind.name, kind.config_class))
        entry.setdefault("allOf", []).append(
            {
                "if": {"properties": {"name": {"const": name}}, "required": ["name"]},
                "then": {"properties": {"extra": {"anyOf": [{"$ref": f"#/$defs/{ref}"}, {"type": "null"}]}}},
            }
        )
    entry["properties"]["name"]["examples"] = names
