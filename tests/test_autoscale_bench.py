"""`omni-mesh bench autoscale` end to end (a short plan): it starts `up`, runs idle-burst-idle against a
slow autoscaled stage and reports the timeline, per-phase figures and the times to the target and back."""

from __future__ import annotations

import json
import subprocess

from support.meshkit import OMNI_MESH


def test_bench_autoscale_reports_the_whole_cycle() -> None:
    flags = ["--max-replicas", "2", "--concurrency", "6", "--idle-s", "1", "--burst-s", "5",
             "--upscale-delay-s", "0.5", "--downscale-delay-s", "1", "--tail-s", "40", "--json"]
    result = subprocess.run([str(OMNI_MESH), "bench", "autoscale", *flags], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["failed"] == 0 and report["requests"] > 0
    assert report["peak_target"] == 2
    assert report["back_to_min_s"] is not None and report["back_to_min_s"] >= 0.75  # the 1 s delay, less a tick
    assert set(report["phases"]) == {"idle", "burst", "calm"}
    burst = report["phases"]["burst"]
    assert 100 <= burst["p50_ms"] <= burst["p99_ms"]  # the stage waits 100 ms per request
    assert report["phases"]["idle"]["requests"] == 0
    assert [row["phase"] for row in report["timeline"]][0] == "idle"
    assert max(row["target"] for row in report["timeline"]) == 2
