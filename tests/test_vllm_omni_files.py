"""vllm-omni's files as its users bring them: every stage config its loader accepts validates, and
deploy files get the graph vllm-omni keeps in code.

What vllm-omni's loader does (vllm_omni/distributed/omni_connectors/utils/initialization.py and
vllm_omni/config/): it reads `runtime.connectors` (top-level `connectors:`/`edges:` in the newer
schema), builds one edge per `engine_input_source` entry, `input_connectors`/`output_connectors` key
and `runtime.edges` entry (skipping entries without from/to, ignoring their other keys, comparing
stage ids as strings), creates only the connectors an edge names, gives an edge without one a
SharedMemoryConnector, and expands `$VAR`/`${VAR}` in connector settings and reads ports with int().
Deploy files (`vllm_omni/deploy/*.yaml`) list settings only; the graph comes from the pipeline
registered for the model (or named by `pipeline:`), after merging any `base_config:` file.

The fixtures under topologies/vllm_omni/ are written for these tests in those shapes. Set
OMNI_MESH_VLLM_OMNI_DIR to a directory holding vllm-omni's own YAML files (a checkout, or its files
from every version) to validate all of its stage configs too.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import yaml

from omni_mesh.cli import format_summary, main
from omni_mesh.connectors import connector_class
from omni_mesh.topology import Topology, TopologyError, load_topology, parse_topology
from omni_mesh.vllm_omni_graphs import PIPELINES, match_pipeline

FILES = Path(__file__).parent / "topologies" / "vllm_omni"
DEPLOY = FILES / "deploy"
SNAPSHOT_ENV = "OMNI_MESH_VLLM_OMNI_DIR"


def edges_of(topo: Topology) -> list[tuple[str, str]]:
    return [(edge.label, edge.connector.ref) for edge in topo.edges]


def parse(text: str, name: str = "t") -> Topology:
    return parse_topology(yaml.safe_load(textwrap.dedent(text)), source="t.yaml", default_name=name)


def error_of(text: str, name: str = "t") -> str:
    with pytest.raises(TopologyError) as info:
        parse(text, name)
    return str(info.value)


# --------------------------------------------------------------------------------------------------
# stage configs (stage_args:): each cause that made omni-mesh refuse a file vllm-omni accepts


def test_unused_connectors_are_warnings_whatever_is_wrong_with_them() -> None:
    topo = load_topology(FILES / "unused_connectors.yaml")
    assert edges_of(topo) == [("0->1", "shm_link")]
    threshold, kv_store = topo.warnings
    assert threshold.startswith("connector 'threshold_shm' (used by no edge)") and "'shm_treshold_bytes'" in threshold
    assert "did you mean 'shm_threshold_bytes'?" in threshold
    assert "unknown connector 'SomeKVConnector'" in kv_store and "not an error: no edge uses it" in kv_store
    assert topo.connectors["datasystem"].extra["port"] == 35000  # checked, and fine once read as a number


def test_a_used_connector_is_still_checked_strictly() -> None:
    text = (FILES / "unused_connectors.yaml").read_text().replace(": shm_link", ": kv_store")
    with pytest.raises(TopologyError, match=r"connector 'kv_store' \(used by edge 0->1 .*unknown connector"):
        parse_topology(yaml.safe_load(text), source="t.yaml")


def test_environment_variables_in_connector_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_HOST", "10.1.2.3")
    monkeypatch.setenv("MOONCAKE_HTTP_PORT", "8080")
    monkeypatch.setenv("MOONCAKE_RPC_PORT", "50051")
    monkeypatch.setenv("ENGINE_ZMQ_PORT", "50100")
    monkeypatch.delenv("ENGINE_PROTOCOL", raising=False)
    topo = load_topology(FILES / "env_vars.yaml")
    store, engine = (topo.connectors[ref].extra for ref in ("store", "engine"))
    assert store["master"] == "10.1.2.3:50051"
    assert store["metadata_server"] == "http://10.1.2.3:8080/metadata"
    assert engine["zmq_port"] == 50100  # expanded, then read as the port it is
    assert engine["protocol"] == "tcp"  # ${VAR:-default}
    assert topo.warnings == []


def test_unset_variables_leave_the_value_unchecked_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MOONCAKE_HOST", "MOONCAKE_HTTP_PORT", "MOONCAKE_RPC_PORT", "ENGINE_ZMQ_PORT"):
        monkeypatch.delenv(name, raising=False)
    topo = load_topology(FILES / "env_vars.yaml")
    assert topo.connectors["engine"].extra["zmq_port"] == "$ENGINE_ZMQ_PORT"  # as written, for the stage's host
    assert len(topo.warnings) == 4
    assert any("extra.master uses $MOONCAKE_HOST, $MOONCAKE_RPC_PORT, which is not set here" in w for w in topo.warnings)
    assert any("connector 'engine' (used by edge 1->2" in w and "extra.zmq_port" in w for w in topo.warnings)


def test_connector_keys_under_vllm_omnis_names_validate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_omni"}')  # validate reads the engines' config
    monkeypatch.setenv("OMNI_MESH_MODEL", str(tmp_path))
    topo = load_topology(FILES / "vllm_omni_keys.yaml")
    assert edges_of(topo) == [("0->1", "store"), ("1->2", "rdma")]
    assert topo.connectors["rdma"].extra["zmq_port"] == 50051  # a port written as a string, read as one
    sender, chunk_keys = sorted((w for w in topo.warnings if "no effect" in w), key=lambda w: "codec" in w)
    assert "MooncakeTransferEngineConnector: config keys 'codec_chunk_frames', 'codec_chunk_ramp', " in chunk_keys
    assert "'connector_get_sleep_s' (vllm-omni's) have no effect" in chunk_keys
    assert "config key 'sender_host' (vllm-omni's) has no effect" in sender
    assert main(["validate", str(FILES / "vllm_omni_keys.yaml")]) == 0
    out = capsys.readouterr().out
    assert "0->1  stage_0 -> stage_1  via MooncakeConnector [store]" in out
    assert "1->2  stage_1 -> stage_2  via MooncakeTransferEngineConnector [rdma]" in out


def test_an_edge_on_a_connector_only_vllm_omni_has_validates_with_a_warning() -> None:
    topo = load_topology(FILES / "vllm_omni_only_connector.yaml")
    assert edges_of(topo) == [("0->1", "kv")]
    (warning,) = topo.warnings
    assert warning.startswith("connector 'kv' (used by edge 0->1") and "PrisKVConnector is vllm-omni's" in warning
    assert "set its name: to MooncakeStoreConnector or YuanrongConnector" in warning
    text = (FILES / "vllm_omni_only_connector.yaml").read_text().replace("PrisKVConnector", "PrisKVConector")
    with pytest.raises(TopologyError, match="unknown connector 'PrisKVConector'"):  # not vllm-omni's: an error
        parse_topology(yaml.safe_load(text), source="t.yaml")


def two_stages_linked_by(connector: str) -> str:
    """A stage config whose one edge, 0->1, uses `connector` (a flow mapping), defined as `link`."""
    return f"""
        stage_args:
          - {{stage_id: 0, output_connectors: {{to_stage_1: link}}}}
          - {{stage_id: 1, engine_input_source: [0]}}
        runtime:
          connectors:
            link: {connector}
    """


def test_model_settings_in_a_connectors_extra_are_accepted_with_one_warning() -> None:
    """vllm-omni keeps the edge connector's whole extra and its model code reads settings from it."""
    keys = ("crossfade_sec", "fish_speech_dac_dtype", "npu_dit_mlp_graph", "raw_tensor_shm")
    settings = "{" + ", ".join(f"{key}: 1" for key in keys) + "}"
    topo = parse(two_stages_linked_by(f"{{name: SharedMemoryConnector, extra: {settings}}}"))
    assert edges_of(topo) == [("0->1", "link")]
    named = {key: [w for w in topo.warnings if repr(key) in w] for key in keys}
    assert all(len(found) == 1 and "no effect in omni-mesh" in found[0] for found in named.values())
    assert "read by vllm-omni's GLM-TTS DiT code" in named["crossfade_sec"][0]
    message = error_of(two_stages_linked_by("{name: SharedMemoryConnector, extra: {crossfade_secs: 0.1}}"))
    assert "unknown config key 'crossfade_secs'" in message and "did you mean 'crossfade_sec'?" in message


