"""Topology loading and validation: every rule, and the files users already have."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_mesh.connectors import OmniConnectorBase, available_connectors, registry
from omni_mesh.topology import (
    ConnectorSpec,
    EdgeSpec,
    StageSpec,
    Topology,
    TopologyError,
    add_to_sys_path,
    load_topology,
    parse_topology,
)

TOPOLOGIES = Path(__file__).parent / "topologies"


def parse(text: str) -> Topology:
    return parse_topology(yaml.safe_load(textwrap.dedent(text)), source="t.yaml")


def error_of(text: str) -> str:
    with pytest.raises(TopologyError) as info:
        parse(text)
    message = str(info.value)
    assert message.startswith("t.yaml: "), message  # every error names its file
    return message


@dataclass(frozen=True)
class _LinkConfig:
    host: str = "127.0.0.1"
    segment_size: int = 0


class LinkTestConnector(OmniConnectorBase):
    """A second connector type for these tests; only its config is ever checked, never instantiated."""

    config_class = _LinkConfig


@pytest.fixture
def link_connector(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(registry.registered, "LinkTestConnector", LinkTestConnector)
    return "LinkTestConnector"


THREE = """
    name: three
    stages:
      - {stage_id: 0, name: thinker}
      - {stage_id: 1, name: talker, engine_input_source: [0]}
      - {stage_id: 2, name: code2wav, engine_input_source: [1], final_output: true}
"""


# --------------------------------------------------------------------------------------------------
# files in the shapes users write


def test_design_example_file() -> None:
    topo = load_topology(TOPOLOGIES / "demo.yaml")
    assert topo.name == "qwen-omni-demo"
    assert [s.name for s in topo.stages] == ["thinker", "talker", "code2wav"]
    assert topo.path == (TOPOLOGIES / "demo.yaml").resolve()
    assert topo.base_dir == TOPOLOGIES.resolve()
    thinker = topo.stage("thinker")
    assert (thinker.replicas, thinker.max_inflight, thinker.handler) == (
        2,
        4,
        "topology_demo_handlers:thinker",
    )
    assert topo.stage(1).replicas == 1 and topo.stage(1).max_inflight == 8
    assert [e.label for e in topo.edges] == ["0->1", "1->2"]
    explicit, auto = topo.edges
    assert explicit.connector == ConnectorSpec("shm", "SharedMemoryConnector", {}, auto=False)
    assert auto.connector == ConnectorSpec("auto_shm_1_2", "SharedMemoryConnector", {}, auto=True)
    assert set(topo.connectors) == {"shm", "auto_shm_1_2"}
    assert [s.name for s in topo.entry_stages] == ["thinker"]
    assert [s.name for s in topo.final_stages] == ["code2wav"]
    assert [s.name for s in topo.missing_handlers()] == ["talker", "code2wav"]


def test_vllm_omni_stage_args_with_runtime_defaults_and_edges() -> None:
    topo = load_topology(TOPOLOGIES / "vllm_omni_three_stage.yaml")
    assert topo.name == "vllm_omni_three_stage"  # no name: -> the file's stem
    assert [s.name for s in topo.stages] == ["stage_0", "stage_1", "stage_2"]
    assert all(s.max_inflight == 1 for s in topo.stages)  # runtime.defaults.max_inflight
    assert [(e.label, e.connector.name, e.connector.auto) for e in topo.edges] == [
        ("0->1", "SharedMemoryConnector", True),
        ("1->2", "SharedMemoryConnector", True),
    ]
    # A final stage may also feed another one: the thinker's text is an output, and the talker's input.
    assert [s.stage_id for s in topo.final_stages] == [0, 2]
    assert [s.stage_id for s in topo.entry_stages] == [0]
    options = topo.stage(1).options
    assert options["engine_args"]["model_stage"] == "talker"
    assert options["runtime"] == {"devices": "1"}
    assert options["custom_process_input_func"] == "my_models.processors.thinker_to_talker"
    assert "engine_input_source" not in options and "final_output" not in options
    # vllm-omni's model_stage runs on omni-mesh's engines, with its default_sampling_params as defaults
    assert not topo.missing_handlers()
    assert [s.engine["part"] for s in topo.stages] == ["thinker", "talker", "code2wav"]
    assert all(s.engine["model"] == "${OMNI_MESH_MODEL}" for s in topo.stages)
    assert (topo.stage(0).engine["temperature"], topo.stage(0).engine["max_tokens"]) == (0.2, 128)
    assert topo.stage(1).engine["temperature"] == 0.7


def test_vllm_omni_connector_under_runtime_named_on_both_sides() -> None:
    topo = load_topology(TOPOLOGIES / "vllm_omni_connectors.yaml")
    (edge,) = topo.edges
    assert edge.label == "0->1"
    assert edge.connector == ConnectorSpec("payload_link", "SharedMemoryConnector", {}, auto=False)
    assert list(topo.connectors) == ["payload_link"]
    assert all(s.max_inflight == 2 for s in topo.stages)
    assert topo.stage(0).options["stage_type"] == "llm"


def test_vllm_omni_deploy_layout_with_top_level_connectors() -> None:
    topo = load_topology(TOPOLOGIES / "vllm_omni_deploy.yaml")
    (edge,) = topo.edges
    assert (edge.label, edge.connector.ref) == ("0->1", "tts_link")
    assert [s.stage_id for s in topo.final_stages] == [1]  # nothing marked: the stage with no output
    assert topo.stage(0).options["devices"] == "0"


def test_inline_connector_definitions_on_both_sides() -> None:
    topo = parse("""
        stage_args:
          - stage_id: 0
            output_connectors:
              to_stage_1: {name: SharedMemoryConnector, extra: {}}
          - stage_id: 1
            input_connectors:
              from_stage_0: {name: SharedMemoryConnector}
    """)
    (edge,) = topo.edges
    assert edge.connector == ConnectorSpec("inline_0_1", "SharedMemoryConnector", {}, auto=False)
    assert topo.connectors["inline_0_1"] is edge.connector


def test_inline_connectors_that_differ_conflict(link_connector: str) -> None:
    message = error_of(f"""
        stages:
          - stage_id: 0
            output_connectors: {{to_stage_1: {{name: SharedMemoryConnector}}}}
          - stage_id: 1
            input_connectors: {{from_stage_0: {{name: {link_connector}}}}}
    """)
    assert "edge 0->1 (stage_0 -> stage_1)" in message
    assert "SharedMemoryConnector" in message and link_connector in message


# --------------------------------------------------------------------------------------------------
# the model


def test_stage_lookup_by_id_name_and_digit_string() -> None:
    topo = parse(THREE)
    assert topo.stage(1) is topo.stage("talker") is topo.stage("1")
    with pytest.raises(
        TopologyError, match=r"no stage 'nope'; stages: 0 'thinker', 1 'talker', 2 'code2wav'"
    ):
        topo.stage("nope")
    with pytest.raises(TopologyError, match="no stage 7"):
        topo.inputs_of(7)


def test_name_defaults_to_stage_id() -> None:
    topo = parse("""
        stages:
          - {stage_id: 4}
          - {stage_id: 9, name: speaker, engine_input_source: [4]}
    """)
    assert [s.name for s in topo.stages] == ["stage_4", "speaker"]
    assert topo.name == "topology"


def test_fan_out_and_fan_in() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, name: encoder}
          - {stage_id: 1, name: text, engine_input_source: [0]}
          - {stage_id: 2, name: audio, engine_input_source: [0]}
          - {stage_id: 3, name: mixer, engine_input_source: [1, 2]}
    """)
    assert [e.label for e in topo.outputs_of(0)] == ["0->1", "0->2"]
    assert [e.label for e in topo.inputs_of("mixer")] == ["1->3", "2->3"]
    assert all(e.connector.auto for e in topo.edges)
    assert len({e.connector.ref for e in topo.edges}) == 4  # one automatic connector per edge
    assert [s.name for s in topo.entry_stages] == ["encoder"]
    assert [s.name for s in topo.final_stages] == ["mixer"]


