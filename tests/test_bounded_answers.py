"""Large answers cost the coordinator bounded memory and time.

- A client that does not read its answer is cut off once its write buffer has not shrunk for the
  write deadline, and what was buffered for it is freed; a client that reads slowly is not.
- A large answer is encoded as it is sent (coordinator/http/json_body.py), to the same text as a whole one.
- A real mesh whose stage answers 10 MB: 20 raw-socket clients that never read are all closed by the
  coordinator within the deadline, its RSS returns under 150 MiB above its baseline, and a client that
  reads meanwhile gets its whole answer.
- A mesh-key holder's 200 MiB frames on the control socket are refused before they are buffered.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import uvicorn
import zmq
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from support.meshkit import Mesh, running_mesh, wait_for

from omni_mesh import cli, control
from omni_mesh.coordinator.http import json_body
from omni_mesh.coordinator.http.json_body import json_answer, json_chunks
from omni_mesh.coordinator.http.jsonable import jsonable
from omni_mesh.coordinator.http.limits import WRITE_TIMEOUT_S, read_deadlines
from omni_mesh.ports import free_port
from omni_mesh.procinfo import descendants
from omni_mesh.security import ENV_KEYS_DIR, MeshKeys, secure_client

MiB = 1 << 20
ANSWER_BYTES = 10 * 1000 * 1000
DEADLINE_S = 2.0
CLIENT_RCVBUF = 32 * 1024  # a client that does not read: the kernel takes little of the answer for it
TCP_ESTABLISHED = 1  # tcpi_state in the kernel's struct tcp_info


# ================================================================== encoding as it is sent


def whole(content: object) -> bytes:
    return JSONResponse(jsonable(content)).body


def streamed(content: object) -> bytes:
    return b"".join(json_chunks(content))


def _values() -> dict[str, object]:
    rng = random.Random(7)
    blob = rng.randbytes(json_body.BASE64_SLICE * 3 + 5)
    grid = torch.arange(300 * 500, dtype=torch.float32).reshape(300, 500) / 7
    return {
        "bytes": blob,
        "bytearray": bytearray(blob[:400_001]),
        "strided memoryview": memoryview(blob)[::2],
        "int16 memoryview": memoryview(np.arange(200_000, dtype=np.int16)),
        "1-d tensor": torch.arange(100_003, dtype=torch.int64),
        "2-d tensor": grid,
        "one long row": grid.reshape(1, 1, -1),
        "bfloat16": grid.to(torch.bfloat16),
        "float8": grid.to(torch.float8_e4m3fn),
        "non-finite": torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5] * 20_000),
        "non-contiguous": grid.t(),
        "numpy": np.arange(90_000, dtype=np.float64).reshape(300, 300) / 3,
        "nested": {"text": "größe ✓ \"quoted\"\n", "n": [1, 2.5, None, True], "set": {3, 1, 2},
                   "deep": [{"blob": blob, "x": grid[:2]}, (1, "a")], 7: slice(1, None)},
    }


@pytest.mark.parametrize("name", list(_values()))
def test_a_streamed_answer_reads_exactly_as_a_whole_one(name: str) -> None:
    value = {"outputs": _values()[name], "request_id": "r-1"}
    assert streamed(value) == whole(value)


def test_only_large_answers_are_streamed_in_bounded_chunks() -> None:
    assert isinstance(json_answer({"x": b"a" * 1000, "t": torch.zeros(100)}), JSONResponse)
    answer = json_answer({"x": b"a" * json_body.STREAM_FROM_BYTES})
    assert isinstance(answer, StreamingResponse) and answer.media_type == "application/json"
    chunks = list(json_chunks({"x": random.randbytes(5 * MiB), "t": torch.rand(600_000)}))
    assert len(chunks) > 20
    assert max(map(len, chunks)) < 2 * json_body.CHUNK_CHARS, "a chunk is not bounded"


# ================================================================== the write deadline, one app


def big_app(size: int = ANSWER_BYTES) -> FastAPI:
    app = FastAPI()
    answer = random.Random(1).randbytes(size)

    @app.get("/whole")
    async def whole_route() -> Response:
        return Response(answer, media_type="application/octet-stream")

    @app.get("/stream")
    async def stream_route() -> StreamingResponse:
        async def chunks() -> Iterator[bytes]:
            try:
                for start in range(0, size, 64 * 1024):
                    yield answer[start : start + 64 * 1024]
            finally:
                app.state.stream_ended = time.monotonic()

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    return app


@contextlib.contextmanager
def serving(app: FastAPI, write_timeout_s: float) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", ws="none",
        http=read_deadlines(5.0, 5.0, write_timeout_s),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 10, "uvicorn to start")
    assert server.started, "uvicorn did not start"
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def non_reader(port: int, path: str, body: bytes = b"", method: str = "GET") -> socket.socket:
    """A client that sends one request and reads nothing (its receive buffer kept small)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.connect(("127.0.0.1", port))
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server ended the connection (reset or FIN), seen without reading from it."""
    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    return state != TCP_ESTABLISHED


def drain(sock: socket.socket, timeout_s: float = 5.0) -> tuple[int, bool]:
    """Read what is left: (bytes read, whether the server ended the connection within `timeout_s`)."""
    sock.settimeout(timeout_s)
    got = 0
    try:
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
    except ConnectionResetError:
        pass
    except TimeoutError:
        return got, False
    return got, True


@pytest.mark.parametrize("path", ["/whole", "/stream"])
def test_a_client_that_does_not_read_is_cut_off_at_the_write_deadline(path: str) -> None:
    app = big_app()
    with serving(app, write_timeout_s=1.0) as port:
        with non_reader(port, path) as sock:
            started = time.monotonic()
            wait_for(lambda: closed_by_server(sock), 1.0 + 3.0, "the server to cut a client that reads nothing")
            cut_after = time.monotonic() - started
            got, ended = drain(sock)
        assert ended and got < ANSWER_BYTES, f"the whole answer ({got} bytes) was sent: nothing was cut"
        assert cut_after > 0.9, f"cut after {cut_after:.2f} s, before the deadline"
        if path == "/stream":  # the app saw the client go away and stopped making the answer
            assert getattr(app.state, "stream_ended", None) is not None


def test_a_client_that_reads_slowly_gets_everything() -> None:
    """About 4 s to read 3 MB with the deadline at 2 s: the buffer shrinks in every period, so the
    connection stays (time, not progress, would have cut it)."""
    size = 3 * 1000 * 1000
    with serving(big_app(size), write_timeout_s=2.0) as port, non_reader(port, "/whole") as sock:
        sock.settimeout(10)
        got = b""
        while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < size:
            chunk = sock.recv(64 * 1024)
            assert chunk, f"the server closed a slow reader after {len(got)} bytes"
            got += chunk
            time.sleep(0.08)
        assert got.partition(b"\r\n\r\n")[2] == random.Random(1).randbytes(size)


def test_the_write_deadline_is_a_flag_and_must_be_positive() -> None:
    parser = cli._build_parser()
    assert parser.parse_args(["up", "t.yaml"]).write_timeout_s == WRITE_TIMEOUT_S
    args = parser.parse_args(["coordinator", "t.yaml", "--write-timeout-s", "2.5"])
    assert cli._rest_settings(args)["write_timeout_s"] == 2.5
    with pytest.raises(cli.CliError, match="--write-timeout-s must be > 0"):
        cli._rest_settings(parser.parse_args(["coordinator", "t.yaml", "--write-timeout-s", "0"]))
    with pytest.raises(ValueError, match="write timeout must be > 0"):
        read_deadlines(1.0, 1.0, 0.0)


# ================================================================== a real mesh answering 10 MB

TOPOLOGY = {"name": "bounded-answers", "stages": [{"stage_id": 0, "name": "big", "handler": "mesh_handlers:blob"}]}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("bounded"), TOPOLOGY, "--write-timeout-s", str(DEADLINE_S)) as mesh:
        yield mesh


def coordinator_pid(mesh: Mesh) -> int:
    for pid in descendants(mesh.process.pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:4] == [b"-m", b"omni_mesh", b"coordinator"]:
                return pid
    raise AssertionError(f"no coordinator process under omni-mesh up ({mesh.process.pid})")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def request_bytes(seed: int) -> bytes:
    return json.dumps({"inputs": {"size": ANSWER_BYTES, "seed": seed}, "timeout_s": 60}).encode()


def check_answer(body: dict) -> None:
    outputs = body["outputs"]
    assert hashlib.sha256(base64.b64decode(outputs["blob"])).hexdigest() == outputs["sha256"]


def test_20_clients_that_never_read_are_cut_and_their_memory_freed(mesh: Mesh) -> None:
    pid = coordinator_pid(mesh)
    check_answer(mesh.ok({"size": ANSWER_BYTES, "seed": 1}, timeout_s=60))  # warm: first answer's imports
    baseline = rss_mib(pid)
    port = int(mesh.url.rsplit(":", 1)[1])
    clients = [non_reader(port, "/v1/requests", request_bytes(seed), "POST") for seed in range(20)]
    try:
        started = time.monotonic()
        # Meanwhile a client that reads gets its whole answer.
        reader = mesh.ok({"size": ANSWER_BYTES, "seed": 99}, timeout_s=60)
        check_answer(reader)
        # Every answer is made within seconds (8-13 s for all 20 on a loaded 2-core machine), then
        # DEADLINE_S without progress cuts it.
        wait_for(
            lambda: all(map(closed_by_server, clients)), started + 40 + DEADLINE_S - time.monotonic(),
            "every client that read nothing to be cut off",
        )
        print(f"20 non-readers cut within {time.monotonic() - started:.1f} s")
        for sock in clients:
            got, ended = drain(sock)
            assert ended and got < ANSWER_BYTES, f"the whole answer ({got} bytes) was sent to a client that read nothing"
        held = wait_for(
            lambda: (rss := rss_mib(pid)) - baseline < 150 and rss, 10, "the coordinator's memory to come back"
        )
        print(f"coordinator RSS: baseline {baseline:.0f} MiB, after 20 cut clients {held:.0f} MiB")
    finally:
        for sock in clients:
            sock.close()
    assert mesh.client.get("/v1/stats").json()["requests"]["inflight"] == 0
    check_answer(mesh.ok({"size": ANSWER_BYTES, "seed": 5}, timeout_s=60))


# ================================================================== large frames on the control plane


@pytest.fixture(scope="module")
def keyed_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, MeshKeys]]:
    keys_dir = tmp_path_factory.mktemp("keys")
    MeshKeys.generate().write(keys_dir)
    with running_mesh(tmp_path_factory.mktemp("frames"), TOPOLOGY, env={ENV_KEYS_DIR: str(keys_dir)}) as mesh:
        yield mesh, MeshKeys.load(keys_dir)


def control_endpoint(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--control") + 1]


def test_a_key_holders_200_mib_frames_are_refused_and_memory_stays_near_baseline(
    keyed_mesh: tuple[Mesh, MeshKeys],
) -> None:
    """Three connections holding the mesh keys each send a 200 MiB frame to the coordinator's control
    socket (where final outputs ride inline, up to control.MAX_FRAME_BYTES): libzmq drops each peer
    at the frame's size, before buffering it, so the coordinator never holds them; it serves on."""
    mesh, keys = keyed_mesh
    pid = coordinator_pid(mesh)
    check_answer(mesh.ok({"size": ANSWER_BYTES, "seed": 1}, timeout_s=60))
    baseline = rss_mib(pid)
    assert 200 * MiB > control.MAX_FRAME_BYTES
    ctx = zmq.Context()
    peers = []
    try:
        huge = bytes(200 * MiB)
        for _ in range(3):
            peer = ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            secure_client(peer, keys)
            peer.connect(control_endpoint(pid))
            peer.send_multipart([msgpack.packb({"type": "heartbeat", "replica": "big-0", "inflight": 0}), huge])
            peers.append(peer)
        del huge
        peak, until = baseline, time.monotonic() + 8
        while time.monotonic() < until:
            peak = max(peak, rss_mib(pid))
            time.sleep(0.02)
    finally:
        for peer in peers:
            peer.close(0)
        ctx.term()
    print(f"coordinator RSS: baseline {baseline:.0f} MiB, peak {peak:.0f} MiB under 3 x 200 MiB frames")
    assert peak - baseline < 100, f"the coordinator grew by {peak - baseline:.0f} MiB for frames it refuses"
    assert mesh.client.get("/v1/stats").json()["control"]["forged_messages"] == 0, "a 200 MiB frame was taken in"
    check_answer(mesh.ok({"size": ANSWER_BYTES, "seed": 2}, timeout_s=60))



