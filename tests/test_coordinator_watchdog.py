"""`omni-mesh up` notices a coordinator that runs but does not answer: real processes, SIGSTOP.

The watchdog asks /health every 2 s; the first unanswered question is logged with the pid, and a
coordinator silent for --coordinator-watchdog-s is killed and restarted: the replicas register with
the new one and the mesh serves again, with no hand on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
from support.control_peer import control_endpoint
from support.meshkit import Mesh, running_mesh, wait_for

TOPOLOGY = {
    "name": "watchdog",
    "stages": [{"stage_id": 0, "name": "a", "handler": "mesh_handlers:step", "final_output": True}],
}
LIMIT_S = 3.0


def _ready(mesh: Mesh) -> bool:
    with contextlib.suppress(httpx.HTTPError):  # the old coordinator's kept-alive connection was reset
        return mesh.ready().status_code == 200
    return False


def test_a_coordinator_that_stops_answering_is_reported_then_restarted(tmp_path: Path) -> None:
    with running_mesh(tmp_path, TOPOLOGY, "--coordinator-watchdog-s", str(LIMIT_S)) as mesh:
        assert mesh.ok({"n": 10})["outputs"]["trail"] == ["a"]
        # The test saw /ready first; the watchdog starts once `up` has seen it too and said so.
        wait_for(lambda: "is ready at" in mesh.log(), 10, "up to announce the mesh")
        _, coordinator = control_endpoint(mesh)
        replica = mesh.replica("a")["pid"]
        stopped = time.monotonic()
        os.kill(coordinator, signal.SIGSTOP)
        try:
            wait_for(lambda: f"coordinator (pid {coordinator}) is not answering" in mesh.log(), 8, "the silence logged")
            noticed = time.monotonic() - stopped
            wait_for(lambda: f"coordinator (pid {coordinator}) has not answered" in mesh.log(), 15, "the kill logged")
            killed = time.monotonic() - stopped
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(coordinator, signal.SIGCONT)
        assert noticed < 6, f"the watchdog noticed the silence only after {noticed:.1f} s"
        assert LIMIT_S <= killed < LIMIT_S + 8, f"killed {killed:.1f} s after the coordinator stopped answering"
        wait_for(lambda: _ready(mesh), 30, "the restarted coordinator to be ready")
        _, restarted = control_endpoint(mesh)
        assert restarted != coordinator
        assert mesh.ok({"n": 10})["outputs"]["trail"] == ["a"]
        assert mesh.replica("a")["pid"] == replica, "the replica was restarted too"
        assert "restarting in" in mesh.log()