def test_stages_come_out_in_topological_order() -> None:
    topo = parse("""
        stages:
          - {stage_id: 5, name: last, engine_input_source: [1, 3]}
          - {stage_id: 3, name: middle, engine_input_source: [1]}
          - {stage_id: 1, name: first}
          - {stage_id: 0, name: side}
    """)
    # Ties (the two entries) break by stage id.
    assert [s.stage_id for s in topo.stages] == [0, 1, 3, 5]
    assert [e.label for e in topo.edges] == ["1->3", "1->5", "3->5"]


def test_several_final_stages_without_marks() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, name: encoder}
          - {stage_id: 1, name: text, engine_input_source: [0]}
          - {stage_id: 2, name: audio, engine_input_source: [0]}
          - {stage_id: 3, name: standalone}
    """)
    assert [s.name for s in topo.final_stages] == ["text", "audio", "standalone"]
    assert [s.name for s in topo.entry_stages] == ["encoder", "standalone"]


def test_every_declaration_style_makes_one_edge() -> None:
    topo = parse("""
        connectors:
          shm: {name: SharedMemoryConnector}
        stages:
          - {stage_id: 0, name: a, output_connectors: {to_stage_1: shm}}
          - {stage_id: 1, name: b, engine_input_source: [0], input_connectors: {from_stage_0: shm}}
        edges:
          - {from: 0, to: 1, connector: shm}
          - {from: a, to: b}
        runtime:
          edges:
            - {from: 0, to: 1, window_size: -1}
    """)
    assert [(e.label, e.connector.ref) for e in topo.edges] == [("0->1", "shm")]


def test_top_level_edges_alone_declare_the_graph() -> None:
    topo = parse("""
        connectors:
          shm: {name: SharedMemoryConnector}
        stages:
          - {stage_id: 0, name: a}
          - {stage_id: 1, name: b}
        edges:
          - {from: 0, to: 1, connector: shm}
    """)
    assert [(e.label, e.connector.ref, e.connector.auto) for e in topo.edges] == [("0->1", "shm", False)]


def test_to_dict_is_json_and_complete() -> None:
    data = load_topology(TOPOLOGIES / "demo.yaml").to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["name"] == "qwen-omni-demo"
    assert data["stages"][0] == {
        "id": 0,
        "name": "thinker",
        "handler": "topology_demo_handlers:thinker",
        "engine": None,
        "replicas": 2,
        "max_inflight": 4,
        "max_queued": None,
        "autoscale": None,
        "final_output": False,
        "entry": True,
        "final": False,
    }
    assert data["edges"] == [
        {
            "from": 0,
            "to": 1,
            "label": "0->1",
            "connector": "shm",
            "connector_name": "SharedMemoryConnector",
            "auto": False,
        },
        {
            "from": 1,
            "to": 2,
            "label": "1->2",
            "connector": "auto_shm_1_2",
            "connector_name": "SharedMemoryConnector",
            "auto": True,
        },
    ]
    assert data["connectors"]["auto_shm_1_2"] == {"name": "SharedMemoryConnector", "extra": {}, "auto": True}


def test_specs_are_frozen_and_hashable() -> None:
    topo = parse(THREE)
    stage = topo.stage(0)
    with pytest.raises(AttributeError):
        stage.replicas = 3  # type: ignore[misc]
    assert len({stage, *topo.stages}) == 3
    assert {e.connector for e in topo.edges} == set(topo.connectors.values())
    assert isinstance(topo.edges[0], EdgeSpec) and isinstance(stage, StageSpec)


def test_add_to_sys_path_makes_handlers_next_to_the_file_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(TOPOLOGIES.resolve())])
    monkeypatch.delitem(sys.modules, "topology_demo_handlers", raising=False)
    topo = load_topology(TOPOLOGIES / "demo.yaml")
    add_to_sys_path(topo)
    add_to_sys_path(topo)  # idempotent: still one entry, still first
    assert sys.path[0] == str(TOPOLOGIES.resolve())
    assert sys.path.count(str(TOPOLOGIES.resolve())) == 1
    module_name, _, attr = topo.stage("thinker").handler.partition(":")
    assert callable(getattr(importlib.import_module(module_name), attr))


def test_add_to_sys_path_without_a_file_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = list(sys.path)
    add_to_sys_path(parse(THREE))
    assert sys.path == before


# --------------------------------------------------------------------------------------------------
# connectors: automatic, undefined, unknown, mismatched, misconfigured


def test_auto_shm_false_refuses_an_edge_without_connector() -> None:
    message = error_of(THREE + "    auto_shm: false\n")
    assert "edge 0->1 (thinker -> talker)" in message
    assert "auto_shm is false" in message and "from_stage_0" in message


def test_auto_shm_false_accepts_named_connectors() -> None:
    topo = parse("""
        auto_shm: false
        connectors:
          shm: {name: SharedMemoryConnector}
        stages:
          - {stage_id: 0, name: a}
          - {stage_id: 1, name: b, input_connectors: {from_stage_0: shm}}
    """)
    assert [e.connector.auto for e in topo.edges] == [False]


def test_auto_shm_may_live_under_runtime() -> None:
    message = error_of(THREE + "    runtime: {auto_shm: false}\n")
    assert "edge 0->1" in message


def test_undefined_connector_reference() -> None:
    message = error_of("""
        connectors:
          shm: {name: SharedMemoryConnector}
        stages:
          - {stage_id: 0, name: thinker}
          - {stage_id: 1, name: talker, input_connectors: {from_stage_0: shmm}}
    """)
    assert "edge 0->1 (thinker -> talker)" in message
    assert "stage 1 'talker' input_connectors.from_stage_0" in message
    assert "'shmm'" in message and "defined: shm" in message


def test_unknown_connector_type_lists_available_ones() -> None:
    message = error_of("""
        connectors:
          mc: {name: FluxCapacitorConnector, extra: {}}
        stages:
          - {stage_id: 0, name: thinker, output_connectors: {to_stage_1: mc}}
          - {stage_id: 1, name: talker}
    """)
    assert "connector 'mc' (used by edge 0->1 (thinker -> talker))" in message
    assert "'FluxCapacitorConnector'" in message
    for name in available_connectors():
        assert name in message


def test_misspelt_connector_type_gets_a_suggestion() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0, name: a, output_connectors: {to_stage_1: {name: SharedMemoryConector}}}
          - {stage_id: 1, name: b}
    """)
    assert "connector 'inline_0_1' (used by edge 0->1 (a -> b))" in message
    assert "did you mean 'SharedMemoryConnector'?" in message