def test_mooncake_rdma_connector_is_the_transfer_engine_connector() -> None:
    """MooncakeRDMAConnector: vllm-omni's transfer-engine connector before it was merged under its new name."""
    extra = "{role: auto, zmq_port: 50051, sender_host: auto, protocol: rdma, memory_pool_device: cpu}"
    topo = parse(two_stages_linked_by(f"{{name: MooncakeRDMAConnector, extra: {extra}}}"))
    assert edges_of(topo) == [("0->1", "link")]
    assert connector_class("MooncakeRDMAConnector") is connector_class("MooncakeTransferEngineConnector")
    assert any("sender_host" in w for w in topo.warnings) and not any("unknown" in w for w in topo.warnings)


def test_a_top_level_connectors_list_in_a_stage_config_is_ignored_with_a_warning() -> None:
    topo = parse("""
        stage_args:
          - {stage_id: 0}
          - {stage_id: 1, engine_input_source: [0], final_output: true}
        runtime:
          edges: [{from: 0, to: 1}]
        connectors:
          - {type: tensor_transfer, source_stage: 0, target_stage: 1}
    """)
    assert edges_of(topo) == [("0->1", "auto_shm_0_1")]
    (warning,) = topo.warnings
    assert warning.startswith("connectors: is a list, not a mapping") and "runtime.connectors only" in warning


