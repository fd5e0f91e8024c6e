"""A mesh whose two edges use two different network connectors, under `omni-mesh up` (issue 6).

Edge 0->1 uses ZmqConnector (served from stage 0's own memory over ZeroMQ) and edge 1->2 uses
YuanrongConnector (through a real openYuanrong datasystem worker: the session's shared one,
tests/support/shared_worker.py; this module's keys carry their own prefix). The stage handlers (HANDLERS, written next to the topology) carry a 1 MiB
float32 tensor plus small metadata and transform it at every stage, so each answer tells whether every
stage ran once, in order, on its own request's data. Afterwards the worker must hold none of the keys
the mesh wrote and nothing the mesh made may be left in /dev/shm. The user-facing topology
compose/omni-demo-zmq-yuanrong.yaml is validated and served too.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from support.meshkit import OMNI_MESH, Mesh, running_mesh, start_mesh, wait_for
from support.shared_worker import SharedWorker

from omni_mesh.connectors import edge_key
from omni_mesh.connectors.shm.segments import owner_of, shm_dir
from omni_mesh.connectors.yuanrong import datasystem_key
from omni_mesh.local_services.datasystem_worker import Worker

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose" / "omni-demo-zmq-yuanrong.yaml"
SHM = Path("/dev/shm")
N = 262_144  # float32 elements per payload: 1 MiB
KEY_PREFIX = "omnie2emixed"  # this module's namespace in the worker

HANDLERS = '''\
"""Stage handlers of tests/test_mixed_connectors_e2e.py (written next to its topology).