def test_both_sides_naming_different_connectors(link_connector: str) -> None:
    message = error_of(f"""
        connectors:
          shm: {{name: SharedMemoryConnector}}
          link: {{name: {link_connector}}}
        stages:
          - {{stage_id: 0, name: thinker, output_connectors: {{to_stage_1: shm}}}}
          - {{stage_id: 1, name: talker, input_connectors: {{from_stage_0: link}}}}
    """)
    assert "edge 0->1 (thinker -> talker)" in message
    assert "stage 0 'thinker' output_connectors.to_stage_1 names connector 'shm'" in message
    assert "stage 1 'talker' input_connectors.from_stage_0 names 'link'" in message


def test_two_refs_to_the_same_type_still_conflict() -> None:
    message = error_of("""
        connectors:
          shm_a: {name: SharedMemoryConnector}
          shm_b: {name: SharedMemoryConnector}
        stages:
          - {stage_id: 0, name: a, output_connectors: {to_stage_1: shm_a}}
          - {stage_id: 1, name: b}
        edges:
          - {from: 0, to: 1, connector: shm_b}
    """)
    assert "edge 0->1 (a -> b)" in message and "'shm_a'" in message and "'shm_b'" in message
    assert "edges[0]" in message


def test_unknown_key_in_connector_extra_names_ref_and_edges() -> None:
    message = error_of("""
        connectors:
          shm: {name: SharedMemoryConnector, extra: {no_such_setting: 1}}
        stages:
          - {stage_id: 0, name: a}
          - {stage_id: 1, name: b, input_connectors: {from_stage_0: shm}}
          - {stage_id: 2, name: c, input_connectors: {from_stage_1: shm}}
    """)
    assert "connector 'shm' (used by edge 0->1 (a -> b), edge 1->2 (b -> c))" in message
    assert "'no_such_setting'" in message and "extra" in message


