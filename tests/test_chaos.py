"""`omni-mesh bench chaos` as a user runs it, shortened: replica kills, coordinator pauses and
connection drops under checked load; and the parts the soak's verdict rests on, each on real
processes and sockets."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_mesh.bench import chaos, chaos_faults
from omni_mesh.bench.chaos_faults import Fault, FaultLog
from omni_mesh.cli import EXIT_USAGE, main
from omni_mesh.connectors.shm.segments import (
    ProcessIdentity,
    create_segment,
    new_token,
    segment_name,
    unlink_segment,
)

CLI = [sys.executable, "-m", "omni_mesh.cli", "bench", "chaos"]
#: No shared-memory directory named (the suite names one for every test): `up` would make its own,
#: and the soak must still find the segments its mesh makes.
AS_A_USER = {key: value for key, value in os.environ.items() if key != "OMNI_MESH_SHM_DIR"}


def test_a_short_soak_with_every_fault_kind_keeps_every_invariant() -> None:
    # --edges mixed: shared memory on one edge (segments to leave behind), ZeroMQ on the other (data-plane
    # TCP connections for the drops to reset, besides the control plane's).
    # --tolerate drop: a drop here also resets the ZeroMQ edge's data-plane connections, and a payload
    # being fetched over one can still fail (500) or wait for its deadline; they are counted apart.
    # The control plane alone fails nothing on a drop (the next test).
    done = subprocess.run(
        [*CLI, "--edges", "mixed", "--duration", "15", "--kill-every", "2.5", "--pause-every", "5", "--pause-s", "1.5",
         "--stop-every", "4", "--drop-every", "2.5", "--tolerate", "drop", "--json"],
        capture_output=True, text=True, timeout=300, env=AS_A_USER,
    )
    result = json.loads(done.stdout)
    why = f"{chaos.report(result)}\nfaults: {result['fault_log']}\nfailures: {result['failure_log'][:20]}"
    assert chaos.broken(result) == [] and done.returncode == 0, why
    assert result["wrong"] == 0 and result["late"] == 0 and result["leftover_segments"] == [], why
    assert result["leftover_processes"] == [] and result["mesh_processes"] >= 7, why  # coordinator, 6 replicas
    faults = result["faults"]
    assert faults.get("kill", 0) >= 2 and faults.get("pause", 0) >= 1 and faults.get("drop", 0) >= 1, why
    assert faults.get("stop", 0) >= 1, why
    assert all(f["connections"] >= 1 for f in result["fault_log"] if f["kind"] == "drop"), why
    assert result["max_s"] >= 1.0, why  # a request sent during a pause waited for it: the pause stopped the coordinator
    assert result["succeeded"] >= 0.8 * result["sent"] > 0, why
    assert sum(result["failed_by_cause"].values()) == sum(result["failed"].values())
    assert result["most_segments_held"] > 0, why  # the mesh did make segments: "none left" means something


def test_control_connection_drops_fail_no_request() -> None:
    """Shared-memory edges, so a drop resets only control connections: every request succeeds (the
    replica and the coordinator reconcile what was in flight: coordinator/scheduling/reconcile.py), none late."""
    done = subprocess.run(
        [*CLI, "--edges", "shm", "--duration", "10", "--kill-every", "0", "--pause-every", "0",
         "--drop-every", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    result = json.loads(done.stdout)
    why = f"{chaos.report(result)}\nfaults: {result['fault_log']}\nfailures: {result['failure_log'][:20]}"
    assert done.returncode == 0 and chaos.broken(result) == [], why
    assert result["failed"] == {} and result["wrong"] == 0 and result["late"] == 0, why
    assert result["faults"].get("drop", 0) >= 3 and result["succeeded"] == result["sent"] > 0, why


def test_the_soak_checks_outputs_and_segments_for_real() -> None:
    """The invariants are not vacuous: a wrong stage order and a leftover segment are caught."""
    right = chaos.expected_output(10, 4, ["a", "b"], {"a": 1, "b": 2})
    assert right["head"] == [44.0, 48.0, 52.0] and right["sum"] == 44 + 48 + 52 + 56  # 4 (10 + j) + 4
    assert chaos.expected_output(10, 4, ["b", "a"], {"a": 1, "b": 2})["head"] != right["head"]
    assert chaos_faults.alive({os.getpid()}) == [os.getpid()]  # a process left running is caught
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert chaos_faults.alive({gone.pid}) == []
    name = segment_name(ProcessIdentity.current(), new_token())
    create_segment(name, 4096, populate=False).close()
    try:
        assert chaos.leftover_segments({os.getpid()}) == [name]
        assert chaos.leftover_segments({os.getpid() + 1}) == []
    finally:
        unlink_segment(name)


def test_failures_are_put_down_to_the_fault_that_explains_them() -> None:
    log = FaultLog(drop_aftermath_s=10.0, started=0.0)
    log.faults = [Fault("kill", 10.0, 10.0, "second"), Fault("pause", 20.0, 22.0, "coordinator"),
                  Fault("drop", 30.0, 30.1, "third")]
    assert log.cause_of(9.5, 10.5, "502", "replica 'second-1' died (pid 7) while handling the request") == "kill"
    assert log.cause_of(9.5, 10.5, "502", "replica 'second-1' stopped sending heartbeats") == "kill, other"
    gone = "stage 'b' failed: stage 'b': payload 'r/0' on edge 0->1 (SharedMemoryConnector): gone"
    assert log.cause_of(9.5, 10.5, "502", gone) == "kill, payload gone"
    assert log.cause_of(9.5, 10.5, "500", "StageInputError: payload gone") == "kill, other"  # no more a 500
    assert log.cause_of(9.5, 10.5, "500", "ValueError") == "kill, other"
    assert log.cause_of(10.5, 11.0, "502", "replica 'second-1' died (pid 7)") == "none"  # began after the kill
    assert log.cause_of(21.0, 23.5, "504", "deadline") == "pause"  # a pause stops every request
    assert log.cause_of(23.5, 24.0, "504", "deadline") == "none"  # past the pause's aftermath
    assert log.cause_of(36.0, 46.0, "504", "deadline") == "drop"  # began in the drop's aftermath
    assert log.cause_of(40.5, 41.0, "502", "stopped sending heartbeats") == "none"  # past it
    assert log.cause_of(50.0, 51.0, "429", "queue full") == "backpressure"
    assert log.cause_of(9.5, 10.5, "504", "deadline") == "kill, other"
    log.faults.append(Fault("stop", 60.0, 61.5, "first"))
    assert log.cause_of(60.5, 62.0, "504", "deadline") == "stop"  # reported, not excused
    result = {"failed_by_cause": {"kill": 3, "drop": 2, "none": 1}, "tolerate": ["drop"], "wrong": 0, "late": 0,
              "leftover_segments": [], "leftover_processes": [], "launcher_exit_status": 0}
    assert chaos.broken(result) == ["request(s) failed with no fault that legitimately fails them: none: 1"]
    result["failed_by_cause"].pop("none")
    assert chaos.broken(result) == []
    result["tolerate"] = []
    assert chaos.broken(result) == ["request(s) failed with no fault that legitimately fails them: drop: 2"]
    result.update(tolerate=["drop"], leftover_processes=[4242])
    assert chaos.broken(result) == ["1 mesh process(es) still running after the mesh stopped"]


def _sharing_local_port(port: int, server: socket.socket) -> socket.socket:
    """A connection to `server` from local port `port`, which another connection uses too (as the
    kernel reuses an ephemeral port towards another destination)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.connect(server.getsockname())
    return sock