def test_both_sides_naming_connectors_of_one_type_is_a_warning_in_a_stage_config() -> None:
    """vllm-omni's loader compares only the connector types of an edge's two declarations."""
    text = """
        stage_args:
          - {stage_id: 0, output_connectors: {to_stage_1: near}}
          - {stage_id: 1, final_output: true, input_connectors: {from_stage_0: far}}
        runtime:
          connectors:
            near: {name: SharedMemoryConnector, extra: {shm_threshold_bytes: 1024}}
            far: {name: SharedMemoryConnector, extra: {}}
    """
    topo = parse(text)
    assert edges_of(topo) == [("0->1", "near")]
    (warning,) = [w for w in topo.warnings if "names connector" in w]
    assert warning.endswith("'near' is used, as vllm-omni's loader does")
    other_type = text.replace("far: {name: SharedMemoryConnector", "far: {name: ZmqConnector")
    assert "names connector 'near' (SharedMemoryConnector) but" in error_of(other_type)


def test_an_unset_variable_in_an_unknown_key_is_still_an_unknown_key() -> None:
    message = error_of(two_stages_linked_by("{name: ZmqConnector, extra: {prot: $SURELY_UNSET_OMNI_MESH_VAR}}"))
    assert "connector 'link' (used by edge 0->1" in message and "'prot'" in message


def test_numeric_strings_are_read_as_numbers() -> None:
    topo = load_topology(FILES / "numeric_strings.yaml")
    assert [stage.stage_id for stage in topo.stages] == [0, 1]
    assert edges_of(topo) == [("0->1", "zmq_link")]
    assert topo.connectors["zmq_link"].extra == {
        "host": "127.0.0.1", "port": 50061, "memory_pool_size": 1073741824, "ttl_s": 30.5,
    }