def test_extra_values_are_checked_too(link_connector: str) -> None:
    topo = parse(f"""
        connectors:
          link: {{name: {link_connector}, extra: {{host: 10.0.0.2, segment_size: 64MiB}}}}
        stages:
          - {{stage_id: 0, output_connectors: {{to_stage_1: link}}}}
          - {{stage_id: 1}}
    """)
    assert topo.connectors["link"].extra == {"host": "10.0.0.2", "segment_size": "64MiB"}
    message = error_of(f"""
        connectors:
          link: {{name: {link_connector}, extra: {{host: 12}}}}
        stages:
          - {{stage_id: 0, output_connectors: {{to_stage_1: link}}}}
          - {{stage_id: 1}}
    """)
    assert "connector 'link' (used by edge 0->1 (stage_0 -> stage_1))" in message and "'host'" in message


def test_unused_connector_is_checked_but_only_warned_about() -> None:
    # vllm-omni creates only the connectors an edge names: a spare one cannot fail a run.
    topo = parse("""
        connectors:
          spare: {name: SharedMemoryConnector, extra: {bogus: true}}
          other: {name: NoSuchConnector}
        stages:
          - {stage_id: 0}
    """)
    spare, other = topo.warnings
    assert "connector 'spare' (used by no edge)" in spare and "'bogus'" in spare and "not an error" in spare
    assert "unknown connector 'NoSuchConnector'" in other


# A file of omni-mesh's own layout (handlers): checked strictly where vllm-omni's loader is lenient.
_TWO_WITH_HANDLERS = """
    stages:
      - {stage_id: 0, handler: 'm:f', output_connectors: {to_stage_1: shm}}
      - {stage_id: 1, handler: 'm:f'}
"""


def test_connector_entry_without_name() -> None:
    message = error_of("connectors:\n  shm: {extra: {}}\n" + textwrap.dedent(_TWO_WITH_HANDLERS))
    assert "edge 0->1 (stage_0 -> stage_1)" in message and "names connector 'shm', which is invalid" in message
    assert "connector 'shm' has no name:" in message and "SharedMemoryConnector" in message
    topo = parse("connectors:\n  shm: {extra: {}}\nstages: [{stage_id: 0}]\n")  # used by no edge
    assert "connector 'shm' has no name:" in topo.warnings[0]


def test_connector_entry_with_unknown_key() -> None:
    text = "connectors:\n  shm: {name: SharedMemoryConnector, extras: {}}\n" + textwrap.dedent(_TWO_WITH_HANDLERS)
    message = error_of(text)
    assert "connector 'shm'" in message and "'extras'" in message
    # vllm-omni's loader reads name and extra and nothing else: in its files, a warning.
    topo = parse(text.replace("stages:", "stage_args:").replace("handler: 'm:f', ", "").replace(", handler: 'm:f'", ""))
    assert [edge.connector.ref for edge in topo.edges] == ["shm"]
    assert topo.warnings[0] == "connector 'shm': key(s) 'extras' ignored (a connector has name: and extra:)"


# --------------------------------------------------------------------------------------------------
# the runtime: layout


def test_runtime_and_top_level_connectors_merge() -> None:
    topo = parse("""
        connectors:
          shm: {name: SharedMemoryConnector}
        runtime:
          connectors:
            shm: {name: SharedMemoryConnector}
            other: {name: SharedMemoryConnector, extra: {}}
        stages:
          - {stage_id: 0, output_connectors: {to_stage_1: other}}
          - {stage_id: 1}
    """)
    assert set(topo.connectors) == {"shm", "other"}
    assert topo.edges[0].connector.ref == "other"


