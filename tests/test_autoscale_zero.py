"""Scale to zero under `omni-mesh up`, with real processes: a stage at `min_replicas: 0` goes to zero
replicas once idle for its downscale delay; /ready then says it is scaled to zero (200, not broken);
the next request waits, within its deadline, while a replica starts, and succeeds; the cold start is
reported (its time in /v1/stages, a log line); `omni-mesh status` and the dashboard show each stage's target."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from support.browser import rendered
from support.meshkit import OMNI_MESH, running_mesh, wait_for

pytestmark = pytest.mark.usefixtures("no_segment_left")

HANDLER = "omni_mesh.bench.autoscale_handlers:wait"
TOPOLOGY = {
    "name": "autoscale-zero",
    "stages": [
        {"stage_id": 0, "name": "front", "handler": HANDLER},
        {
            "stage_id": 1, "name": "idle", "handler": HANDLER, "engine_input_source": [0],
            "autoscale": {"min_replicas": 0, "max_replicas": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 1.0},
        },
    ],
}


def test_an_idle_stage_goes_to_zero_and_the_next_request_starts_it(tmp_path: Path) -> None:
    with running_mesh(tmp_path, TOPOLOGY) as mesh:

        def idle() -> dict | None:
            stage = next(s for s in mesh.client.get("/v1/stages").json()["stages"] if s["name"] == "idle")
            return stage if stage["replicas"] == [] and stage["target_replicas"] == 0 else None

        stage = wait_for(idle, 30.0, "stage idle at zero replicas", interval_s=0.2)
        assert stage["autoscale"]["scaled_to_zero"] is True and stage["current_replicas"] == 0
        ready = mesh.ready()
        assert ready.status_code == 200, ready.text
        assert ready.json()["scaled_to_zero"] == ["idle"]
        assert "omni_mesh_stage_target_replicas{stage=\"idle\"} 0.0" in mesh.client.get("/metrics").text

        start = time.monotonic()
        answer = mesh.ok({}, params={"delay_s": 0.05}, timeout_s=60.0)
        cold = time.monotonic() - start
        assert answer["outputs"]["replica"].startswith("idle-")

        def reported() -> float | None:  # the autoscaler sees the new replica at its next tick (0.25 s)
            stage = next(s for s in mesh.client.get("/v1/stages").json()["stages"] if s["name"] == "idle")
            return stage["autoscale"]["cold_start_s"]

        took = wait_for(reported, 5.0, "the cold start reported")
        assert 0 < took <= cold + 0.5, (took, cold)
        assert "autoscale: idle 0 -> 1: 1 ongoing" in mesh.log()
        assert "autoscale: idle cold start" in mesh.log()
        mesh.remember_tree()
        status = subprocess.run([str(OMNI_MESH), "status", mesh.url], capture_output=True, text=True, timeout=60)
        assert re.search(r"^idle\s+\d/\d\s+[01]\*", status.stdout, re.M), status.stdout + status.stderr
        assert re.search(r"^front\s+1/1\s+1\s", status.stdout, re.M), status.stdout
        dom = rendered(f"{mesh.url}/dashboard")  # the dashboard shows now -> target (min-max)
        assert re.search(r'data-stage="idle".*?<td>[01] → [01] \(0-2\)</td>', dom, re.S), dom[-3000:]
        # Idle again: back to zero, and what its replica held is gone with it (Mesh.stop checks /dev/shm).
        wait_for(idle, 30.0, "stage idle back at zero replicas", interval_s=0.2)
        print(f"\ncold start: {cold:.2f} s for the request, {took:.2f} s reported by the autoscaler")