def test_a_string_setting_stays_a_string() -> None:
    extra = '{host: "127.0.0.1", port: "31501", key_prefix: "42"}'
    topo = parse(two_stages_linked_by(f"{{name: YuanrongConnector, extra: {extra}}}"))
    assert topo.connectors["link"].extra == {"host": "127.0.0.1", "port": 31501, "key_prefix": "42"}


def test_edges_naming_stages_the_file_does_not_have_are_skipped() -> None:
    topo = load_topology(FILES / "edges_without_stages.yaml")
    assert [stage.stage_id for stage in topo.stages] == [0] and topo.edges == []
    to_one, from_one, no_to = topo.warnings
    assert to_one.startswith("runtime.edges[0]: to names stage 1, which is not defined")
    assert from_one.startswith("runtime.edges[1]: from names stage 1")
    assert no_to.startswith("runtime.edges[2]: an edge is a mapping") and no_to.endswith("skipped")


def test_edge_entry_keys_vllm_omni_ignores_are_ignored() -> None:
    topo = parse("""
        stage_args:
          - {stage_id: 0}
          - {stage_id: 1, final_output: true}
        runtime:
          edges: [{from: 0, to: 1, window_size: -1, max_inflight: 1, trigger: full}]
    """)
    assert edges_of(topo) == [("0->1", "auto_shm_0_1")]
    assert topo.warnings == ["runtime.edges[0]: unknown key(s) 'trigger' in edge entry (allowed: connector, from, to); ignored"]


def test_our_own_layout_stays_strict() -> None:
    own = """
        stages:
          - {stage_id: 0, handler: 'm:f'}
          - {stage_id: 1, handler: 'm:f', engine_input_source: [0]}
        edges: [{from: 1, to: 2}]
    """
    assert "edges[0]: to names stage 2, which is not defined" in error_of(own)


def test_stages_with_modes_and_no_edges() -> None:
    topo = load_topology(FILES / "modes.yaml")
    assert topo.edges == [] and [s.stage_id for s in topo.final_stages] == [0, 1]
    (warning,) = topo.warnings  # modes: is said, not dropped
    assert warning.startswith("modes: (text-to-image: stage 1 'stage_1'; image-to-text: stage 0 'stage_0')")
    assert "by default ('text-to-image') only stage 1 'stage_1'" in warning and "runs all 2 stages" in warning


def test_modes_without_the_default_mode_or_with_stages_the_file_lacks() -> None:
    topo = parse("""
        modes: [{mode: image-to-text, stages: [0, 7]}, {mode: broken}]
        stage_args: [{stage_id: 0, final_output: true}, {stage_id: 1, final_output: true}]
    """)
    (warning,) = topo.warnings
    assert "image-to-text: stage 0 'stage_0', stage 7 (not in the file)" in warning
    assert "broken" not in warning
    assert "by default every stage" in warning


def test_a_stage_whose_output_reaches_no_final_stage_is_a_warning_in_a_stage_config() -> None:
    """vllm-omni's loader checks no reachability: a stage config whose stage 1 lost its engine_input_source
    still loads there."""
    topo = parse("stage_args: [{stage_id: 0}, {stage_id: 1, final_output: true}]")
    assert topo.edges == [] and [s.stage_id for s in topo.final_stages] == [1]
    stranded, unconnected = topo.warnings
    assert stranded.startswith("stage 0 'stage_0' reaches no final stage (final: stage 1 'stage_1')")
    assert stranded.endswith("so here it is a warning") and "no edge connects the stages" in unconnected
    own = "stages: [{stage_id: 0, handler: 'm:f'}, {stage_id: 1, handler: 'm:f', final_output: true}]"
    assert "stage 0 'stage_0' reaches no final stage" in error_of(own)  # our own layout: an error


def test_a_stage_config_that_marks_no_stage_final_gets_a_warning() -> None:
    topo = parse("stage_args: [{stage_id: 0}, {stage_id: 1, engine_input_source: [0]}]")
    assert [s.stage_id for s in topo.final_stages] == [1]
    (warning,) = topo.warnings
    assert warning.startswith("no stage is marked final_output: true") and "would return nothing" in warning