def test_runtime_and_top_level_disagreeing_on_a_connector() -> None:
    message = error_of("""
        connectors:
          shm: {name: SharedMemoryConnector}
        runtime:
          connectors:
            shm: {name: SharedMemoryConnector, extra: {copy: true}}
        stages:
          - {stage_id: 0}
    """)
    assert (
        "connector 'shm' is set both under connectors: and" in message
        and "runtime.connectors:" in message
        and "keep only one" in message
    )


def test_runtime_and_top_level_disagreeing_on_defaults_and_flags() -> None:
    message = error_of(
        THREE + "    defaults: {max_inflight: 2}\n    runtime: {defaults: {max_inflight: 3}}\n"
    )
    assert "default 'max_inflight' is set both" in message and "(2 vs 3)" in message
    message = error_of(THREE + "    auto_shm: true\n    runtime: {auto_shm: false}\n")
    assert "auto_shm" in message


def test_stage_setting_beats_defaults() -> None:
    topo = parse("""
        defaults: {replicas: 2, max_inflight: 3}
        stages:
          - {stage_id: 0, replicas: 1}
          - {stage_id: 1, engine_input_source: [0], max_inflight: 16}
    """)
    assert [(s.replicas, s.max_inflight) for s in topo.stages] == [(1, 3), (2, 16)]


def test_stages_and_stage_args_together_are_refused() -> None:
    message = error_of("""
        stages: [{stage_id: 0}]
        stage_args: [{stage_id: 0}]
    """)
    assert "stages:" in message and "stage_args:" in message


# --------------------------------------------------------------------------------------------------
# stages and graph


@pytest.mark.parametrize(
    ("field", "ref"),
    [
        ("engine_input_source: [5]", "stage 1 'talker': engine_input_source names stage 5"),
        (
            "input_connectors: {from_stage_5: null}",
            "stage 1 'talker': input_connectors.from_stage_5 names stage 5",
        ),
        (
            "output_connectors: {to_stage_5: null}",
            "stage 1 'talker': output_connectors.to_stage_5 names stage 5",
        ),
    ],
)
def test_unknown_stage_referenced_from_a_stage(field: str, ref: str) -> None:
    message = error_of(f"""
        stages:
          - {{stage_id: 0, name: thinker}}
          - {{stage_id: 1, name: talker, {field}}}
    """)
    assert ref in message
    assert "stages: 0 'thinker', 1 'talker'" in message


def test_unknown_stage_referenced_from_edges() -> None:
    message = error_of(THREE + "    edges: [{from: talker, to: vocoder}]\n")
    assert "edges[0]: to names stage 'vocoder'" in message
    message = error_of(THREE + "    runtime: {edges: [{from: 0, to: 1}, {from: 1, to: 3}]}\n")
    assert "runtime.edges[1]: to names stage 3" in message


def test_edge_entry_with_unknown_key_or_missing_end() -> None:
    message = error_of(THREE + "    edges: [{from: 0, to: 1, conector: shm}]\n")
    assert "edges[0]" in message and "'conector'" in message
    message = error_of(THREE + "    edges: [{from: 0}]\n")
    assert "edges[0]" in message and "from:" in message


def test_duplicate_stage_ids() -> None:
    message = error_of("""
        stages:
          - {stage_id: 1, name: thinker}
          - {stage_id: 1, name: talker}
    """)
    assert "duplicate stage id 1" in message and "'thinker'" in message and "'talker'" in message


def test_duplicate_stage_names() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0, name: talker}
          - {stage_id: 1, name: talker}
    """)
    assert "duplicate stage name 'talker'" in message and "stages 0 and 1" in message


def test_default_name_colliding_with_an_explicit_one() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0, name: stage_1}
          - {stage_id: 1}
    """)
    assert "duplicate stage name 'stage_1'" in message


def test_cycle_is_named() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0, name: reader}
          - {stage_id: 1, name: talker, engine_input_source: [0, 2]}
          - {stage_id: 2, name: code2wav, engine_input_source: [1]}
    """)
    assert "cycle 1->2->1" in message
    assert "stage 1 'talker'" in message and "stage 2 'code2wav'" in message
    assert "no entry stage reaches" not in message  # reader reaches them


def test_stages_no_entry_reaches() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0, name: a, engine_input_source: [1]}
          - {stage_id: 1, name: b, engine_input_source: [0]}
          - {stage_id: 2, name: lone}
    """)
    assert "cycle 0->1->0" in message
    assert "no entry stage reaches stage 0 'a', stage 1 'b'" in message


