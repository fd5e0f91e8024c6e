"""Request bodies up to the REST limit work end to end: inputs too large for a control message reach
the entry stage through the coordinator's ingress connector (a real mesh, real HTTP). A stage whose
output message would outgrow a control message fails the request at once, naming stage and edge."""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
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
    # The mesh runs with keys: the inputs left CURVE for the ingress's bulk socket, sealed.
    assert stats["ingress"]["encryption"] in ("aes-256-gcm", "chacha20-poly1305"), stats["ingress"]
    assert stats["ingress"]["bulk_transfers"] >= 6, stats["ingress"]


def test_an_output_whose_metadata_outgrows_a_control_message_fails_at_once(tmp_path: Path) -> None:
    """A connector set to carry payloads up to 1 MiB (its ceiling) in their metadata (`inline_max_bytes`):
    a 1.04 MB output, with the rest of its message, would make a control message over 1 MiB, which the coordinator refuses. The stage checks
    what it sends: the request fails at once with the reason, naming the stage and the edge (not at
    its deadline), and the mesh serves smaller requests as before."""
    inline = {"name": "SharedMemoryConnector", "extra": {"inline_max_bytes": 1024 * 1024}}
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
        # 1.04 MB of float64, a frame just under 1 MiB: inline, but its message is over 1 MiB
        response = mesh.request({"n": 130_550}, timeout_s=30)
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
def _two_stages(name: str, entry: str, extra: dict) -> dict:
    shm = {"name": "SharedMemoryConnector", "extra": extra}
    return {
        "name": name,
        "connectors": {"shm": shm},
        "stages": [
            {"stage_id": 0, "name": "a", "handler": f"mesh_handlers:{entry}", "output_connectors": {"to_stage_1": "shm"}},
            {"stage_id": 1, "name": "d", "handler": "mesh_handlers:step", "engine_input_source": [0], "final_output": True},
        ],
    }


def test_an_output_the_codec_cannot_carry_fails_with_one_message_naming_stage_edge_and_key_once(tmp_path: Path) -> None:
    """Each layer adds only what it knows: the coordinator the stage, the connector itself, the key
    and the edge; nobody repeats the connector or wraps the message in an exception's name."""
    with running_mesh(tmp_path, _two_stages("opaque-output", "opaque", {})) as mesh:
        response = mesh.request({"n": 3}, timeout_s=30)
        assert response.status_code == 500, response.text
        body = response.json()
        assert body["error"] == (
            f"stage 'a' failed: SharedMemoryConnector: put of key '{body['request_id']}/0' on edge a->d failed: "
            "cannot encode a value of type object at payload['x']"
        ), body


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of this test's own, private (mode 0700), to fill."""
    where = tmp_path / "small-shm"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_shared_memory_answers_503_with_retry_after_naming_stage_edge_and_sizes(
    tmp_path: Path, small_shm: Path
) -> None:
    """A stage output larger than the shared memory left: 503 (not a 500 'RuntimeError'), Retry-After,
    and a message naming the stage, the edge, the directory, the bytes asked and those free. The mesh
    serves smaller requests as before."""
    topology = _two_stages("full-shm", "step", {"memory_pool_size": "1MiB"})
    with running_mesh(tmp_path / "mesh", topology, env={"OMNI_MESH_SHM_DIR": str(small_shm)}) as mesh:
        response = mesh.request({"n": 2_600_000}, timeout_s=30)  # 20.8 MB of float64 out of stage a
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        body = response.json()
        error = body["error"]
        assert body["stage"] == "a", body
        assert error.startswith(
            f"stage 'a' failed: SharedMemoryConnector: put of key '{body['request_id']}/0' on edge a->d failed: "
            f"shared memory in {small_shm} is full: "
        ), error
        asked, free = (int(n) for n in re.search(r"full: (\d+) bytes asked, (\d+) free", error).groups())
        assert asked > 2_600_000 * 8 and free < 8 << 20, error
        assert mesh.ok({"n": 1000})["outputs"]["n"] == 1000