encode: {"scale": s, "tag": t} -> x = s * arange(N) (float32, 1 MiB) with tag, trail and a bf16 head;
mix: x -> 2x + 1; summarise: a small summary of x, so the answer checks the whole tensor.
"""

import torch

N = 262_144


async def encode(inputs, ctx):
    x = torch.arange(N, dtype=torch.float32) * float(inputs["scale"])
    return {"x": x, "tag": str(inputs["tag"]), "trail": [ctx.stage], "head_bf16": x[:8].to(torch.bfloat16)}


async def mix(inputs, ctx):
    x = inputs["x"]
    assert x.dtype == torch.float32 and x.shape == (N,), (x.dtype, x.shape)
    return {**inputs, "x": x * 2 + 1, "trail": [*inputs["trail"], ctx.stage]}


async def summarise(inputs, ctx):
    x = inputs["x"]
    assert x.dtype == torch.float32 and x.shape == (N,), (x.dtype, x.shape)
    return {
        "tag": inputs["tag"],
        "trail": [*inputs["trail"], ctx.stage],
        "n": x.numel(),
        "sum": float(x.double().sum()),
        "head": x[:3].tolist(),
        "tail": x[-2:].tolist(),
        "head_bf16": inputs["head_bf16"].float().tolist(),
        "request_id": ctx.request_id,
    }
'''

STAGES = ("encode", "mix", "summarise")


def _stage(stage_id: int, name: str, **more: object) -> dict:
    return {
        "stage_id": stage_id,
        "name": name,
        "handler": f"mixed_handlers:{name}",
        "max_inflight": 8,
        **more,
    }


def topology(worker: Worker) -> dict:
    return {
        "name": "e2e-mixed-connectors",
        "connectors": {
            "zmq": {"name": "ZmqConnector", "extra": {"host": "127.0.0.1"}},
            "yuanrong": {"name": "YuanrongConnector", "extra": {**worker.config, "key_prefix": KEY_PREFIX}},
        },
        "stages": [
            _stage(0, "encode", output_connectors={"to_stage_1": "zmq"}),
            _stage(
                1,
                "mix",
                input_connectors={"from_stage_0": "zmq"},
                output_connectors={"to_stage_2": "yuanrong"},
            ),
            _stage(2, "summarise", input_connectors={"from_stage_1": "yuanrong"}, final_output=True),
        ],
    }


def expected(scale: float, tag: str) -> dict:
    """What summarise answers for {"scale": scale, "tag": tag}: x = 2 * scale * arange(N) + 1."""
    return {
        "tag": tag,
        "trail": list(STAGES),
        "n": N,
        "sum": float(scale * N * (N - 1) + N),
        "head": [1.0, 2 * scale + 1, 4 * scale + 1],
        "tail": [2 * scale * (N - 2) + 1, 2 * scale * (N - 1) + 1],
        "head_bf16": [scale * i for i in range(8)],
    }


def shm_entries() -> set[str]:
    """What is in /dev/shm (the datasystem's own files too) and in our segment directory, but the
    directories other pytest processes on the host make for their own segments (conftest.SEGMENT_DIR)."""
    return {
        name
        for where in {SHM, shm_dir()}
        if where.is_dir()
        for name in os.listdir(where)
        if not name.startswith("omni-mesh-tests-")
    }


@dataclass
class Run:
    mesh: Mesh
    worker: Worker
    shm_before: set[str]
    request_ids: list[str] = field(default_factory=list)

    def ask(self, scale: float, tag: str) -> dict:
        body = self.mesh.ok({"scale": scale, "tag": tag})
        self.request_ids.append(body["request_id"])
        return body

    def worker_keys(self) -> list[str]:
        """The datasystem keys the 1->2 edge used (the stage puts each output under `<rid>/<seq>`)."""
        return [
            datasystem_key(KEY_PREFIX, edge_key("mix", "summarise", f"{rid}/{seq}"))
            for rid in self.request_ids
            for seq in range(2)
        ]


@pytest.fixture(scope="module")
def worker(datasystem_worker: SharedWorker) -> Worker:
    return datasystem_worker.get()


@pytest.fixture(scope="class")
def run(worker: Worker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    directory = tmp_path_factory.mktemp("mixed")
    (directory / "mixed_handlers.py").write_text(HANDLERS)
    before = shm_entries()
    with running_mesh(directory, topology(worker), sig=signal.SIGINT) as mesh:
        yield Run(mesh, worker, before)


class TestZmqThenYuanrong:
    def test_topology_wires_each_edge_with_its_connector(self, run: Run) -> None:
        topology = run.mesh.client.get("/v1/topology").json()
        edges = {(e["from"], e["to"]): e["connector_name"] for e in topology["edges"]}
        assert edges == {(0, 1): "ZmqConnector", (1, 2): "YuanrongConnector"}

    def test_a_request_crosses_both_connectors_with_the_right_values(self, run: Run) -> None:
        body = run.ask(3.0, "first")
        out = body["outputs"]
        assert out.pop("request_id") == body["request_id"]
        assert out == expected(3.0, "first")
        assert list(body["timings"]) == list(STAGES)

    def test_concurrent_requests_keep_their_own_data(self, run: Run) -> None:
        requests = [(float(i + 1) / (2 if i % 2 else 1), f"req-{i}") for i in range(8)]
        with ThreadPoolExecutor(len(requests)) as pool:
            bodies = list(pool.map(lambda r: run.ask(*r), requests))
        for (scale, tag), body in zip(requests, bodies, strict=True):
            out = dict(body["outputs"])
            assert out.pop("request_id") == body["request_id"]
            assert out == expected(scale, tag), tag
        assert len({b["request_id"] for b in bodies}) == len(requests)

    def test_every_payload_went_through_its_connector_and_left_the_worker(self, run: Run) -> None:
        count = len(run.request_ids)
        assert count == 9

        def counters() -> dict | None:
            health = {stage: run.mesh.connector_health(stage) for stage in STAGES}
            ready = (
                health["encode"]["zmq"]["puts"] == count
                and health["mix"]["yuanrong"]["puts"] == count
                and health["summarise"]["yuanrong"]["gets"] == count
                and health["summarise"]["yuanrong"]["deleted"] == count  # each get's delete runs after it
            )
            return health if ready else None

        health = wait_for(counters, 10, "the stages' connector counters to show every request (heartbeat)")
        sent, received = health["encode"]["zmq"], health["mix"]["zmq"]
        assert received["gets"] == count and received["bytes_got"] == sent["bytes_put"] > count * (1 << 20)
        assert sent["errors"] == received["errors"] == 0
        consumer = health["summarise"]["yuanrong"]
        assert consumer["deleted"] == count and consumer["errors"] == 0  # each get deletes its key
        assert consumer["bytes_got"] == health["mix"]["yuanrong"]["bytes_put"] > count * (1 << 20)
        assert not any(run.worker.exists(run.worker_keys()))

    def test_sigint_stops_everything_and_leaves_nothing_behind(self, run: Run) -> None:
        assert run.mesh.stop(signal.SIGINT) == 0  # also: no process and no segment of the mesh left
        new = shm_entries() - run.shm_before
        # Entries another process (a concurrent test run) made and still owns are not ours.
        ours = [name for name in new if (owner := owner_of(name)) is None or owner.pid in run.mesh.processes]
        assert not ours, f"left in /dev/shm: {ours}"
        assert not any(run.worker.exists(run.worker_keys()))


# ================================================================== the topology users run


def test_compose_topology_validates_and_serves_the_demo(worker: Worker, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(OMNI_MESH), "validate", str(COMPOSE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "via ZmqConnector" in result.stdout and "via YuanrongConnector" in result.stdout
    assert "0->1  thinker -> talker  via ZmqConnector" in result.stdout
    assert "1->2  talker -> code2wav  via YuanrongConnector" in result.stdout

    # The same file against this module's worker (the file names the usual 127.0.0.1:31501).
    config = yaml.safe_load(COMPOSE.read_text())
    assert config["connectors"]["yuanrong"]["extra"] == {"host": "127.0.0.1", "port": 31501}
    config["connectors"]["yuanrong"]["extra"].update(port=worker.port, key_prefix=KEY_PREFIX)
    before = shm_entries()
    mesh = start_mesh(tmp_path, config)
    try:
        body = mesh.ok({"prompt": "Hello over two connectors"}, params={"max_tokens": 48})
        assert "Hello over two connectors" in body["outputs"]["text"]
        assert body["outputs"]["sample_rate"] == 24_000 and body["outputs"]["duration_s"] > 0
        assert set(body["timings"]) == {"thinker", "talker", "code2wav"}
    except BaseException:
        mesh.kill()
        raise
    assert mesh.stop(signal.SIGINT) == 0
    new = shm_entries() - before
    assert not [name for name in new if (owner := owner_of(name)) is None or owner.pid in mesh.processes]