def test_self_loop() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0, name: echo, engine_input_source: [0]}
    """)
    assert "cycle 0->0" in message and "stage 0 'echo'" in message


def test_stage_that_reaches_no_final_stage() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0, name: thinker}
          - {stage_id: 1, name: talker, engine_input_source: [0], final_output: true}
          - {stage_id: 2, name: logger, engine_input_source: [0]}
          - {stage_id: 3, name: island}
    """)
    assert "stage 2 'logger', stage 3 'island' reach no final stage" in message
    assert "final: stage 1 'talker'" in message


@pytest.mark.parametrize("key", ["replicas", "max_inflight"])
@pytest.mark.parametrize("value", [0, -1, "2", True, 1.5])
def test_counts_must_be_positive_integers(key: str, value: object) -> None:
    message = error_of(f"""
        stages:
          - {{stage_id: 0, name: thinker}}
          - {{stage_id: 3, name: talker, engine_input_source: [0], {key}: {json.dumps(value)}}}
    """)
    assert f"stage 3 'talker': {key} must be an integer >= 1" in message


def test_max_queued_is_optional_and_defaults_to_four_times_the_stage_capacity() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, name: thinker, replicas: 2, max_inflight: 3}
          - {stage_id: 1, name: talker, engine_input_source: [0], max_queued: 5}
          - {stage_id: 2, name: code2wav, engine_input_source: [1], max_queued: 0}
    """)
    thinker, talker, code2wav = topo.stages
    assert (thinker.max_queued, talker.max_queued, code2wav.max_queued) == (None, 5, 0)
    assert thinker.queue_limit() == 4 * 2 * 3
    # Replicas scaled past the topology's count (compose --scale) raise the default, not a set value.
    assert thinker.queue_limit(running_capacity=10 * 3) == 4 * 30
    assert thinker.queue_limit(running_capacity=1) == 4 * 2 * 3
    assert talker.queue_limit(running_capacity=100) == 5
    assert code2wav.queue_limit() == 0
    assert [stage["max_queued"] for stage in topo.to_dict()["stages"]] == [None, 5, 0]


@pytest.mark.parametrize("value", [-1, "2", True, 1.5, [1]])
def test_max_queued_must_be_a_non_negative_integer(value: object) -> None:
    message = error_of(f"""
        stages:
          - {{stage_id: 0, name: thinker}}
          - {{stage_id: 3, name: talker, engine_input_source: [0], max_queued: {json.dumps(value)}}}
    """)
    assert "stage 3 'talker': max_queued must be an integer >= 0" in message
    assert repr(value) in message


def test_validate_summary_shows_each_stage_queue_limit() -> None:
    from omni_mesh.cli import format_summary

    summary = format_summary(parse("""
        stages:
          - {stage_id: 0, name: thinker, replicas: 2, max_inflight: 3}
          - {stage_id: 1, name: talker, engine_input_source: [0], max_queued: 5}
    """))
    assert "max_queued=24 (default)" in summary.splitlines()[2]
    assert summary.splitlines()[3].endswith("max_queued=5")


def test_max_queued_is_not_passed_on_as_an_unknown_option() -> None:
    topo = parse("stages: [{stage_id: 0, max_queued: 2}]")
    assert topo.stage(0).options == {}


def test_stage_ids_may_be_digit_strings() -> None:
    # vllm-omni compares stage ids as strings, so "1" and 1 are one stage.
    topo = parse("""
        stage_args:
          - {stage_id: "0"}
          - {stage_id: "1", engine_input_source: ["0"]}
        runtime: {edges: [{from: "1", to: 2}, {from: 0, to: "1"}]}
    """)
    assert [s.stage_id for s in topo.stages] == [0, 1]
    assert [e.label for e in topo.edges] == ["0->1"]
    assert "to names stage 2, which is not defined" in topo.warnings[0]


@pytest.mark.parametrize("value", ["1.5", "true", "-1", "null", '"1a"'])
def test_stage_ids_must_be_integers(value: str) -> None:
    message = error_of(f"""
        stages:
          - {{stage_id: 0, name: thinker}}
          - {{stage_id: {value}, name: talker}}
    """)
    assert "stage #1: stage_id must be a non-negative integer" in message


def test_stage_without_id() -> None:
    assert "stage #0 has no stage_id" in error_of("stages: [{name: thinker}]")


@pytest.mark.parametrize(
    ("mapping", "bad_key", "hint"),
    [
        ("input_connectors: {from_0: shm}", "'from_0'", "from_stage_0"),
        ("input_connectors: {from_stage_x: shm}", "'from_stage_x'", "from_stage_0"),
        ("input_connectors: {to_stage_0: shm}", "'to_stage_0'", "from_stage_0"),
        ("output_connectors: {to_stage_: shm}", "'to_stage_'", "to_stage_1"),
    ],
)
def test_malformed_connector_keys(mapping: str, bad_key: str, hint: str) -> None:
    message = error_of(f"""
        connectors:
          shm: {{name: SharedMemoryConnector}}
        stages:
          - {{stage_id: 0, name: thinker}}
          - {{stage_id: 1, name: talker, {mapping}}}
    """)
    assert "stage 1 'talker': " in message and bad_key in message and hint in message


def test_engine_input_source_must_be_a_list() -> None:
    message = error_of("""
        stages:
          - {stage_id: 0}
          - {stage_id: 1, name: talker, engine_input_source: 0}
    """)
    assert "stage 1 'talker': engine_input_source must be a list" in message


@pytest.mark.parametrize("handler", ["no_colon", "a.b:", ":f", "a b:c", 3])
def test_handler_must_be_module_colon_callable(handler: object) -> None:
    message = error_of(f"stages: [{{stage_id: 0, name: thinker, handler: {json.dumps(handler)}}}]")
    assert "stage 0 'thinker': handler must look like 'package.module:function'" in message


@pytest.mark.parametrize("name", ["has space", "a/b", "", "-lead", 7])
def test_stage_names_are_plain(name: object) -> None:
    message = error_of(f"stages: [{{stage_id: 2, name: {json.dumps(name)}}}]")
    assert "stage 2: name must be" in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[1, 2]", "must be a mapping"),
        ("name: x", "no stages"),
        ("stages: []", "non-empty list"),
        ("stages: [{stage_id: 0}]\nruntime: [1]", "runtime: must be a mapping"),
        ("stages: [{stage_id: 0, final_output: 'yes'}]", "final_output must be true or false"),
    ],
)
def test_malformed_documents(text: str, fragment: str) -> None:
    assert fragment in error_of(text)


# --------------------------------------------------------------------------------------------------
# files


def test_yaml_syntax_error_names_file_and_line() -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(TOPOLOGIES / "bad_yaml.yaml")
    message = str(info.value)
    assert message.startswith(f"{TOPOLOGIES / 'bad_yaml.yaml'}:6:")
    assert "invalid YAML" in message and "line 5" in message


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="topology file not found"):
        load_topology(tmp_path / "nope.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(TopologyError, match=r"empty\.yaml: the file is empty"):
        load_topology(empty)


def test_errors_in_a_file_name_the_file() -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(TOPOLOGIES / "bad_cycle.yaml")
    assert str(info.value).startswith(f"{TOPOLOGIES / 'bad_cycle.yaml'}: the stages form a cycle 1->2->1")


# --------------------------------------------------------------------------------------------------
# properties over random graphs


@st.composite
def dags(draw: st.DrawFn, min_edges: int = 0) -> tuple[list[int], set[tuple[int, int]]]:
    """Random stage ids and edges that only point forward in a random order: always acyclic."""
    count = draw(st.integers(2 if min_edges else 1, 8))
    ids = draw(st.lists(st.integers(0, 50), min_size=count, max_size=count, unique=True))
    pairs = [(ids[i], ids[j]) for i in range(count) for j in range(i + 1, count)]
    edges = draw(st.sets(st.sampled_from(pairs), min_size=min_edges)) if pairs else set()
    return ids, edges


@settings(max_examples=150, deadline=None)
@given(dags(), st.randoms())
def test_any_dag_validates_in_topological_order(dag: tuple[list[int], set[tuple[int, int]]], rnd) -> None:
    ids, edges = dag
    declared = list(ids)
    rnd.shuffle(declared)  # declaration order must not matter
    stages = [
        {"stage_id": sid, "engine_input_source": sorted(s for s, d in edges if d == sid)} for sid in declared
    ]
    topo = parse_topology({"stages": stages})
    position = {stage.stage_id: index for index, stage in enumerate(topo.stages)}
    assert sorted(position) == sorted(ids)
    assert {(e.src, e.dst) for e in topo.edges} == edges
    assert all(position[e.src] < position[e.dst] for e in topo.edges)
    assert {s.stage_id for s in topo.entry_stages} == set(ids) - {d for _, d in edges}
    assert {s.stage_id for s in topo.final_stages} == set(ids) - {s for s, _ in edges}


@settings(max_examples=100, deadline=None)
@given(dags(min_edges=1), st.data())
def test_any_back_edge_is_reported_as_a_cycle(dag: tuple[list[int], set[tuple[int, int]]], data) -> None:
    ids, edges = dag
    src, dst = data.draw(st.sampled_from(sorted(edges)))
    edges = edges | {(dst, src)}  # closes a cycle through src and dst
    stages = [
        {"stage_id": sid, "engine_input_source": sorted(s for s, d in edges if d == sid)} for sid in ids
    ]
    with pytest.raises(TopologyError) as info:
        parse_topology({"stages": stages})
    cycle = str(info.value).split("cycle ", 1)[1].split(" ", 1)[0].split("->")
    assert cycle[0] == cycle[-1] and len(cycle) >= 3
    for a, b in zip(cycle, cycle[1:], strict=False):
        assert (int(a), int(b)) in edges


def test_engine_settings_are_checked_where_the_stage_is() -> None:
    from omni_mesh.topology.parse import parse_topology

    def stage(engine: object) -> dict:
        return {"stages": [{"stage_id": 0, "name": "thinker", "engine": engine}]}

    parsed = parse_topology(stage({"part": "token2wav", "model": "/m", "dtype": "bfloat16"}), source="t")
    assert parsed.stages[0].engine["part"] == "code2wav" and not parsed.missing_handlers()
    for engine, message in (
        ({"part": "thinker"}, "engine.model must be a checkpoint directory"),
        ({"part": "decoder", "model": "/m"}, "engine.part must be one of encoder, thinker, talker, code2wav"),
        ({"part": "thinker", "model": "/m", "max_token": 3}, "did you mean 'max_tokens'"),
        ({"part": "thinker", "model": "/m", "device": "gpu"}, "engine.device must be cpu or cuda:N"),
        ({"part": "thinker", "model": "/m", "top_p": 0}, r"engine.top_p must be a number in \(0, 1\]"),
        ({"part": "thinker", "model": "/m", "core_process": "yes"}, "engine.core_process must be true or false, got 'yes'"),
    ):
        with pytest.raises(TopologyError, match=message) as caught:
            parse_topology(stage(engine), source="t")
        assert "stage 0 'thinker'" in str(caught.value)
    both = {"stages": [{"stage_id": 0, "handler": "m:f", "engine": {"part": "thinker", "model": "/m"}}]}
    with pytest.raises(TopologyError, match="set handler: or engine:, not both"):
        parse_topology(both, source="t")


def test_max_batch_sets_the_engines_batch_and_the_replicas_max_inflight() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, name: thinker, engine: {part: thinker, model: m, max_batch: 16}}
          - {stage_id: 1, name: talker, engine_input_source: [0], engine: {part: talker, model: m}}
          - {stage_id: 2, name: code2wav, engine_input_source: [1], max_inflight: 3,
             engine: {part: code2wav, model: m, max_batch: 4}}
    """)
    assert [s.engine["max_batch"] for s in topo.stages] == [16, 1, 4]
    # unless set: a full batch running and as many waiting to join it; never below the default 8
    assert [s.max_inflight for s in topo.stages] == [32, 8, 3]
    with pytest.raises(TopologyError, match=r"stage 0 'thinker': engine.max_batch must be an integer >= 1, got 0"):
        parse("stages: [{stage_id: 0, name: thinker, engine: {part: thinker, model: m, max_batch: 0}}]")


