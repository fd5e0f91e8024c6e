"""Autoscaling under `omni-mesh up`, the whole cycle, with real processes: a stage that waits 100 ms per
request, one request per replica at a time (`min_replicas: 1, max_replicas: 4,
target_ongoing_requests: 2`), under 16 closed-loop clients, goes to 4 replicas within its upscale
delay plus the replicas' start, serves at least 3.5x what one replica served, and goes back to 1
within its downscale delay plus the drain once the clients stop; no request fails across the cycle,
and `up` leaves no process and nothing in /dev/shm (Mesh.stop checks). The decisions are visible:
/v1/stages, /metrics, and one log line per decision saying why.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from support.loadkit import Load, Sampler
from support.meshkit import running_mesh, wait_for

pytestmark = pytest.mark.usefixtures("no_segment_left")

UP_S, DOWN_S = 3.0, 2.0
#: A replica's start (a Python process importing torch, registering) on a loaded 2-core machine.
START_S = 40.0
DRAIN_S = 10.0  # a replica finishing its one request, deregistering and exiting, on a loaded machine
HANDLER = "omni_mesh.bench.autoscale_handlers:wait"
TOPOLOGY = {
    "name": "autoscale-cycle",
    "stages": [
        {
            "stage_id": 0, "name": "a", "handler": HANDLER, "max_inflight": 1,
            "autoscale": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2,
                          "upscale_delay_s": UP_S, "downscale_delay_s": DOWN_S},
        },
        # A fast final stage behind a shared-memory edge: scaling `a` down must leave nothing behind.
        {"stage_id": 1, "name": "d", "handler": HANDLER, "engine_input_source": [0], "max_inflight": 32},
    ],
}
BODY = {"inputs": {}, "params": {"delay_s": {"a": 0.1}, "bytes": 20_000}, "timeout_s": 60}


def test_a_stage_follows_a_step_load_up_and_back_down(tmp_path: Path) -> None:
    with running_mesh(tmp_path, TOPOLOGY, "--max-replicas-total", "8") as mesh:
        sampler = Sampler(mesh.url).start()
        load = Load(mesh.url, BODY, clients=16).start()
        began = time.monotonic()
        try:
            four = wait_for(lambda: sampler.first("a", lambda c, t, r: c == 4), UP_S + START_S, "4 replicas of a")
            one_end = sampler.first("a", lambda c, t, r: c > 1) or four  # one replica served until then
            assert one_end - began >= 1.5, "the stage scaled up long before its upscale delay"
            one_rate = load.rate(began + 0.5, one_end)
            time.sleep(1.0)
            window = time.monotonic()
            time.sleep(4.0)
            four_rate = load.rate(window, time.monotonic())
            stages = mesh.client.get("/v1/stages").json()["stages"]
            metrics = mesh.client.get("/metrics").text
        finally:
            load.stop()
        stopped = time.monotonic()
        back = wait_for(lambda: sampler.first("a", lambda c, t, r: r == 1 and t == 1, since=stopped),
                        DOWN_S + 20.0, "a back to 1 replica")
        sampler.stop()
        # Decided within the delay (plus the clients' ramp and a few ticks), acted on within a start.
        decided_up = sampler.first("a", lambda c, t, r: t == 4)
        assert decided_up is not None and decided_up - began <= UP_S + 2.5, decided_up - began
        assert four - decided_up <= START_S
        decided_down = sampler.first("a", lambda c, t, r: t == 1, since=stopped)
        assert decided_down is not None and decided_down - stopped <= DOWN_S + 1.5, decided_down - stopped
        assert back - decided_down <= DRAIN_S
        assert four_rate >= 3.5 * one_rate, (one_rate, four_rate)
        assert load.failed() == [], load.failed()[:3]
        a = next(s for s in stages if s["name"] == "a")
        assert a["target_replicas"] == 4 and a["autoscale"]["max_replicas"] == 4, a
        assert a["autoscale"]["reason"].endswith("target 2 per replica"), a["autoscale"]
        assert 'omni_mesh_stage_target_replicas{stage="a"} 4.0' in metrics
        log = mesh.log()
        # One line per decision, saying why (the way up may pass through 2 or 3, as the clients ramp).
        assert re.search(r"autoscale: a [123] -> 4: \d+ ongoing, target 2 per replica", log), log[-3000:]
        assert re.search(r"autoscale: a [234] -> 1: \d+ ongoing, target 2 per replica", log), log[-3000:]
        print(f"\none replica: {one_rate:.1f}/s, four: {four_rate:.1f}/s (x{four_rate / one_rate:.2f}); "
              f"target 4 after {decided_up - began:.1f} s, 4 replicas after {four - began:.1f} s; target 1 "
              f"{decided_down - stopped:.1f} s and 1 replica {back - stopped:.1f} s after the load stopped; "
              f"{len(load.done)} requests, 0 failed")
