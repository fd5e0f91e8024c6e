"""Per-stage scaling with real processes: a coordinator and `omni-mesh stage` replicas, each its own
process, that join and leave a running mesh (as `docker compose up --scale` makes them do).

- Throughput grows with replicas: a stage that waits 100 ms per request, one request per replica at
  a time, serves at least 3x as much with 4 replicas as with 1, the 3 extra joining under load.
- A replica killed outright (SIGKILL) under load: its requests are retried on another replica or fail
  with an error naming the stage; the mesh then serves every request.
- A replica stopped with SIGTERM under load drains: it finishes its work, deregisters and exits 0,
  and no request is lost.
- A replica stopped with SIGTERM while no coordinator answers its registration (`docker compose
  down` stopped the coordinator first) exits 0 within seconds.

Handlers: tests/support/scaling_handlers.py, copied next to each topology.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from support.meshkit import wait_for
from support.servicekit import Api, Service, Services

from omni_mesh.ports import free_port

HANDLERS = Path(__file__).parent / "support" / "scaling_handlers.py"
SMALL_POOL = {"name": "SharedMemoryConnector", "extra": {"memory_pool_size": 32 * 1024 * 1024}}
ZMQ = {"name": "ZmqConnector", "extra": {"host": "127.0.0.1", "memory_pool_size": 32 * 1024 * 1024}}

WORK = {
    "name": "scaling-work",
    "stages": [{"stage_id": 0, "name": "work", "handler": "scaling_handlers:work", "max_inflight": 1,
                "max_queued": 64}],  # the test keeps more waiting than the default 4 x max_inflight
}

PIPELINE = {
    "name": "scaling-pipeline",
    "connectors": {"shm": SMALL_POOL},
    "stages": [
        {
            "stage_id": 0,
            "name": "src",
            "handler": "scaling_handlers:src",
            "max_inflight": 16,
            "output_connectors": {"to_stage_1": "shm"},
        },
        {
            "stage_id": 1,
            "name": "mid",
            "handler": "scaling_handlers:mid",
            "max_inflight": 2,
            "input_connectors": {"from_stage_0": "shm"},
            "output_connectors": {"to_stage_2": "shm"},
        },
        {
            "stage_id": 2,
            "name": "sink",
            "handler": "scaling_handlers:sink",
            "max_inflight": 16,
            "input_connectors": {"from_stage_1": "shm"},
            "final_output": True,
        },
    ],
}


class Mesh:
    """A coordinator and stage replicas as separate processes; replicas come and go at any time."""

    def __init__(self, directory: Path, topology: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HANDLERS, directory / HANDLERS.name)
        self.topology = directory / "topology.yaml"
        self.topology.write_text(yaml.safe_dump(topology, sort_keys=False))
        self.services = Services(directory / "logs")
        self.control = f"tcp://127.0.0.1:{free_port()}"
        port = free_port()
        self.coordinator = self.services.coordinator(self.topology, port=port, control=self.control)
        self.api = Api(f"http://127.0.0.1:{port}")
        self.replicas: dict[str, list[Service]] = {}

    def add(self, stage: str, count: int = 1) -> list[Service]:
        """Start `count` more replicas of `stage` (joining a running mesh is no different)."""
        started = []
        for _ in range(count):
            index = len(self.replicas.setdefault(stage, [])) + 1
            replica = self.services.stage(
                self.topology,
                stage,
                coordinator=self.control,
                name=f"{stage}-{index}",
                replica=f"{stage}-{index}",
            )
            self.replicas[stage].append(replica)
            started.append(replica)
        return started

    def wait_healthy(self, stage: str, count: int, timeout_s: float = 90.0) -> None:
        def enough() -> bool:
            for service in [self.coordinator, *self.replicas.get(stage, [])]:
                if not service.running() and service.process.returncode not in (0, -9):
                    raise AssertionError(
                        f"{service.name} exited with {service.process.returncode}:\n{service.log()}"
                    )
            try:
                return len(self.api.healthy(stage)) == count
            except httpx.HTTPError:
                return False

        wait_for(enough, timeout_s, f"{count} healthy replica(s) of stage {stage!r}", interval_s=0.1)

    def stop(self) -> None:
        """Stop everything with SIGTERM (replicas drain, the coordinator shuts down gracefully)."""
        self.api.close()
        codes = self.services.stop_all(signal.SIGTERM)
        assert codes == dict.fromkeys(codes, 0), codes
        self.services.assert_no_segments()


@pytest.fixture
def mesh_factory(tmp_path: Path) -> Iterator[Callable[[dict], Mesh]]:
    meshes: list[Mesh] = []

    def make(topology: dict) -> Mesh:
        mesh = Mesh(tmp_path / f"mesh{len(meshes)}", topology)
        meshes.append(mesh)
        return mesh

    try:
        yield make
    finally:
        for mesh in meshes:
            mesh.api.close()
            mesh.services.close()


@dataclass
class Outcome:
    i: int
    started: float
    finished: float
    status: int
    body: dict


@dataclass
class Load:
    """`concurrency` clients sending requests back to back until stopped; every outcome recorded."""

    api: Api
    concurrency: int
    inputs: Callable[[int], dict]
    params: dict
    timeout_s: float = 30.0
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._count = iter(range(1_000_000))
        self._lock = threading.Lock()
        self._client = httpx.Client(
            base_url=self.api.url, limits=httpx.Limits(max_connections=self.concurrency * 2)
        )
        self._pool = ThreadPoolExecutor(self.concurrency)
        self._workers = [self._pool.submit(self._client_loop) for _ in range(self.concurrency)]

    def _client_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i = next(self._count)
            started = time.monotonic()
            body = {"inputs": self.inputs(i), "params": self.params, "timeout_s": self.timeout_s}
            try:
                response = self._client.post("/v1/requests", json=body, timeout=self.timeout_s + 30)
                status, reply = response.status_code, response.json()
            except httpx.HTTPError as exc:
                status, reply = 0, {"error": f"{type(exc).__name__}: {exc}"}
            with self._lock:
                self.outcomes.append(Outcome(i, started, time.monotonic(), status, reply))

    def completed_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.status == 200 and start <= o.finished < end)

    def throughput(self, window_s: float) -> float:
        """Requests completed per second over the next `window_s` seconds."""
        start = time.monotonic()
        time.sleep(window_s)  # a measurement window, not a wait for a condition
        return self.completed_between(start, start + window_s) / window_s

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for worker in self._workers:
            worker.result(timeout=self.timeout_s + 60)
        self._pool.shutdown()
        self._client.close()
        return sorted(self.outcomes, key=lambda o: o.i)

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.status != 200]


def replica_of(api: Api, stage: str, replica_id: str) -> dict | None:
    return next((r for r in api.stages().get(stage, []) if r["id"] == replica_id), None)


# ====================================================================== throughput


def test_four_replicas_serve_at_least_three_times_what_one_does(mesh_factory, capsys) -> None:
    mesh = mesh_factory(WORK)
    mesh.add("work")
    mesh.wait_healthy("work", 1)
    # 12 clients keep more requests waiting than even 4 replicas take at once (max_inflight 1 each).
    load = Load(mesh.api, concurrency=12, inputs=lambda i: {"i": i}, params={"delay_s": 0.1})
    try:
        wait_for(lambda: len(load.outcomes) >= 5, 30, "the first requests to complete")
        one = load.throughput(4.0)
        queued = mesh.api.get("/v1/stages").json()["stages"][0]["queued"]
        assert queued >= 4, f"the load does not saturate one replica ({queued} queued)"
        # Three more replicas join the running mesh, under load: nothing restarts.
        mesh.add("work", 3)
        mesh.wait_healthy("work", 4)
        wait_for(
            lambda: all(r["processed"] > 0 for r in mesh.api.stages()["work"]),
            10,
            "every replica to get work",
        )
        four = load.throughput(4.0)
    finally:
        outcomes = load.stop()
    with capsys.disabled():
        print(
            f"\nthroughput of a 100 ms stage: 1 replica {one:.1f} req/s, 4 replicas {four:.1f} req/s "
            f"({four / one:.2f}x)"
        )
    assert not [o for o in outcomes if o.status != 200], [o.body for o in outcomes if o.status != 200][:3]
    assert 5.0 <= one <= 10.5, f"one replica of a 100 ms stage served {one:.1f} req/s"
    assert four >= 3 * one, f"4 replicas: {four:.1f} req/s, 1 replica: {one:.1f} req/s"
    assert mesh.coordinator.running() and all(r.running() for r in mesh.replicas["work"])
    mesh.stop()


# ====================================================================== a replica dies


@pytest.mark.parametrize("n", [64, 65536], ids=["inline", "shm-pool"])
def test_sigkill_of_a_replica_under_load(mesh_factory, n: int, capsys) -> None:
    mesh = mesh_factory(PIPELINE)
    mesh.add("src")
    mesh.add("mid", 3)
    mesh.add("sink")
    for stage, count in (("src", 1), ("mid", 3), ("sink", 1)):
        mesh.wait_healthy(stage, count)
    victim = mesh.replicas["mid"][1]
    load = Load(mesh.api, concurrency=9, inputs=lambda i: {"i": i, "n": n}, params={"mid_s": 0.3})
    try:
        wait_for(
            lambda: (r := replica_of(mesh.api, "mid", victim.name)) and r["inflight"] == 2,
            30,
            "the victim to be busy",
        )
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        victim.process.wait(5)  # reaped, as its supervisor (compose, `omni-mesh up`) would: no zombie
        wait_for(
            lambda: replica_of(mesh.api, "mid", victim.name) is None, 3, "the coordinator to drop the victim"
        )
        wait_for(
            lambda: load.completed_between(killed + 1.0, time.monotonic()) >= 10,
            30,
            "requests to keep completing after the kill",
        )
    finally:
        outcomes = load.stop()
    failed = [o for o in outcomes if o.status != 200]
    for outcome in outcomes:
        if outcome.status == 200:
            assert outcome.body["outputs"] == {"i": outcome.i, "n": n, "by": outcome.body["outputs"]["by"]}
        else:
            assert 500 <= outcome.status < 600, (outcome.status, outcome.body)
            assert outcome.body["stage"] == "mid" and "'mid'" in outcome.body["error"], outcome.body
    retried = mesh.coordinator.log().count("retrying stage 'mid' once")
    with capsys.disabled():
        print(
            f"\nSIGKILL ({'inline' if n == 64 else 'shm pool'} payloads): {len(outcomes)} requests, "
            f"{retried} retried, {len(failed)} failed: {sorted({o.body['error'] for o in failed})}"
        )
    assert retried >= 1, "the victim held work: it should have been retried elsewhere"
    # Each retry fetches its input again: from the metadata (inline) or from src's pool, where the
    # dead replica's claim on the slot no longer counts. So none of them fails.
    assert not failed, [o.body for o in failed]
    # Requests after the failure all succeed, on the two replicas left.
    with ThreadPoolExecutor(6) as pool:
        after = list(
            pool.map(lambda i: mesh.api.request({"i": i, "n": n}, params={"mid_s": 0.05}), range(12))
        )
    assert [r.status_code for r in after] == [200] * 12, [r.text for r in after if r.status_code != 200]
    assert {r.json()["outputs"]["by"] for r in after} <= {"mid-1", "mid-3"}
    # The coordinator reaped the dead replica's shared-memory pool.
    wait_for(
        lambda: not [s for s in mesh.services.our_segments() if f"_{victim.pid}_" in s],
        5,
        "the victim's segments to be reaped",
    )
    mesh.stop()


# ====================================================================== a replica leaves


def _with_mid_to_sink(connector: str) -> dict:
    """PIPELINE with the mid -> sink edge on `connector` ("shm" or "zmq")."""
    topology = {**PIPELINE, "connectors": {**PIPELINE["connectors"], "zmq": ZMQ}}
    stages = [dict(stage) for stage in PIPELINE["stages"]]
    stages[1]["output_connectors"] = {"to_stage_2": connector}
    stages[2]["input_connectors"] = {"from_stage_1": connector}
    stages[2]["max_inflight"] = 1  # with sink_s, the sink is the bottleneck: mid's outputs wait for it
    stages[2]["max_queued"] = 64  # and more of them wait than the default queue limit (4) allows
    return {**topology, "stages": stages}


@pytest.mark.parametrize("connector", ["shm", "zmq"])
def test_sigterm_on_a_replica_under_load_loses_no_request(mesh_factory, connector: str, capsys) -> None:
    mesh = mesh_factory(_with_mid_to_sink(connector))
    mesh.add("src")
    mesh.add("mid", 3)
    mesh.add("sink")
    for stage, count in (("src", 1), ("mid", 3), ("sink", 1)):
        mesh.wait_healthy(stage, count)
    leaving = mesh.replicas["mid"][0]
    # Payloads through the shared-memory pool (256 KiB), and a slow sink so mid's outputs wait for it.
    load = Load(
        mesh.api, concurrency=9, inputs=lambda i: {"i": i, "n": 65536}, params={"mid_s": 0.3, "sink_s": 0.1}
    )
    try:
        wait_for(
            lambda: (r := replica_of(mesh.api, "mid", leaving.name)) and r["inflight"] == 2,
            30,
            "the leaving replica to be busy",
        )
        signalled = time.monotonic()
        code = mesh.services.stop(leaving, signal.SIGTERM)
        drained_s = time.monotonic() - signalled
        assert replica_of(mesh.api, "mid", leaving.name) is None
        wait_for(
            lambda: load.completed_between(time.monotonic() - 1.0, time.monotonic()) >= 3,
            30,
            "requests to keep completing after the replica left",
        )
    finally:
        outcomes = load.stop()
    with capsys.disabled():
        print(f"\nSIGTERM: {len(outcomes)} requests, the replica drained in {drained_s:.2f} s")
    assert code == 0, leaving.log()[-3000:]
    assert "draining" in leaving.log()
    assert not [o for o in outcomes if o.status != 200], [o.body for o in outcomes if o.status != 200][:3]
    by_leaving = [o for o in outcomes if o.body["outputs"]["by"] == leaving.name]
    assert by_leaving, "the replica that left should have completed work"
    assert all(o.body["outputs"] == {"i": o.i, "n": 65536, "by": o.body["outputs"]["by"]} for o in outcomes)
    assert "retrying stage 'mid'" not in mesh.coordinator.log(), (
        "a draining replica should finish its own work"
    )
    mesh.stop()


# ====================================================================== no coordinator


def test_sigterm_while_no_coordinator_answers_exits_at_once(tmp_path: Path) -> None:
    directory = tmp_path / "mesh"
    directory.mkdir()
    shutil.copyfile(HANDLERS, directory / HANDLERS.name)
    topology = directory / "topology.yaml"
    topology.write_text(yaml.safe_dump(PIPELINE, sort_keys=False))  # mid: a connector on each side
    nowhere = f"tcp://127.0.0.1:{free_port()}"  # nothing binds it: registration is never answered
    with Services(directory / "logs") as services:
        replica = services.stage(topology, "mid", coordinator=nowhere, name="mid-1", replica="mid-1")
        wait_for(lambda: "waiting for the coordinator" in replica.log(), 60, "the replica to be registering")
        signalled = time.monotonic()
        code = services.stop(replica, signal.SIGTERM, timeout_s=20)
        stopped_s = time.monotonic() - signalled
        assert code == 0, replica.log()[-3000:]
        assert stopped_s < 5, f"exited {stopped_s:.1f} s after SIGTERM:\n{replica.log()[-3000:]}"
        services.assert_no_segments()
