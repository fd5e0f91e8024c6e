"""Descriptor limits: a flood of idle connections to the control port cannot starve the coordinator.

Real `omni-mesh up`, the coordinator's open-file limit lowered (prlimit) to a little more than it uses,
and far more idle TCP connections to its control port than that: past its cap the control socket
shuts new connections down at once, so the registered replicas stay healthy, the REST port still
accepts, requests succeed, and every refusal is counted.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
from collections.abc import Iterator

import pytest
from support.control_peer import control_endpoint, health
from support.meshkit import Mesh, start_mesh, wait_for

TOPOLOGY = {
    "name": "caps",
    "connectors": {"side": {"name": "ZmqConnector", "extra": {"memory_pool_size": 8 * 1024 * 1024}}},
    "stages": [
        {"stage_id": 0, "name": "a", "handler": "mesh_handlers:step", "output_connectors": {"to_stage_1": "side"}},
        {
            "stage_id": 1, "name": "d", "handler": "mesh_handlers:step",
            "input_connectors": {"from_stage_0": "side"}, "final_output": True,
        },
    ],
}
CAP = 16
REST_CAP = 32
FLOOD = 400  # idle connections to the control port: more than the descriptors the coordinator has left
HEADROOM = 120  # descriptors the coordinator gets beyond those it uses
LOW_SOFT_LIMIT = 1024


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    env = {"OMNI_MESH_MAX_CONTROL_CONNECTIONS": str(CAP), "OMNI_MESH_MAX_REST_CONNECTIONS": str(REST_CAP)}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= LOW_SOFT_LIMIT:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_LIMIT, hard))  # `up` inherits it
    try:
        mesh = start_mesh(tmp_path_factory.mktemp("caps"), TOPOLOGY, env=env)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield mesh
    except BaseException:
        mesh.kill()
        raise
    mesh.stop()


def descriptors_free(pid: int, limit: int) -> None:
    """Wait (less than the 5 s handshake limit) until `pid` uses fewer than `limit` - 32 descriptors."""
    wait_for(lambda: len(os.listdir(f"/proc/{pid}/fd")) < limit - 32, 4.0, f"the coordinator's descriptors to be free (limit {limit})")


@contextlib.contextmanager
def flooded(coordinator: int, port: int) -> Iterator[list[socket.socket]]:
    """The coordinator's open-file limit lowered to HEADROOM more than it uses and FLOOD idle TCP
    connections to `port` (those the kernel took), all closed and the limit restored on the way out."""
    soft, hard = resource.prlimit(coordinator, resource.RLIMIT_NOFILE)
    limit = max(int(fd) for fd in os.listdir(f"/proc/{coordinator}/fd")) + 1 + HEADROOM
    resource.prlimit(coordinator, resource.RLIMIT_NOFILE, (limit, hard))
    conns: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            with contextlib.suppress(OSError):
                conns.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        # The socket accepts faster than the cap refuses, so the descriptors may run out for a moment
        # while the listen backlog drains; then they are free, with every flooding connection still
        # open on our side (sooner than the 5 s handshake limit would close them without the cap).
        descriptors_free(coordinator, limit)
        yield conns
    finally:
        for conn in conns:
            conn.close()
        resource.prlimit(coordinator, resource.RLIMIT_NOFILE, (soft, hard))


def _check(body: dict, n: int = 1000) -> None:
    assert body["outputs"]["trail"] == ["a", "d"] and body["outputs"]["n"] == n, body


def test_idle_connections_over_the_cap_are_refused_and_starve_nothing(mesh: Mesh) -> None:
    endpoint, coordinator = control_endpoint(mesh)
    port = int(endpoint.rsplit(":", 1)[1])
    _check(mesh.ok({"n": 1000}))
    before = {stage: [(r["id"], r["pid"]) for r in replicas] for stage, replicas in mesh.stages().items()}
    refused = health(mesh)["refused_connections"]
    with flooded(coordinator, port) as conns:
        for _ in range(3):  # while every flooding connection is still open on our side
            _check(mesh.ok({"n": 1000}, timeout_s=10))
        now = health(mesh)
        # Most of the flood, not all: a connection still in the listen backlog is refused later.
        assert now["connections_over_cap"] >= len(conns) // 2, now
        assert now["refused_connections"] >= refused + now["connections_over_cap"], now
    after = mesh.stages()
    assert {stage: [(r["id"], r["pid"]) for r in replicas] for stage, replicas in after.items()} == before
    assert all(r["health"] == "healthy" for replicas in after.values() for r in replicas), after
    assert "over the cap of 16" in mesh.log()


def test_idle_rest_connections_over_the_cap_are_answered_503_and_closed(mesh: Mesh) -> None:
    """The same flood on the REST port: past its cap each new connection gets a 503 naming the cap and
    is closed at once, so the descriptors stay free; once the flood goes, requests are served."""
    _, coordinator = control_endpoint(mesh)
    port = int(mesh.url.rsplit(":", 1)[1])
    before = {stage: [(r["id"], r["pid"]) for r in replicas] for stage, replicas in mesh.stages().items()}
    with flooded(coordinator, port) as conns:
        last = conns[-1]
        last.settimeout(5)
        answer = last.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and f"over {REST_CAP} connections".encode() in answer, answer
        assert last.recv(4096) == b"", "a connection over the cap was kept open"
    _check(mesh.ok({"n": 1000}))
    after = mesh.stages()
    assert {stage: [(r["id"], r["pid"]) for r in replicas] for stage, replicas in after.items()} == before
    assert all(r["health"] == "healthy" for replicas in after.values() for r in replicas), after


def whole_answer(conn: socket.socket) -> bytes:
    """One HTTP answer read whole (its head and body may come in separate segments), or b"" when the
    server closed the connection before it."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(4096)
        if not piece:
            return data
        data += piece
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(4096)
    return data


