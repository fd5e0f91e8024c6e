"""Misspelled keys fail `omni-mesh validate` with a "did you mean", and `omni-mesh schema` prints a
JSON Schema that accepts every topology file the repository ships and refuses the same misspellings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from omni_mesh.topology import TopologyError, parse_topology

REPO = Path(__file__).resolve().parents[1]
TOPOLOGIES = REPO / "tests" / "topologies"
SHIPPED = sorted(
    path
    for path in [*REPO.glob("compose/*.yaml"), *TOPOLOGIES.rglob("*.yaml")]
    if path.name != "bad_yaml.yaml"  # not YAML at all: what load_topology says of it is tested elsewhere
)

# A deliberate typo in the extra: of a connector no edge uses: validate only warns (vllm-omni never builds
# that connector), the schema flags it where it is.
FLAGGED = {
    "tests/topologies/vllm_omni/unused_connectors.yaml": [["runtime", "connectors", "threshold_shm", "extra"]]
}

# (stage key as misspelled, its value, the key meant)
MISSPELLED = [
    ("replica", 2, "replicas"),
    ("max_inflght", 4, "max_inflight"),
    ("final_ouput", True, "final_output"),
    ("engine_input_sorce", [0], "engine_input_source"),
]


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_mesh", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _two_stages(key: str, value: Any) -> dict:
    """A valid two-stage topology whose stage 1 'second' carries `key: value`."""
    second = {
        "stage_id": 1,
        "name": "second",
        "handler": "pkg.mod:second",
        "engine_input_source": [0],
        key: value,
    }
    return {"name": "typos", "stages": [{"stage_id": 0, "name": "first", "handler": "pkg.mod:first"}, second]}


@pytest.mark.parametrize(("key", "value", "meant"), MISSPELLED)
def test_validate_names_the_stage_the_misspelled_key_and_the_right_one(
    tmp_path: Path, key: str, value: Any, meant: str
) -> None:
    path = tmp_path / "typo.yaml"
    text = yaml.safe_dump(_two_stages(key, value), sort_keys=False)
    path.write_text(text)
    line = next(n for n, row in enumerate(text.splitlines(), 1) if row.lstrip(" -").startswith(f"{key}:"))
    result = _run("validate", "--no-import", path, cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith(
        f"error: {path}:{line}: stage 1 'second': unknown key {key!r}; did you mean {meant!r}?"
    ), result.stderr


def test_the_right_spellings_validate(tmp_path: Path) -> None:
    data = _two_stages("replicas", 2)
    data["stages"][1].update(max_inflight=4, final_output=True)
    path = tmp_path / "right.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = _run("validate", "--no-import", path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1  second  replicas=2 max_inflight=4" in result.stdout


def test_a_key_near_no_known_one_is_still_the_handlers_option() -> None:
    topology = parse_topology(_two_stages("voice", "Chelsie"))
    assert topology.stage("second").options == {"voice": "Chelsie"}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"conectors": {}}, "top level: unknown key 'conectors'; did you mean 'connectors'?"),
        ({"runtime": {"edgs": []}}, "runtime: unknown key 'edgs'; did you mean 'edges'?"),
        ({"defaults": {"replica": 2}}, "defaults: unknown key 'replica'; did you mean 'replicas'?"),
        ({"edges": [{"fromm": 0, "to": 1}]}, "got {'fromm': 0, 'to': 1}; did you mean 'from' for 'fromm'?"),
        (
            {"edges": [{"from": 0, "to": 1, "conector": "c"}]},
            "unknown key(s) 'conector' in edge entry; did you mean 'connector' for 'conector'?",
        ),
        (
            {
                "connectors": {"c": {"name": "ZmqConnector", "extras": {}}},
                "edges": [{"from": 0, "to": 1, "connector": "c"}],
            },
            "unknown key 'extras'; did you mean 'extra'?",
        ),
    ],
)
def test_misspelled_keys_of_the_other_sections_are_named(section: dict, message: str) -> None:
    data = {**_two_stages("replicas", 1), **section}
    with pytest.raises(TopologyError) as caught:
        parse_topology(data, source="t.yaml")
    assert message in str(caught.value)


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What `omni-mesh schema` prints, through the real CLI."""
    result = _run("schema", cwd=tmp_path_factory.mktemp("schema"))
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(printed)
    return printed


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: str(path.relative_to(REPO)))
def test_the_schema_accepts_every_shipped_topology(schema: dict, path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    errors = [
        jsonschema.exceptions.best_match([e])
        for e in jsonschema.Draft202012Validator(schema).iter_errors(data)
    ]
    where = [list(e.absolute_path) for e in errors]
    assert where == FLAGGED.get(str(path.relative_to(REPO)), []), [e.message[:200] for e in errors]


@pytest.mark.parametrize(("key", "value", "meant"), MISSPELLED)
def test_the_schema_refuses_the_misspellings(schema: dict, key: str, value: Any, meant: str) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(_two_stages(meant, value))
    error = jsonschema.exceptions.best_match(validator.iter_errors(_two_stages(key, value)))
    assert error is not None and list(error.absolute_path) == ["stages", 1]
    assert key in error.message


def test_the_schema_checks_values_and_the_openai_section(schema: dict) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    assert not validator.is_valid(_two_stages("replicas", 0))
    good = {
        **_two_stages("replicas", 1),
        "openai": {
            "inputs": {"prompt": "last_user_message"},
            "text_output": {"stage": "second", "field": "text"},
        },
    }
    assert validator.is_valid(good)
    good["openai"]["inputs"] = {"prompt": "last_user_mesage"}
    assert not validator.is_valid(good)
    engine = {"part": "token2wav", "model": "${OMNI_MESH_MODEL}", "dtype": "float32", "max_tokens": 64}
    assert validator.is_valid(_two_stages("engine", engine))
    for wrong in ({"dtyp": "float32"}, {"part": "vocoder"}, {"max_tokens": "many"}):
        assert not validator.is_valid(_two_stages("engine", {**engine, **wrong})), wrong


def _with_connector(name: str, extra: dict) -> dict:
    data = _two_stages("replicas", 1)
    data["connectors"] = {"link": {"name": name, "extra": extra}}
    data["stages"][1]["input_connectors"] = {"from_stage_0": "link"}
    return data


def test_the_schema_knows_each_connectors_extra_keys(schema: dict) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    accepted = [
        (
            "SharedMemoryConnector",
            {"memory_pool_size": "512MiB", "shm_threshold_bytes": 4096, "codec_chunk_frames": 25},
        ),
        ("MooncakeConnector", {"master": "${MASTER:-127.0.0.1:50051}", "proto": "rdma", "segment": "1GiB"}),
        ("YuanrongConnector", {"port": "35000", "ttl_s": 60}),
        ("SomeThirdPartyConnector", {"anything": 1}),
    ]
    for name, extra in accepted:
        assert validator.is_valid(_with_connector(name, extra)), (name, extra)
    refused = [
        ("SharedMemoryConnector", {"memory_pool_sise": 1}),
        ("ZmqConnector", {"port": "any"}),
        ("ZmqConnector", {"ttl_s": True}),
        ("MooncakeConnector", {"segment": "lots"}),
    ]
    for name, extra in refused:
        error = jsonschema.exceptions.best_match(validator.iter_errors(_with_connector(name, extra)))
        assert error is not None and list(error.absolute_path)[:3] == ["connectors", "link", "extra"], (
            name,
            extra,
        )


def test_schema_writes_a_file(tmp_path: Path) -> None:
    result = _run("schema", "--output", tmp_path / "topology.schema.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "topology.schema.json").read_text())["title"] == "omni-mesh topology"


def test_errors_about_a_key_name_its_line(tmp_path: Path) -> None:
    """The loader adds the line of the key at fault: in a stage, a connector entry, the openai: section."""
    from omni_mesh.topology import load_topology

    cases = [
        ("stages:\n  - stage_id: 0\n    name: a\n    final_ouput: true\n", 4, "unknown key 'final_ouput'"),
        (
            "connectors:\n  c:\n    name: ZmqConnector\n    extras: {}\nstages:\n"
            "  - {stage_id: 0, name: a, handler: 'm:f'}\n"
            "  - {stage_id: 1, name: b, handler: 'm:f', input_connectors: {from_stage_0: c}}\n",
            4,
            "unknown key 'extras'; did you mean 'extra'?",
        ),
        (
            "stages:\n  - {stage_id: 0, name: a}\nopenai:\n  inputs: {prompt: last_user_message}\n"
            "  text_outptu: {stage: a, field: text}\n",
            5,
            "openai: unknown key 'text_outptu'; did you mean 'text_output'?",
        ),
    ]
    for index, (text, line, message) in enumerate(cases):
        path = tmp_path / f"case{index}.yaml"
        path.write_text(text)
        with pytest.raises(TopologyError) as caught:
            load_topology(path)
        assert str(caught.value).startswith(f"{path}:{line}: "), caught.value
        assert message in str(caught.value)


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            "stages:\n  - stage_id: 0\n    name: a\n    replicas: '2'\n",
            4,
            "stage 0 'a': replicas must be an integer >= 1, got '2'",
        ),
        (
            "stages:\n  - stage_id: 0\n    name: a\n    input_connectors:\n      from_0: c\n",
            5,
            "stage 0 'a': input_connectors key 'from_0' must be from_stage_<stage id>, e.g. from_stage_0",
        ),
        (
            "defaults:\n  max_inflight: 0\nstages:\n  - {stage_id: 0}\n",
            2,
            "defaults.max_inflight: must be an integer >= 1, got 0",
        ),
        (
            "stages:\n  - {stage_id: 0, name: a}\nopenai:\n  inputs: {prompt: last_user_message}\n"
            "  audio_output:\n    stage: a\n    field: pcm\n    sample_rate: fast\n",
            8,
            "openai.audio_output.sample_rate: must be a positive integer (Hz), got 'fast'",
        ),
        (
            "stages:\n  - {stage_id: 0, name: a}\nopenai:\n  inputs:\n    prompt: last_user_mesage\n"
            "  text_output: {stage: a, field: text}\n",
            5,
            "openai.inputs.prompt: 'last_user_mesage' is not one of last_user_message, messages, system_message; "
            "did you mean 'last_user_message'?",
        ),
    ],
)
def test_a_wrong_value_is_named_with_its_key_path_and_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    """Each value is checked by its section's model; the error names the file, the line, the stage or
    section, the key path, what was expected and what the file holds."""
    from omni_mesh.topology import load_topology

    path = tmp_path / "wrong.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError) as caught:
        load_topology(path)
    assert str(caught.value) == f"{path}:{line}: {message}"


