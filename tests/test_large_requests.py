"""Request bodies up to the REST limit work end to end: inputs too large for a control message reach
the entry stage through the coordinator's ingress connector (a real mesh, real HTTP). A stage whose
output message would outgrow a control message fails the request at once, naming stage and edge."""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.meshkit import Mesh, running_mesh

TOPOLOGY = {
    "name": "large-requests",
    "stages": [{"stage_id": 0, "name": "digest", "handler": "mesh_handlers:digest", "replicas": 2}],
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("large"), TOPOLOGY) as mesh:
        yield mesh


def _text(size: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789 ", k=size))


@pytest.mark.parametrize("size", [1_100_000, 15 * 1024 * 1024])
def test_a_large_text_input_arrives_whole(mesh: Mesh, size: int) -> None:
    text = _text(size, size)
    body = mesh.ok({"text": text}, timeout_s=60)
    out = body["outputs"]
    assert out["text_len"] == size
    assert out["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_many_numbers_and_a_stream_request_arrive_whole(mesh: Mesh) -> None:
    numbers = list(range(400_000))  # ~2 MB of msgpack
    out = mesh.ok({"numbers": numbers}, timeout_s=60)["outputs"]
    assert out == {"text_len": 0, "text_sha256": hashlib.sha256(b"").hexdigest(), "numbers": 400_000,
                   "numbers_sum": sum(numbers)}
    streamed = mesh.request({"numbers": numbers}, timeout_s=60, stream=True)
    assert streamed.status_code == 200 and f'"numbers_sum": {sum(numbers)}' in streamed.text
    # digest answers once (it does not stream): its output comes in the `done` event, the only place
    done = json.loads(streamed.text.split("event: done\ndata: ", 1)[1].splitlines()[0])
    assert done["outputs"]["numbers_sum"] == sum(numbers), done


def test_the_coordinator_holds_nothing_after_large_requests(mesh: Mesh) -> None:
    for seed in range(6):
        mesh.ok({"text": _text(2_000_000, seed)}, timeout_s=60)
    stats = mesh.client.get("/v1/stats").json()
    assert stats["requests"]["inflight"] == 0
    assert stats["ingress"]["held"] == 0 and stats["ingress"]["puts"] >= 6, stats["ingress"]


def test_an_output_whose_metadata_outgrows_a_control_message_fails_at_once(tmp_path: Path) -> None:
    """A connector set to carry payloads up to 2 MiB in their metadata (`inline_max_bytes`): a 1.2 MB
    output would make a control message over 1 MiB, which the coordinator refuses. The stage checks
    what it sends: the request fails at once with the reason, naming the stage and the edge (not at
    its deadline), and the mesh serves smaller requests as before."""
    inline = {"name": "SharedMemoryConnector", "extra": {"inline_max_bytes": 2 * 1024 * 1024}}
    topology = {
        "name": "large-metadata",
        "connectors": {"inline": inline},
        "stages": [
            {"stage_id": 0, "name": "a", "handler": "mesh_handlers:step", "output_connectors": {"to_stage_1": "inline"}},
            {"stage_id": 1, "name": "d", "handler": "mesh_handlers:step", "engine_input_source": [0], "final_output": True},
        ],
    }
    with running_mesh(tmp_path, topology) as mesh:
        started = time.monotonic()
        response = mesh.request({"n": 150_000}, timeout_s=30)  # 1.2 MB of float64
        assert time.monotonic() - started < 10, "the request waited for its deadline"
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert "stage 'a'" in error and "0->1 (SharedMemoryConnector)" in error and "limit of 1048576" in error, error
        assert mesh.ok({"n": 1000})["outputs"]["n"] == 1000


def test_large_inputs_count_against_the_queue_limit(tmp_path: Path) -> None:
    """Inputs over the inline limit go through the ingress connector before their request is queued:
    while they do, the queue limit still counts them. One slot and one queue place: of eight
    concurrent large requests, two are admitted and six get 429 at once (more were admitted before)."""
    topology = {
        "name": "large-queue",
        "stages": [{"stage_id": 0, "name": "d", "handler": "mesh_handlers:step", "max_inflight": 1, "max_queued": 1}],
    }
    pad = _text(4_000_000, 7)
    barrier = threading.Barrier(8)

    def one(_: int) -> int:
        barrier.wait()
        return mesh.request({"n": 4, "pad": pad}, params={"sleep": {"d": 2.0}}, timeout_s=60).status_code

    with running_mesh(tmp_path, topology) as mesh:
        with ThreadPoolExecutor(8) as pool:
            statuses = sorted(pool.map(one, range(8)))
        assert statuses == [200] * 2 + [429] * 6, statuses
        assert mesh.ok({"n": 4, "pad": pad}, timeout_s=30)["outputs"]["n"] == 4  # nothing stays counted