def test_unconnected_stages_without_modes_get_a_warning() -> None:
    topo = parse("stage_args: [{stage_id: 0, final_output: true}, {stage_id: 1, final_output: true}]")
    (warning,) = topo.warnings
    assert "no edge connects the stages (stage 0 'stage_0', stage 1 'stage_1')" in warning
    assert "engine_input_source" in warning


def test_the_summary_prints_the_edges_and_the_warnings() -> None:
    summary = format_summary(load_topology(FILES / "unused_connectors.yaml"))
    assert "0->1  stage_0 -> stage_1  via SharedMemoryConnector [shm_link]" in summary
    assert "connectors no edge uses: threshold_shm (SharedMemoryConnector), kv_store (SomeKVConnector), " in summary
    assert "\nwarning: connector 'threshold_shm' (used by no edge)" in summary


# --------------------------------------------------------------------------------------------------
# deploy files: the graph vllm-omni keeps in code


THINKER_TALKER_CODE2WAV = [("0->1", "auto_shm_0_1"), ("1->2", "auto_shm_1_2")]


def test_qwen2_5_omni_deploy_file_gets_its_pipeline_graph() -> None:
    topo = load_topology(DEPLOY / "qwen2_5_omni.yaml")
    assert [s.name for s in topo.stages] == ["thinker", "talker", "code2wav"]
    assert edges_of(topo) == THINKER_TALKER_CODE2WAV
    assert [s.name for s in topo.entry_stages] == ["thinker"]
    assert [s.name for s in topo.final_stages] == ["thinker", "code2wav"]  # text and audio, as in vllm-omni
    assert topo.graph_from is not None and "pipeline 'qwen2_5_omni'" in topo.graph_from
    assert "the file name 'qwen2_5_omni'" in topo.graph_from
    assert topo.stage("talker").options["devices"] == "1"  # the file's settings are kept


def test_qwen3_omni_deploy_file_keeps_the_connectors_it_names() -> None:
    topo = load_topology(DEPLOY / "qwen3_omni_moe.yaml")
    assert edges_of(topo) == [("0->1", "shm"), ("1->2", "shm")]
    assert [s.name for s in topo.final_stages] == ["thinker", "code2wav"]


def test_qwen3_tts_deploy_file() -> None:
    topo = load_topology(DEPLOY / "qwen3_tts.yaml")
    assert [s.name for s in topo.stages] == ["qwen3_tts", "code2wav"]
    assert edges_of(topo) == [("0->1", "shm")]
    assert [s.name for s in topo.final_stages] == ["code2wav"]


def test_bagel_deploy_files_get_bagels_graphs() -> None:
    two = load_topology(DEPLOY / "bagel.yaml")
    assert [s.name for s in two.stages] == ["thinker", "dit"]
    assert edges_of(two) == [("0->1", "auto_shm_0_1")]
    assert [s.name for s in two.final_stages] == ["thinker", "dit"]  # text and image
    one = load_topology(DEPLOY / "bagel_single_stage.yaml")  # the longer key wins over "bagel"
    assert [s.name for s in one.stages] == ["dit"] and one.edges == []
    assert one.graph_from is not None and "pipeline 'bagel_single_stage'" in one.graph_from


def test_pipeline_key_chooses_the_graph() -> None:
    topo = load_topology(DEPLOY / "serve_two_gpus.yaml")
    assert edges_of(topo) == THINKER_TALKER_CODE2WAV
    assert topo.graph_from == "vllm-omni pipeline 'qwen3_omni_moe' (Qwen3-Omni), chosen by its pipeline: key"


def test_model_key_chooses_the_graph() -> None:
    topo = parse("model: Qwen/Qwen2.5-Omni-7B\nstages: [{stage_id: 0}, {stage_id: 2}]", name="serve")
    assert edges_of(topo) == THINKER_TALKER_CODE2WAV  # stage 1, not in the file, is still the pipeline's
    assert topo.graph_from is not None and "its model: key 'Qwen/Qwen2.5-Omni-7B'" in topo.graph_from