def test_a_drop_resets_both_ends_of_a_real_connection_and_no_other() -> None:
    """Both ends of the connection are reset; another connection from the same local port (to
    another server: the soak's own HTTP client once shared a replica's ephemeral port) is not."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as elsewhere:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted, _sharing_local_port(client.getsockname()[1], elsewhere) as bystander:
            pair = (client.getsockname()[1], server.getsockname()[1])
            assert pair in chaos_faults.tcp_ports(os.getpid())
            assert chaos_faults.reset_connections({pair}) == 1
            for end in (accepted, client):  # one end destroyed (ECONNABORTED), the other sent a RST (ECONNRESET)
                with pytest.raises((ConnectionResetError, ConnectionAbortedError)):
                    end.recv(1)
            assert pair not in chaos_faults.tcp_ports(os.getpid())
            other = (bystander.getsockname()[1], elsewhere.getsockname()[1])
            assert other in chaos_faults.tcp_ports(os.getpid()), "a connection sharing its local port was reset too"


def test_a_pause_stops_the_coordinator_and_always_resumes_it() -> None:
    """pause() finds the launcher's `coordinator` child, stops it, and resumes it even when the soak
    is cancelled mid-pause (a coordinator left stopped would hang the mesh's shutdown)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "coordinator"])
    try:
        assert chaos_faults.coordinator_pid(os.getpid()) == child.pid
        state = lambda: Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
        log = FaultLog()

        async def cancelled_mid_pause() -> None:
            task = asyncio.create_task(chaos_faults.pause(os.getpid(), 30.0, log))
            await asyncio.sleep(0.3)
            assert state() == "T"  # stopped
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        began = time.monotonic()
        asyncio.run(cancelled_mid_pause())
        assert time.monotonic() - began < 5 and state() in ("S", "R")
        asyncio.run(chaos_faults.pause(os.getpid(), 0.2, log))
        assert [(f.kind, f.target, f.detail["pid"]) for f in log.faults] == [("pause", "coordinator", child.pid)]
        assert state() in ("S", "R")
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pause-every", "5", "--pause-s", "12", "--timeout-s", "10"], "--pause-s 12: a pause must be > 0 and shorter"),
        (["--drop-every", "-1"], "--drop-every must be >= 0"),
        (["--tolerate", "kill"], "--tolerate kill: only pause and drop failures can be tolerated"),
    ],
)
def test_a_bad_plan_is_refused_before_any_mesh_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "chaos", "--duration", "5", *flags]) == EXIT_USAGE
    assert message in capsys.readouterr().err