def test_a_nested_section_on_a_stage_is_one_field_and_its_errors_name_the_path() -> None:
    """A stage key holding a section of its own (as `autoscale:` will) is one field of a model: its
    values, unknown keys and missing keys are worded like the stage's own, with the path."""
    from pydantic import Field

    from omni_mesh.topology.schema import Count, StageOwnKeys, _Closed
    from omni_mesh.topology.validation import validated

    class Scaling(_Closed):
        min_replicas: Count
        max_replicas: Count | None = None

    class WithScaling(StageOwnKeys):
        scaling: Scaling | None = Field(None)

    def error(scaling: object, key_of: tuple | None = None) -> str:
        entry = {"stage_id": 1, "name": "talker", "scaling": scaling}
        with pytest.raises(TopologyError) as caught:
            validated(WithScaling, entry, "stage 1 'talker'")
        assert caught.value.key_of == (key_of or (entry, "scaling")), caught.value.key_of  # for the line
        return str(caught.value)

    ok = validated(WithScaling, {"stage_id": 1, "scaling": {"min_replicas": 2}}, "stage 1")
    assert ok.scaling is not None and ok.scaling.min_replicas == 2
    wrong = {"min_replicas": 0}
    assert (
        error(wrong, (wrong, "min_replicas"))
        == "stage 1 'talker': scaling.min_replicas must be an integer >= 1, got 0"
    )
    misspelled = {"min_replicas": 1, "max_replica": 2}
    assert error(misspelled, (misspelled, "max_replica")).startswith(
        "stage 1 'talker': scaling: unknown key 'max_replica'; did you mean 'max_replicas'?"
    )
    assert error({}) == "stage 1 'talker': scaling has no min_replicas: key; it must be an integer >= 1"
    assert error(3) == "stage 1 'talker': scaling must be a mapping, got int"