def test_overlay_takes_stages_connectors_and_graph_from_its_base_config() -> None:
    topo = load_topology(DEPLOY / "tts_single_gpu.yaml")
    assert edges_of(topo) == [("0->1", "shm")]
    assert topo.stage(1).options["max_num_seqs"] == 1 and topo.stage(0).options["max_num_seqs"] == 64
    assert topo.graph_from is not None and "base_config: file name 'qwen3_tts'" in topo.graph_from


def test_base_config_errors(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base_config: b.yaml\nstages: [{stage_id: 0}]\n")
    (tmp_path / "b.yaml").write_text("base_config: a.yaml\n")
    with pytest.raises(TopologyError, match="base_config: files include each other"):
        load_topology(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base_config: missing.yaml\nstages: [{stage_id: 0}]\n")
    with pytest.raises(TopologyError, match=r"base_config: 'missing.yaml': .*missing.yaml not found"):
        load_topology(tmp_path / "c.yaml")


def test_deploy_file_of_an_unknown_pipeline_is_refused_with_what_to_add() -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(DEPLOY / "unknown_model.yaml")
    message = str(info.value)
    assert "lists 2 stages (0, 1) and no edge between them" in message
    assert "no built-in graph matches 'unknown_model'" in message and "qwen3_tts" in message
    assert "engine_input_source: [<upstream stage id>]" in message and "edges: [{from: 0, to: 1}]" in message


def test_unknown_pipeline_key_is_refused() -> None:
    with pytest.raises(TopologyError, match="pipeline: 'some_image_pipeline' names a vllm-omni pipeline whose graph"):
        load_topology(DEPLOY / "unknown_pipeline.yaml")


def test_deploy_file_of_an_unknown_pipeline_with_its_own_edges_takes_them_with_a_warning() -> None:
    """A deploy file may list edges: (connector choice) and still name its pipeline: it is vllm-omni's."""
    topo = parse("""
        pipeline: some_image_pipeline
        stages:
          - {stage_id: 0, final_output: true, devices: "0"}
          - {stage_id: 1, devices: "1"}
        edges: [{from: 0, to: 1, window_size: -1, max_inflight: 1}]
    """)
    assert edges_of(topo) == [("0->1", "auto_shm_0_1")]
    declared, stranded = topo.warnings  # stage 1 reaches no marked final stage: vllm-omni does not check that
    assert declared.startswith("pipeline: 'some_image_pipeline' names a vllm-omni pipeline whose graph")
    assert "the edges are only those the file declares (edges:" in declared
    assert stranded.startswith("stage 1 'stage_1' reaches no final stage")


def test_deploy_file_edge_entries_must_be_the_pipelines() -> None:
    message = error_of("""
        pipeline: qwen3_tts
        stages: [{stage_id: 0}, {stage_id: 1}]
        edges: [{from: 1, to: 0}]
    """)
    assert "edges: declares edge 1->0, which vllm-omni's pipeline 'qwen3_tts' does not have" in message
    assert "(its edges: 0->1)" in message


def test_a_single_stage_deploy_file_needs_no_graph() -> None:
    topo = parse("stages: [{stage_id: 0, devices: '0'}]", name="some_diffusion_model")
    assert topo.edges == [] and topo.graph_from is None and topo.warnings == []


def test_connector_edges_without_a_known_pipeline_are_taken_with_a_warning() -> None:
    topo = parse("""
        stages:
          - {stage_id: 0, output_connectors: {to_stage_1: {name: SharedMemoryConnector}}}
          - {stage_id: 1}
    """, name="my_tts")
    assert edges_of(topo) == [("0->1", "inline_0_1")]
    (warning,) = topo.warnings
    assert "no built-in graph of a vllm-omni pipeline matches 'my_tts'" in warning


def test_deploy_stage_or_edge_the_pipeline_does_not_have() -> None:
    message = error_of("stages: [{stage_id: 0}, {stage_id: 3}]", name="qwen3_tts")
    assert "stage 3 is not a stage of vllm-omni's pipeline 'qwen3_tts' (stages: 0 'qwen3_tts', 1 'code2wav')" in message
    message = error_of("""
        stages:
          - {stage_id: 0, output_connectors: {to_stage_2: {name: SharedMemoryConnector}}}
          - {stage_id: 2}
    """, name="qwen3_omni_moe")
    assert "stage 0 output_connectors.to_stage_2 declares edge 0->2" in message and "(its edges: 0->1, 1->2)" in message


def test_final_output_in_a_deploy_file_is_the_pipeline_s() -> None:
    topo = parse("stages: [{stage_id: 0, final_output: true}, {stage_id: 1}]", name="qwen3_tts")
    assert [s.name for s in topo.final_stages] == ["code2wav"]
    assert topo.warnings == [
        "stage 0: final_output: True is ignored; in vllm-omni's pipeline 'qwen3_tts' the stage is not final"
    ]


@pytest.mark.parametrize("key", sorted(PIPELINES))
def test_every_built_in_graph_loads(key: str) -> None:
    graph = PIPELINES[key]
    topo = parse(f"pipeline: {key}\nstages: [{{stage_id: 0}}]")
    assert [(s.stage_id, s.name) for s in topo.stages] == [(s.stage_id, s.name) for s in graph.stages]
    assert [(e.src, e.dst) for e in topo.edges] == graph.edges
    assert {s.stage_id for s in topo.final_stages} == {s.stage_id for s in graph.stages if s.final}


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("qwen3_omni_moe_async_chunk", "qwen3_omni_moe"),
        ("Qwen/Qwen3-Omni-30B-A3B-Instruct", None),  # vllm-omni reads this one's type from its config
        ("qwen3_omni_moe_thinker_only", "qwen3_omni_moe_thinker_only"),  # the longest key wins
        ("/models/Qwen2.5-Omni-3B", "qwen2_5_omni"),
        ("Qwen3-TTS-12Hz-1.7B-Base", "qwen3_tts"),
        ("bagel_mooncake_ci", "bagel"),
        ("BAGEL-7B-MoT", "bagel"),
        ("bagel_single_stage", "bagel_single_stage"),
        ("cosyvoice3", None),
    ],
)
def test_match_pipeline(name: str, key: str | None) -> None:
    graph = match_pipeline(name)
    assert (graph.key if graph else None) == key