def test_vllm_omnis_max_num_seqs_is_the_engines_max_batch() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, engine_args: {model_stage: thinker, max_num_seqs: 12}}
          - {stage_id: 1, engine_input_source: [0], engine_args: {model_stage: talker}, max_num_seqs: 6}
    """)
    assert [s.engine["max_batch"] for s in topo.stages] == [12, 6]
    assert [s.max_inflight for s in topo.stages] == [24, 12]
    assert not any("max_num_seqs" in warning for warning in topo.warnings)  # it has an effect now


def test_a_kv_budget_in_tokens_sets_the_replicas_max_inflight() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, name: thinker, engine: {part: thinker, model: m, max_batch: 16, max_tokens: 100,
                                                  kv_cache_tokens: 450}}
          - {stage_id: 1, name: talker, engine_input_source: [0],
             engine: {part: talker, model: m, max_batch: 2, max_audio_tokens: 100, kv_cache_tokens: 100000}}
          - {stage_id: 2, name: code2wav, engine_input_source: [1], max_inflight: 3,
             engine: {part: code2wav, model: m, kv_cache_memory_bytes: 4096}}
    """)
    # the rows the budget holds at the default reply (450 // 100 = 4; the talker's max_batch caps it), and
    # as many waiting in the replica; a budget in bytes only is known in tokens once the model loads
    assert [s.max_inflight for s in topo.stages] == [8, 4, 3]
    assert topo.stages[2].engine["kv_cache_memory_bytes"] == 4096
    for key in ("kv_cache_tokens", "kv_cache_memory_bytes"):
        with pytest.raises(TopologyError, match=rf"stage 0 'thinker': engine.{key} must be an integer >= 1, got 0"):
            parse(f"stages: [{{stage_id: 0, name: thinker, engine: {{part: thinker, model: m, {key}: 0}}}}]")


def test_vllm_omnis_kv_cache_memory_bytes_and_max_num_batched_tokens_map_onto_the_engine() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, engine_args: {model_stage: thinker, kv_cache_memory_bytes: 1000000,
                                        max_num_batched_tokens: 2048, gpu_memory_utilization: 0.8}}
          - {stage_id: 1, engine_input_source: [0], engine_args: {model_stage: talker},
             kv_cache_memory_bytes: 5000, max_num_batched_tokens: 64}
    """)
    engines = [s.engine for s in topo.stages]
    assert [(e["kv_cache_memory_bytes"], e["prefill_tokens"]) for e in engines] == [(1000000, 2048), (5000, 64)]
    warned = " ".join(topo.warnings)
    assert "gpu_memory_utilization" in warned  # a share of a GPU's memory: no meaning on a CPU stage
    assert "kv_cache_memory_bytes" not in warned and "max_num_batched_tokens" not in warned
