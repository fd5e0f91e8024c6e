"""A load that oscillates around the target does not make the autoscaler flap, with real processes
under `omni-mesh up`: 3 and 5 closed-loop clients by turns, 4 s each, around the 4 ongoing that 2
replicas carry at 2 per replica, slower than both delays (1 s up, 2 s down). Each period used to take
the stage down to 2 and back up to 3 (a drain and a process start every 8 s); now, after a flap or
two, its downscale delay outlasts the lulls and it stays up. No request fails meanwhile."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from support.loadkit import Load
from support.meshkit import running_mesh

pytestmark = pytest.mark.usefixtures("no_segment_left")

HANDLER = "omni_mesh.bench.autoscale_handlers:wait"
TOPOLOGY = {
    "name": "autoscale-oscillation",
    "stages": [
        {"stage_id": 0, "name": "a", "handler": HANDLER, "max_inflight": 4,
         "autoscale": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2,
                       "upscale_delay_s": 1, "downscale_delay_s": 2}},
    ],
}
PERIODS, HALF_S = 7, 4.0


def test_a_load_oscillating_around_the_target_does_not_flap(tmp_path: Path) -> None:
    body = {"inputs": {}, "params": {"delay_s": 0.5}, "timeout_s": 30}
    with running_mesh(tmp_path, TOPOLOGY, "--max-replicas-total", "6") as mesh:
        base = Load(mesh.url, body, clients=3).start()
        extras = []
        try:
            for _ in range(PERIODS):
                extras.append(Load(mesh.url, body, clients=2).start())
                time.sleep(HALF_S)
                extras[-1].stop()
                time.sleep(HALF_S)
        finally:
            base.stop()
            for extra in extras:
                extra.stop()
        log = mesh.log()
    moves = re.findall(r"autoscale: a (\d+) -> (\d+)", log)
    downs = [move for move in moves if int(move[1]) < int(move[0])]
    assert len(downs) <= 3, moves  # one a period (7) before
    assert "went back up" in log and "before scaling down" in log, moves
    failed = [d for load in (base, *extras) for d in load.failed()]
    assert failed == [], failed[:3]
