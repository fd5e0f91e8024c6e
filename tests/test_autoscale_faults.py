"""Autoscaling when things go wrong, with real processes under `omni-mesh up`:

- a replica SIGKILLed while its stage scales up, and another while it scales down: every request
  succeeds or fails cleanly (an error naming the stage) by its deadline, the autoscaler converges back
  to its minimum, and nothing is left (processes, /dev/shm: Mesh.stop and no_segment_left check);
- the host cap holds: two stages under load never run more replica processes together than
  `--max-replicas-total`, and the stage held back says so.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support.loadkit import Load, Sampler
from support.meshkit import Mesh, running_mesh, wait_for

from omni_mesh.procinfo import descendants

pytestmark = pytest.mark.usefixtures("no_segment_left")

HANDLER = "omni_mesh.bench.autoscale_handlers:wait"
FAST = {"upscale_delay_s": 0.5, "downscale_delay_s": 1.5}


def stage_processes(mesh: Mesh) -> dict[str, list[int]]:
    """{stage: pids} of the replica processes `up` runs now (from /proc, not from the coordinator)."""
    out: dict[str, list[int]] = {}
    for pid in descendants(mesh.process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"stage" in argv and b"--stage" in argv:
            out.setdefault(argv[argv.index(b"--stage") + 1].decode(), []).append(pid)
    return out


def test_replicas_killed_while_scaling_up_and_down(tmp_path: Path) -> None:
    topology = {
        "name": "autoscale-kill",
        "stages": [
            {"stage_id": 0, "name": "a", "handler": HANDLER, "max_inflight": 1,
             "autoscale": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1, **FAST}},
            {"stage_id": 1, "name": "d", "handler": HANDLER, "engine_input_source": [0], "max_inflight": 32},
        ],
    }
    body = {"inputs": {}, "params": {"delay_s": {"a": 0.2}, "bytes": 20_000}, "timeout_s": 20}
    with running_mesh(tmp_path, topology, "--max-replicas-total", "6") as mesh:
        load = Load(mesh.url, body, clients=6).start()
        try:
            # Scaling up: kill the first new replica as soon as it registers.
            up = wait_for(lambda: len(mesh.stages()["a"]) >= 2, 60.0, "a second replica of a")
            assert up
            mesh.remember_tree()
            victim = min(mesh.stages()["a"], key=lambda r: r["uptime_s"])  # the newest
            os.kill(victim["pid"], signal.SIGKILL)
            wait_for(lambda: len(mesh.stages()["a"]) == 3, 60.0, "a at 3 replicas again after the kill")
            mesh.remember_tree()
        finally:
            load.stop()
        # Scaling down: kill one of the replicas as it drains.
        draining = wait_for(
            lambda: [r for r in mesh.stages()["a"] if r["health"] == "draining"], 30.0, "a draining replica",
            interval_s=0.02,
        )
        os.kill(draining[0]["pid"], signal.SIGKILL)
        wait_for(lambda: len(mesh.stages()["a"]) == 1 and len(stage_processes(mesh).get("a", [])) == 1,
                 30.0, "a back at 1 replica")
        stage = next(s for s in mesh.client.get("/v1/stages").json()["stages"] if s["name"] == "a")
        assert stage["target_replicas"] == 1 and stage["current_replicas"] == 1, stage
        late = [d for d in load.done if d.latency_s > body["timeout_s"] + 5]
        assert late == [], late[:3]
        unclean = [d for d in load.failed() if d.status not in (502, 504) or "stage" not in d.body]
        assert unclean == [], unclean[:3]
        assert mesh.ok({}, params={"delay_s": 0.01})["outputs"]["replica"].startswith("d-")
        print(f"\n{len(load.done)} requests: {len(load.done) - len(load.failed())} ok, "
              f"{len(load.failed())} failed cleanly: {sorted({d.status for d in load.failed()})}")


def test_the_host_cap_bounds_every_stage_together(tmp_path: Path) -> None:
    scale = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 1, **FAST}
    topology = {
        "name": "autoscale-cap",
        "stages": [
            {"stage_id": 0, "name": "a", "handler": HANDLER, "max_inflight": 1, "autoscale": scale},
            {"stage_id": 1, "name": "b", "handler": HANDLER, "engine_input_source": [0], "max_inflight": 1,
             "autoscale": scale, "final_output": True},
        ],
    }
    body = {"inputs": {}, "params": {"delay_s": 0.15}, "timeout_s": 30}
    with running_mesh(tmp_path, topology, "--max-replicas-total", "3") as mesh:
        most, stop = [0], threading.Event()

        def watch() -> None:  # the replica processes `up` runs, counted from /proc
            while not stop.wait(0.05):
                most[0] = max(most[0], sum(len(p) for p in stage_processes(mesh).values()))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        sampler = Sampler(mesh.url).start()
        load = Load(mesh.url, body, clients=8).start()
        try:
            wait_for(lambda: sum(len(p) for p in stage_processes(mesh).values()) == 3, 60.0, "3 replicas in all")
            limited = wait_for(
                lambda: [s["autoscale"]["limited"] for s in mesh.client.get("/v1/stages").json()["stages"]
                         if s["autoscale"]["limited"]], 30.0, "a stage saying the cap holds it back",
            )
            time.sleep(3.0)
        finally:
            load.stop()
            stop.set()
            watcher.join(5)
            sampler.stop()
        mesh.remember_tree()
        assert most[0] == 3, most[0]
        assert all(sum(t for _, t, _ in stages.values()) <= 3 for _, stages in sampler.samples)
        assert "host cap of 3 replicas" in limited[0], limited
        assert "cannot reach its target" in mesh.log()
        assert load.failed() == [], load.failed()[:3]


def test_a_flood_starts_no_replica_the_host_has_no_memory_for(tmp_path: Path) -> None:
    """`--min-free-memory` as large as the host's memory: however many replicas a flood of 48 clients
    makes the coordinator want, `up` starts none beyond the starting one, and says why (memory, not the
    host cap, which leaves room for 8); the requests wait their turn and succeed."""
    scale = {"min_replicas": 1, "max_replicas": 6, "target_ongoing_requests": 1, **FAST}
    topology = {
        "name": "autoscale-memory",
        "stages": [{"stage_id": 0, "name": "a", "handler": HANDLER, "max_inflight": 4, "max_queued": 256,
                    "autoscale": scale}],
    }
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    body = {"inputs": {}, "params": {"delay_s": 0.05}, "timeout_s": 60}
    with running_mesh(tmp_path, topology, "--max-replicas-total", "8", "--min-free-memory", str(total)) as mesh:
        load = Load(mesh.url, body, clients=48).start()
        try:
            wanted = wait_for(lambda: [s for s in mesh.client.get("/v1/stages").json()["stages"]
                                       if s["target_replicas"] == 6], 30.0, "the target at max_replicas")
            time.sleep(3.0)  # the launcher polls every 0.5 s: time for it to start what it would
            assert len(stage_processes(mesh).get("a", [])) == 1, stage_processes(mesh)
        finally:
            load.stop()
        assert wanted[0]["current_replicas"] == 1
        assert "a runs 1 of its target 6 replicas: the host's memory has no room for more" in mesh.log()
        assert load.failed() == [] and len(load.done) > 48, load.failed()[:3]
