"""`omni-mesh validate`, run as users run it: the installed console script in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_mesh.cli import main
from omni_mesh.topology import load_topology

TOPOLOGIES = Path(__file__).parent / "topologies"
REPO = Path(__file__).resolve().parents[1]
OMNI_MESH = Path(sys.executable).with_name("omni-mesh")  # the console script next to this venv's python


@pytest.fixture(autouse=True)
def model(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """OMNI_MESH_MODEL, which vllm-omni's stage configs leave to the command line: a directory with a
    Qwen2.5-Omni config (validate reads the config, never the weights)."""
    directory = tmp_path_factory.mktemp("model")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    monkeypatch.setenv("OMNI_MESH_MODEL", str(directory))
    return directory


def omni_mesh(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert OMNI_MESH.exists(), f"{OMNI_MESH} missing: install the package (pip install -e .)"
    return subprocess.run(
        [str(OMNI_MESH), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_validate_good_file_prints_a_summary(tmp_path: Path) -> None:
    result = omni_mesh("validate", TOPOLOGIES / "demo.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert "topology 'qwen-omni-demo' is valid" in out
    assert "0  thinker  replicas=2 max_inflight=4  handler=topology_demo_handlers:thinker  [entry]" in out
    assert "2  code2wav  replicas=1 max_inflight=8  handler=-  [final]" in out
    assert "0->1  thinker -> talker  via SharedMemoryConnector [shm]\n" in out
    assert "1->2  talker -> code2wav  via SharedMemoryConnector [auto_shm_1_2] (auto)" in out
    assert "no handler: 1 'talker', 2 'code2wav'" in out and "`omni-mesh up` needs" in out


def test_validate_vllm_omni_file(tmp_path: Path) -> None:
    result = omni_mesh("validate", TOPOLOGIES / "vllm_omni_connectors.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "0->1  stage_0 -> stage_1  via SharedMemoryConnector [payload_link]" in result.stdout
    assert "(auto)" not in result.stdout


def test_validate_json(tmp_path: Path) -> None:
    result = omni_mesh("validate", "--json", TOPOLOGIES / "vllm_omni_three_stage.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data == load_topology(TOPOLOGIES / "vllm_omni_three_stage.yaml").to_dict()
    assert [(e["label"], e["auto"]) for e in data["edges"]] == [("0->1", True), ("1->2", True)]


def test_validate_bad_file_exits_2_with_the_error(tmp_path: Path) -> None:
    path = TOPOLOGIES / "bad_cycle.yaml"
    result = omni_mesh("validate", path, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: the stages form a cycle 1->2->1")
    assert "stage 1 'talker'" in result.stderr and "Traceback" not in result.stderr


def test_validate_bad_yaml_names_the_line(tmp_path: Path) -> None:
    result = omni_mesh("validate", TOPOLOGIES / "bad_yaml.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {TOPOLOGIES / 'bad_yaml.yaml'}:6:")


def test_validate_missing_file(tmp_path: Path) -> None:
    result = omni_mesh("validate", "nowhere.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: nowhere.yaml: topology file not found; check the path\n"


def test_no_subcommand_is_a_usage_error(tmp_path: Path) -> None:
    result = omni_mesh(cwd=tmp_path)
    assert result.returncode == 2
    assert "usage: omni-mesh" in result.stderr and "validate" in result.stderr


def test_main_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    complete = tmp_path / "complete.yaml"
    complete.write_text("stages:\n  - {stage_id: 0, name: only, handler: 'pkg.mod:run'}\n")
    assert main(["validate", "--no-import", str(complete)]) == 0  # pkg.mod is made up: check the file only
    out = capsys.readouterr().out
    assert "topology 'complete' is valid" in out
    assert "edges (0):\n  (none)" in out
    assert "no handler" not in out
    assert main(["validate", str(tmp_path / "absent.yaml")]) == 2
    assert "topology file not found" in capsys.readouterr().err


VLLM_OMNI = TOPOLOGIES / "vllm_omni"


def test_validate_prints_warnings_and_still_passes(tmp_path: Path) -> None:
    result = omni_mesh("validate", VLLM_OMNI / "unused_connectors.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "connectors no edge uses: threshold_shm (SharedMemoryConnector)" in result.stdout
    assert "\nwarning: connector 'kv_store' (used by no edge): unknown connector 'SomeKVConnector'" in result.stdout


def test_validate_deploy_file_prints_the_pipeline_graph(tmp_path: Path) -> None:
    result = omni_mesh("validate", VLLM_OMNI / "deploy" / "qwen3_tts.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "graph: from omni-mesh's built-in copy of vllm-omni pipeline 'qwen3_tts' (Qwen3-TTS)" in result.stdout
    assert "0->1  qwen3_tts -> code2wav  via SharedMemoryConnector [shm]" in result.stdout
    result = omni_mesh("validate", "--json", VLLM_OMNI / "deploy" / "qwen3_tts.yaml", cwd=tmp_path)
    assert json.loads(result.stdout)["graph_from"].startswith("vllm-omni pipeline 'qwen3_tts'")


def test_validate_refuses_a_deploy_file_without_a_graph(tmp_path: Path) -> None:
    result = omni_mesh("validate", VLLM_OMNI / "deploy" / "unknown_model.yaml", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "no edge between them" in result.stderr and "set pipeline:" in result.stderr.lower()


def test_validate_imports_handlers_and_names_the_ones_that_fail(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: handlers\nstages:\n"
        "  - {stage_id: 0, name: good, handler: 'services.noop:passthrough'}\n"
        "  - {stage_id: 1, name: bad, handler: 'nosuchmodule:fn', engine_input_source: [0]}\n"
    )
    result = omni_mesh("validate", path, cwd=REPO)
    assert result.returncode == 2
    assert "handlers: 1 of 2 import" in result.stdout
    assert "stage 'bad': cannot load handler 'nosuchmodule:fn'" in result.stderr
    skipped = omni_mesh("validate", "--no-import", path, cwd=REPO)
    assert skipped.returncode == 0, skipped.stderr


def test_validate_names_the_vllm_omni_settings_that_have_no_effect(tmp_path: Path, model: Path) -> None:
    """devices, gpu_memory_utilization & co. are vLLM's placement: here each is named, per stage."""
    result = omni_mesh("validate", TOPOLOGIES / "vllm_omni_three_stage.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "no effect here" in line]
    thinker, talker, code2wav = warnings
    assert thinker.startswith("warning: stage 0 'stage_0': ")
    assert "runtime.devices, engine_args.gpu_memory_utilization, engine_args.tensor_parallel_size " in thinker
    assert "custom_process_input_func" in talker and "default_sampling_params.stop_token_ids" in talker
    assert "temperature" not in talker  # the talker takes it
    assert code2wav.startswith("warning: stage 2 'stage_2': ") and "runtime.devices" in code2wav
    # the thinker takes vLLM's sampling from default_sampling_params as its engine defaults
    config = tmp_path / "sampling.yaml"
    config.write_text(
        "stage_args:\n"
        "  - stage_id: 0\n"
        f"    engine_args: {{model_stage: thinker, model: {model}, max_model_len: 512}}\n"
        "    final_output: true\n"
        "    default_sampling_params: {temperature: 0.0, top_k: -1, seed: 42, detokenize: true,\n"
        "                              repetition_penalty: 1.1, stop: [\"\\n\\n\"], stop_token_ids: [7]}\n"
    )
    result = omni_mesh("validate", config, cwd=tmp_path)
    assert result.returncode == 0 and "no effect" not in result.stdout, result.stdout + result.stderr
    engine = load_topology(config).stages[0].engine
    assert (engine["top_k"], engine["seed"], engine["repetition_penalty"]) == (-1, 42, 1.1)
    assert (engine["stop"], engine["stop_token_ids"], engine["max_model_len"]) == (["\n\n"], [7], 512)


def test_validate_checks_each_engines_model_and_names_the_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = TOPOLOGIES / "vllm_omni_three_stage.yaml"
    monkeypatch.delenv("OMNI_MESH_MODEL")
    result = omni_mesh("validate", path, cwd=tmp_path)
    assert result.returncode == 2
    errors = result.stderr.splitlines()
    assert errors[0] == (
        "error: stage 0 'stage_0': engine.model: model '${OMNI_MESH_MODEL}': environment variable "
        "OMNI_MESH_MODEL is not set"
    )
    assert len(errors) == 3 and errors[2].startswith("error: stage 2 'stage_2': ")
    monkeypatch.setenv("OMNI_MESH_MODEL", str(tmp_path / "absent"))
    result = omni_mesh("validate", path, cwd=tmp_path)
    assert result.returncode == 2 and f"{tmp_path / 'absent'} is not a directory" in result.stderr
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv("OMNI_MESH_MODEL", str(tmp_path / "llama"))
    result = omni_mesh("validate", path, cwd=tmp_path)
    assert result.returncode == 2 and "model_type 'llama' has no engine here" in result.stderr
    assert omni_mesh("validate", "--no-import", path, cwd=tmp_path).returncode == 0  # the file alone
