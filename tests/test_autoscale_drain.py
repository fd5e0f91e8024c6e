"""Scale-down never fails an in-flight request, with real processes under `omni-mesh up`: a replica the
autoscaler retires while it works on a request longer than any fixed drain grace (30 s) finishes it,
within the request's own deadline, and only then exits; nothing is left (Mesh.stop, no_segment_left)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.meshkit import Mesh, running_mesh, wait_for

pytestmark = pytest.mark.usefixtures("no_segment_left")

HANDLER = "omni_mesh.bench.autoscale_handlers:wait"
WORK_S = 50.0  # the drain starts some 12 s after the coordinator; a 30 s grace (the old drain) ended at ~42 s
DOWN_S = 12.0  # time for the mesh to start and both replicas to take a request before the target moves
TOPOLOGY = {
    "name": "autoscale-drain",
    "stages": [
        # Two replicas, one request each at a time: two requests put one on each, and 2 ongoing at
        # 2 per replica asks for 1 replica, so one of the two busy replicas is retired (both are
        # equally busy: the least busy one goes first).
        {"stage_id": 0, "name": "a", "handler": HANDLER, "replicas": 2, "max_inflight": 1,
         "autoscale": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                       "upscale_delay_s": 0.5, "downscale_delay_s": DOWN_S}},
        {"stage_id": 1, "name": "d", "handler": HANDLER, "engine_input_source": [0]},
    ],
}


def test_a_retired_replica_finishes_a_request_longer_than_the_drain_grace(tmp_path: Path) -> None:
    body = {"inputs": {}, "params": {"delay_s": {"a": WORK_S}}, "timeout_s": WORK_S + 30}
    with running_mesh(tmp_path, TOPOLOGY) as mesh:
        assert _stage(mesh, "a")["target_replicas"] == 2, "the mesh took too long to start: a already scaled down"
        with ThreadPoolExecutor(2) as pool:
            sent = time.monotonic()
            answers = [pool.submit(mesh.request, {}, params=body["params"], timeout_s=body["timeout_s"])
                       for _ in range(2)]
            wait_for(lambda: [r["inflight"] for r in mesh.stages()["a"]] == [1, 1], 10.0, "one request on each of a")
            wait_for(lambda: [r for r in mesh.stages()["a"] if r["health"] == "draining" and r["inflight"] == 1],
                     DOWN_S + 20.0, "a busy replica of a draining")
            mesh.remember_tree()
            responses = [a.result(timeout=body["timeout_s"] + 10) for a in answers]
        took = time.monotonic() - sent
        assert [r.status_code for r in responses] == [200, 200], [r.text[:300] for r in responses]
        assert took >= WORK_S
        wait_for(lambda: len(mesh.stages()["a"]) == 1 and "drained and stopped" in mesh.log(), 20.0,
                 "a at 1 replica, the retired one drained and stopped")


def _stage(mesh: Mesh, name: str) -> dict:
    return next(s for s in mesh.client.get("/v1/stages").json()["stages"] if s["name"] == name)
