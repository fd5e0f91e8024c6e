"""`autoscale:` in the topology and where it goes besides `omni-mesh up`:

- the section is read with Ray Serve's names, in a stage or in `defaults:` (the stage's keys win, key by
  key); `replicas:` is the starting count (min_replicas when left out); bad combinations and unknown
  keys are refused naming the stage and the key; the JSON Schema knows the section;
- `omni-mesh export k8s` derives each pod's HorizontalPodAutoscaler from it (schema-valid for the
  current Kubernetes release): min and max, the ongoing-requests target, the delays as stabilization
  windows; scale to zero becomes minReplicas 1 with a warning;
- `omni-mesh export compose` ignores it with a note in the file and on stderr.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.servicekit import OMNI_MESH, REPO

from omni_mesh.export import ImageSource, K8sOptions, export_compose, export_k8s
from omni_mesh.export.compose import ComposeOptions
from omni_mesh.launcher_scale import default_host_cap, host_cap
from omni_mesh.topology import TopologyError, load_topology
from omni_mesh.topology.schema import json_schema

K8S_VERSION = kubernetes_validate.utils.latest_version()


def _file(tmp_path: Path, topology: dict) -> Path:
    """`topology` as compose/t.yaml in a build context of our own (with services/Dockerfile)."""
    (tmp_path / "compose").mkdir(exist_ok=True)
    (tmp_path / "services").mkdir(exist_ok=True)
    shutil.copy2(REPO / "services" / "Dockerfile", tmp_path / "services" / "Dockerfile")
    path = tmp_path / "compose" / "t.yaml"
    path.write_text(yaml.safe_dump(topology, sort_keys=False))
    return path


def _stages(*stages: dict, **top: object) -> dict:
    chained = [{"stage_id": i, "name": f"s{i}", "handler": "m:f", **s} for i, s in enumerate(stages)]
    for i, stage in enumerate(chained[1:], 1):
        stage.setdefault("engine_input_source", [i - 1])
    return {"name": "scaled", **top, "stages": chained}


def test_the_section_merges_defaults_and_sets_the_starting_count(tmp_path: Path) -> None:
    topology = load_topology(_file(tmp_path, _stages(
        {"autoscale": {"min_replicas": 0, "max_replicas": 4}},
        {"autoscale": {"min_replicas": 2, "max_replicas": 5, "upscale_delay_s": 1}},
        {"replicas": 3, "autoscale": {"max_replicas": 3}},
        {},
        defaults={"autoscale": {"max_replicas": 2, "target_ongoing_requests": 3, "upscale_delay_s": 7,
                                "downscale_delay_s": 9}},
    )))
    s0, s1, s2, s3 = topology.stages
    assert (s0.replicas, s0.autoscale.min_replicas, s0.autoscale.max_replicas) == (1, 0, 4)
    assert (s0.autoscale.target_ongoing_requests, s0.autoscale.upscale_delay_s, s0.autoscale.downscale_delay_s) == (3, 7, 9)
    assert (s1.replicas, s1.autoscale.upscale_delay_s, s1.autoscale.downscale_delay_s) == (2, 1, 9)
    assert (s2.replicas, s2.autoscale.min_replicas) == (3, 1)
    assert (s3.replicas, s3.autoscale.min_replicas, s3.autoscale.max_replicas) == (1, 1, 2)  # defaults alone
    assert topology.to_dict()["stages"][1]["autoscale"]["min_replicas"] == 2
    # A stage that scales keeps a queue sized for its most replicas (it is what scaling reads).
    assert s0.queue_limit() == 4 * 4 * s0.max_inflight


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ({"autoscale": {"min_replicas": 5, "max_replicas": 4}},
         "stage 0 's0': autoscale.min_replicas 5 is above autoscale.max_replicas 4"),
        ({"autoscale": {"min_replicas": 1}}, "stage 0 's0': autoscale needs max_replicas"),
        ({"replicas": 6, "autoscale": {"max_replicas": 4}},
         "stage 0 's0': replicas 6 (the starting count) must lie within autoscale.min_replicas 1 and "
         "autoscale.max_replicas 4"),
        ({"replicas": 1, "autoscale": {"min_replicas": 2, "max_replicas": 4}}, "replicas 1 (the starting count)"),
        ({"autoscale": {"max_replicas": 4, "target_ongoing_requests": 0}},
         "stage 0 's0': autoscale.target_ongoing_requests: input should be greater than 0"),
        ({"autoscale": {"max_replicas": 4, "upscale_delay_s": -1}}, "autoscale.upscale_delay_s: input should be"),
        ({"autoscale": {"max_replica": 4}}, "stage 0 's0': autoscale: unknown key 'max_replica'; did you mean 'max_replicas'?"),
        ({"autoscale": {"max_replicas": 0}}, "autoscale.max_replicas: input should be greater than or equal to 1"),
        ({"autoscale": 4}, "stage 0 's0': autoscale must be a mapping"),
        ({"max_queued": 0, "autoscale": {"min_replicas": 0, "max_replicas": 2}},
         "stage 0 's0': autoscale.min_replicas 0 (scale to zero) with max_queued 0"),
    ],
)
def test_bad_combinations_are_refused_naming_stage_and_key(tmp_path: Path, stage: dict, message: str) -> None:
    with pytest.raises(TopologyError) as caught:
        load_topology(_file(tmp_path, _stages(stage)))
    assert message in str(caught.value)


def test_a_bad_default_is_refused_naming_defaults(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"defaults.autoscale.min_replicas: input should be greater than or equal to 0"):
        load_topology(_file(tmp_path, _stages({}, defaults={"autoscale": {"min_replicas": -1, "max_replicas": 2}})))


def test_the_json_schema_knows_the_section() -> None:
    schema = json_schema()
    section = schema["$defs"]["AutoscaleSection"]
    assert set(section["properties"]) == {
        "min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s",
    }
    assert section["additionalProperties"] is False
    assert "autoscale" in schema["$defs"]["Stage"]["properties"] and "autoscale" in schema["$defs"]["Defaults"]["properties"]


def test_k8s_hpas_follow_autoscale(tmp_path: Path) -> None:
    link = {"link": {"name": "ZmqConnector", "extra": {"host": "auto"}}}
    topology = _stages(
        {"replicas": 2, "autoscale": {"min_replicas": 1, "max_replicas": 6, "target_ongoing_requests": 1.5,
                                      "upscale_delay_s": 4, "downscale_delay_s": 90},
         "output_connectors": {"to_stage_1": "link"}},
        {"autoscale": {"min_replicas": 0, "max_replicas": 3}, "input_connectors": {"from_stage_0": "link"},
         "output_connectors": {"to_stage_2": "link"}},
        {"input_connectors": {"from_stage_1": "link"}},
        connectors=link,
    )
    loaded = load_topology(_file(tmp_path, topology))
    exported = export_k8s(loaded, ImageSource.find(loaded), K8sOptions())
    documents = list(yaml.safe_load_all(exported.text))
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    hpas = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "HorizontalPodAutoscaler"}
    deployments = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "Deployment"}
    s0, s1, s2 = hpas["scaled-s0"], hpas["scaled-s1"], hpas["scaled-s2"]
    assert deployments["scaled-s0"]["replicas"] == 2  # the starting count
    assert (s0["minReplicas"], s0["maxReplicas"]) == (1, 6)
    assert s0["metrics"] == [{"type": "External", "external": {
        "metric": {"name": "omni_mesh_stage_ongoing_requests", "selector": {"matchLabels": {"stage": "s0"}}},
        "target": {"type": "AverageValue", "averageValue": "1500m"}}}]
    assert s0["behavior"] == {"scaleUp": {"stabilizationWindowSeconds": 4}, "scaleDown": {"stabilizationWindowSeconds": 90}}
    assert (s1["minReplicas"], s1["maxReplicas"]) == (1, 3)  # 0 cannot be said to a plain HPA
    assert s1["metrics"][0]["external"]["target"]["averageValue"] == "2"
    assert any("s1: min_replicas 0 (scale to zero) becomes minReplicas 1" in w for w in exported.warnings)
    # A stage without autoscale: keeps the queue-based HPA.
    assert s2["metrics"][0]["external"]["metric"]["name"] == "omni_mesh_stage_queued_requests"
    assert (s2["minReplicas"], s2["maxReplicas"]) == (1, 4)


def test_compose_ignores_autoscale_with_a_note(tmp_path: Path) -> None:
    path = _file(tmp_path, _stages({"replicas": 2, "autoscale": {"max_replicas": 4}}, {}))
    loaded = load_topology(path)
    exported = export_compose(loaded, ImageSource.find(loaded), None, ComposeOptions())
    assert "Autoscaling: compose cannot start containers by itself, so the autoscale: section of s0" in " ".join(
        line.lstrip("# ") for line in exported.text.splitlines()
    )
    assert yaml.safe_load(exported.text)["services"]["s0"]["scale"] == 2
    result = subprocess.run([str(OMNI_MESH), "export", "compose", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "autoscale: section of s0 is ignored here" in result.stderr


def test_validate_prints_the_section(tmp_path: Path) -> None:
    path = _file(tmp_path, _stages({"autoscale": {"min_replicas": 0, "max_replicas": 4, "upscale_delay_s": 1}}))
    result = subprocess.run([str(OMNI_MESH), "validate", str(path)], capture_output=True, text=True, timeout=60)
    # (its handler m:f does not import here: validate says so after the summary)
    assert "autoscale=0-4 (target 2 ongoing, delays 1/60 s)" in result.stdout, result.stdout


def test_the_host_cap_of_up(tmp_path: Path) -> None:
    topology = load_topology(_file(tmp_path, _stages({"replicas": 2, "autoscale": {"max_replicas": 4}}, {})))
    assert host_cap(topology, None) == max(default_host_cap(), 3)
    assert host_cap(topology, 5) == 5
    with pytest.raises(ValueError, match=r"--max-replicas-total 2 is below the 3 replicas the topology starts with \(s0: 2, s1: 1\)"):
        host_cap(topology, 2)
    result = subprocess.run([str(OMNI_MESH), "up", str(tmp_path / "compose" / "t.yaml"), "--max-replicas-total", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--max-replicas-total 2 is below the 3 replicas" in result.stderr, result.stderr