# ================================================================== a streamed answer nobody reads


def test_a_cut_stream_stops_at_once_with_a_backlog_of_events(tmp_path: Path) -> None:
    """A streaming stage sends 400 chunks of 50k floats (about 200 KB of JSON each) to a client that
    reads none: the write deadline cuts it with most chunks still queued. The stream must stop there:
    it went on through the whole backlog before (no await in it ever waited, so the disconnect was
    never delivered), converting every chunk in the event loop: /health took 45 s to answer."""
    topology = {"name": "bounded-stream", "stages": [{"stage_id": 0, "name": "gen", "handler": "mesh_handlers:gen"}]}
    with running_mesh(tmp_path, topology, "--write-timeout-s", str(DEADLINE_S)) as mesh:
        port = int(mesh.url.rsplit(":", 1)[1])
        body = json.dumps({"inputs": {"count": 400, "size": 50_000}, "stream": True, "timeout_s": 300}).encode()
        with non_reader(port, "/v1/requests", body, "POST") as sock:
            wait_for(lambda: closed_by_server(sock), 30 + DEADLINE_S, "the server to cut a stream nobody reads")
            asked = time.monotonic()
            health = mesh.client.get("/v1/stats", timeout=120).json()["requests"]
            took = time.monotonic() - asked
        assert took < 2.0, f"/health took {took:.1f} s after the cut: the stream went on"
        wait_for(lambda: "POST /v1/requests 200" in mesh.log(), 5, "the cut stream's request to end")
        assert health["inflight"] <= 1, health
        streamed = mesh.request({"count": 3, "size": 10}, stream=True)
        assert streamed.status_code == 200 and streamed.text.count("event: chunk") == 3, streamed.text