def test_validate_prints_the_graph_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(DEPLOY / "qwen2_5_omni.yaml")]) == 0
    out = capsys.readouterr().out
    assert "graph: from omni-mesh's built-in copy of vllm-omni pipeline 'qwen2_5_omni'" in out
    assert "0->1  thinker -> talker  via SharedMemoryConnector [auto_shm_0_1] (auto)" in out


# --------------------------------------------------------------------------------------------------
# vllm-omni's own files, where a copy of them is at hand


def _stage_configs(root: Path) -> list[Path]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and "stage_args" in data:
            found.append(path)
    return found


def test_every_vllm_omni_stage_config_validates() -> None:
    root = os.environ.get(SNAPSHOT_ENV)
    if not root:
        pytest.skip(f"{SNAPSHOT_ENV} is not set: point it at a directory of vllm-omni's YAML files to check them all")
    paths = _stage_configs(Path(root))
    if not paths:
        pytest.skip(f"{SNAPSHOT_ENV}={root} holds no stage config (a YAML file with stage_args:)")
    failures = []
    for path in paths:
        try:
            load_topology(path)
        except TopologyError as exc:
            failures.append(str(exc))
    print(f"{len(paths) - len(failures)} of {len(paths)} vllm-omni stage configs validate")
    assert not failures, "\n".join(failures)