def test_at_the_rest_cap_an_idle_kept_alive_connection_makes_room(mesh: Mesh) -> None:
    """REST_CAP connections, each kept alive after one request: a new client is served, not answered
    503, and the connection idle longest is the one closed for it (its client would reconnect)."""
    port = int(mesh.url.rsplit(":", 1)[1])
    head = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    idle: list[socket.socket] = []
    try:
        for _ in range(REST_CAP):
            conn = socket.create_connection(("127.0.0.1", port), timeout=5)
            idle.append(conn)
            conn.sendall(head)
            assert whole_answer(conn).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as newcomer:
            newcomer.sendall(head)
            answer = whole_answer(newcomer)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert idle[0].recv(4096) == b"", "the connection idle longest was not the one closed"
        idle[-1].sendall(head)
        assert whole_answer(idle[-1]).startswith(b"HTTP/1.1 200 "), "a recently used connection was closed"
    finally:
        for conn in idle:
            conn.close()


def test_every_process_of_the_mesh_raised_its_open_file_limit(mesh: Mesh) -> None:
    """The mesh was started with a soft RLIMIT_NOFILE of 1,024 (the common default, which let a
    thousand idle connections starve the coordinator): `up`, the coordinator and every replica raise
    theirs to the hard limit."""
    mesh.remember_tree()
    pids = [mesh.process.pid, control_endpoint(mesh)[1]]
    pids += [r["pid"] for replicas in mesh.stages().values() for r in replicas]
    for pid in pids:
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        assert soft == hard, f"process {pid} kept a soft open-file limit of {soft} (hard: {hard})"


def test_no_process_of_the_mesh_listens_on_every_interface(mesh: Mesh) -> None:
    """Every port a default `up` opens (REST, control plane, the ZeroMQ side channel of an edge) is
    bound to one address, never the wildcard: opening a port to every interface is always explicit."""
    import subprocess

    _check(mesh.ok({"n": 1000}))  # the side channel has served once
    mesh.remember_tree()
    pids = set(mesh.alive())
    listening = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, check=True).stdout.splitlines()
    ours = [line for line in listening if any(f"pid={pid}," in line for pid in pids)]
    assert len(ours) >= 3, f"expected REST, control and side-channel listeners of the mesh: {ours}"
    for line in ours:
        local = line.split()[3]  # State Recv-Q Send-Q Local Peer
        assert ":" in local and not local.startswith(("0.0.0.0:", "*:", "[::]:")), f"a mesh process listens on every interface: {line}"
