"""A replica's control connection dropping, and the coordinator itself standing still: real `omni-mesh
up`, real sockets, the connection cut by the kernel (`ss -K`) and the coordinator frozen by SIGSTOP.
A replica connecting while a flood fills the accept queue is registered as soon as it drains.

- A replica whose connection drops reconnects under its own random routing id: the coordinator takes
  the new connection for the replica at once (no re-registration, no 5 s out of the rotation), while a
  member holding the mesh keys cannot take the id, even in the moment the replica is away.
- A coordinator paused longer than the heartbeat timeout judges silence in its own time: on resume no
  replica is taken out and the requests in flight succeed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.control_peer import Peer, control_endpoint, health, register_message
from support.meshkit import Mesh, running_mesh, up_command, wait_for, write_topology

from omni_mesh.ports import free_port
from omni_mesh.security import ENV_KEYS_DIR, MeshKeys


def _stage(stage_id: int, name: str, **more: object) -> dict:
    return {"stage_id": stage_id, "name": name, "handler": "mesh_handlers:step", **more}


TOPOLOGY = {
    "name": "reconnect",
    "connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {"memory_pool_size": 8 * 1024 * 1024}}},
    "stages": [
        _stage(0, "a", output_connectors={"to_stage_1": "shm"}),
        _stage(1, "d", input_connectors={"from_stage_0": "shm"}, final_output=True),
    ],
}
N = 1000


def _check(body: dict) -> None:
    out = body["outputs"]
    assert out["trail"] == ["a", "d"], out
    assert out["n"] == N and out["sum"] == 4 * (N * (N - 1) / 2) + 6 * N, out


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshKeys]:
    directory = tmp_path_factory.mktemp("keys")
    MeshKeys.generate().write(directory)
    saved = os.environ.get(ENV_KEYS_DIR)
    os.environ[ENV_KEYS_DIR] = str(directory)
    try:
        yield MeshKeys.load(directory)
    finally:
        if saved is None:
            os.environ.pop(ENV_KEYS_DIR, None)
        else:
            os.environ[ENV_KEYS_DIR] = saved


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, keys: MeshKeys) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("reconnect"), TOPOLOGY) as mesh:
        yield mesh


def _connections(port: int) -> dict[int, list[int]]:
    """{pid: [local ports]} of the established TCP connections to 127.0.0.1:`port`."""
    out = subprocess.run(
        ["ss", "-Htnp", "state", "established", "dst", f"127.0.0.1:{port}"],
        capture_output=True, text=True, check=True,
    ).stdout
    found: dict[int, list[int]] = {}
    for line in out.splitlines():
        local = line.split()[2]  # Recv-Q Send-Q Local Peer: a state filter leaves the state column out
        for pid in re.findall(r"pid=(\d+)", line):
            found.setdefault(int(pid), []).append(int(local.rsplit(":", 1)[1]))
    return found


def _cut(port: int, local_ports: list[int]) -> None:
    """Destroy those TCP connections in the kernel (both ends see a reset), as a network fault would."""
    for local in local_ports:
        result = subprocess.run(
            ["ss", "-K", "dst", f"127.0.0.1:{port}", "sport", "=", f":{local}"], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr


def _control_connection(mesh: Mesh, stage: str) -> tuple[int, int, list[int]]:
    """(control port, the replica's pid, its connections' local ports to the control port)."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to cut a TCP connection")
    endpoint, _ = control_endpoint(mesh)
    port = int(endpoint.rsplit(":", 1)[1])
    pid = mesh.replica(stage)["pid"]
    local = _connections(port).get(pid)
    if not local:
        pytest.skip("ss -p does not show the replica's connection (no permission to see its sockets)")
    return port, pid, local


def _cut_or_skip(port: int, local: list[int]) -> None:
    probe = subprocess.run(["ss", "-K", "dst", "127.0.0.1:1", "sport", "=", ":1"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"ss -K cannot destroy sockets here (needs CAP_NET_ADMIN and INET_DIAG_DESTROY): {probe.stderr}")
    _cut(port, local)


def test_a_replica_whose_control_connection_drops_is_back_within_a_second(mesh: Mesh) -> None:
    """Cut stage a's only replica's control connection: within 1 s it has a new one, is listed
    healthy with the same pid and uptime (it did not register again), and serves a request; none of
    its heartbeats on the new connection was taken for a forgery."""
    _check(mesh.ok({"n": N}))
    port, pid, local = _control_connection(mesh, "a")
    before, forged = mesh.replica("a"), health(mesh)["forged_messages"]
    mark = len(mesh.log())
    _cut_or_skip(port, local)
    cut = time.monotonic()
    wait_for(lambda: set(_connections(port).get(pid, [])) - set(local), 1.0, "the replica's new control connection")
    body = mesh.ok({"n": N}, timeout_s=1.0)
    back_after = time.monotonic() - cut
    _check(body)
    after = mesh.replica("a")
    assert after["health"] == "healthy" and after["pid"] == pid and after["restarts"] == before["restarts"], after
    assert after["uptime_s"] >= before["uptime_s"], f"replica a registered again: {before} -> {after}"
    assert back_after < 1.0, f"the replica served again only {back_after:.2f} s after its connection dropped"
    print(f"control connection cut: replica back and served a request after {back_after:.2f} s")
    time.sleep(1.0)  # two heartbeats on the new connection
    assert health(mesh)["forged_messages"] == forged, "the replica's own heartbeats were counted as forged"
    assert mesh.replica("a")["last_heartbeat_s_ago"] < 0.9
    assert "registered from" not in mesh.log()[mark:]


def test_a_member_with_the_keys_cannot_take_a_dropped_replicas_id(mesh: Mesh, keys: MeshKeys) -> None:
    """The moment a replica's connection drops, a member holding the mesh keys registers in its name
    and heartbeats for it, from a routing id of its own and from one ZeroMQ would make: every attempt
    is refused, the real replica comes back on its own connection and keeps serving."""
    port, pid, local = _control_connection(mesh, "a")
    forged = health(mesh)["forged_messages"]
    endpoint, _ = control_endpoint(mesh)
    rogues = [Peer(endpoint, keys), Peer(endpoint, keys, routing_id=b"\x00\x00\x00\x00\x01")]
    try:
        for rogue in rogues:  # connected and handshaken before the cut: ready to strike at once
            rogue.send({"type": "heartbeat", "replica": "nobody", "inflight": 0})
            assert rogue.receive(5) is not None, "the rogue member's connection was not taken"
        _cut_or_skip(port, local)
        for rogue in rogues:
            rogue.send(register_message(mesh, "a", "a-0"))
            rogue.send({"type": "heartbeat", "replica": "a-0", "inflight": 0, "draining": True})
        answers = [rogue.receive(5) for rogue in rogues]
        for answer in answers:
            assert answer is not None and answer["type"] == "rejected", answers
        assert "held by a live connection" in answers[0]["error"], answers
        assert "routing id" in answers[1]["error"], answers
        wait_for(lambda: set(_connections(port).get(pid, [])) - set(local), 2.0, "the replica's new connection")
        with ThreadPoolExecutor(4) as pool:
            for body in pool.map(lambda _: mesh.ok({"n": N}), range(4)):
                _check(body)
    finally:
        for rogue in rogues:
            rogue.close()
    replica = mesh.replica("a")
    assert replica["pid"] == pid and replica["health"] == "healthy", replica
    assert [r["id"] for r in mesh.stages()["a"]] == ["a-0"]
    assert health(mesh)["forged_messages"] > forged


# ------------------------------------------------------------------ a coordinator that stands still

HEARTBEAT_TIMEOUT_S = 1.0
PAUSE_S = 15.0  # the attack round's pause: fifteen heartbeat timeouts


def test_a_paused_coordinator_takes_no_replica_out_and_finishes_its_requests(tmp_path: Path) -> None:
    """SIGSTOP the coordinator for 15 s (15 heartbeat timeouts) while requests are in flight (one waits in
    stage a, one in stage d), then SIGCONT: on resume it reads the heartbeats queued meanwhile before
    it judges anybody silent, and counts the pause as nobody's silence. No replica is taken out or
    registers again, and every request in flight succeeds."""
    extra = ("--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S))
    with running_mesh(tmp_path, TOPOLOGY, *extra) as mesh:
        _check(mesh.ok({"n": N}))
        _, coordinator = control_endpoint(mesh)
        before = {stage: [(r["id"], r["pid"]) for r in replicas] for stage, replicas in mesh.stages().items()}
        mark = len(mesh.log())
        with ThreadPoolExecutor(2) as pool:
            pending = [
                pool.submit(mesh.request, {"n": N}, params={"sleep": {stage: 1.0}}, timeout_s=30)
                for stage in ("a", "d")
            ]
            time.sleep(0.3)
            os.kill(coordinator, signal.SIGSTOP)
            try:
                time.sleep(PAUSE_S)
            finally:
                os.kill(coordinator, signal.SIGCONT)
            for future in pending:
                response = future.result()
                assert response.status_code == 200, response.text
                _check(response.json())
        after = mesh.stages()
        assert {stage: [(r["id"], r["pid"]) for r in replicas] for stage, replicas in after.items()} == before
        for replicas in after.values():
            for replica in replicas:
                assert replica["health"] == "healthy" and replica["restarts"] == 0, replica
        log = mesh.log()[mark:]
        assert "stopped sending heartbeats" not in log and "registered from" not in log, log[-3000:]
        _check(mesh.ok({"n": N}))


def test_up_serves_its_control_plane_on_the_port_it_is_given(tmp_path: Path) -> None:
    """`up --control-port N`: the coordinator binds 127.0.0.1:N and the replicas connect there; a port
    another process holds is refused before anything starts, naming it."""
    port = free_port()
    with running_mesh(tmp_path / "one", TOPOLOGY, "--control-port", str(port)) as mesh:
        endpoint, _ = control_endpoint(mesh)
        assert endpoint == f"tcp://127.0.0.1:{port}"
        replicas = {r["pid"] for replicas in mesh.stages().values() for r in replicas}
        assert replicas <= set(_connections(port)), "a replica is not connected to the chosen control port"
        _check(mesh.ok({"n": N}))
        path = write_topology(tmp_path / "two", TOPOLOGY)
        taken = subprocess.run(
            up_command(path, free_port(), "--control-port", str(port)),
            capture_output=True, text=True, timeout=60,
        )
        assert taken.returncode != 0
        assert f"127.0.0.1:{port}" in taken.stderr and "--control-port" in taken.stderr, taken.stderr


# ------------------------------------------------------------------ what was in flight when it dropped

BURST = 16
CUT_FOR_S = 3.0
DEADLINE_S = 20.0


def _cut_repeatedly(mesh: Mesh, stages: tuple[str, ...], until: float) -> int:
    """Cut the control connections of `stages`' replicas every 0.15 s until `until`; how many cuts."""
    endpoint, _ = control_endpoint(mesh)
    port = int(endpoint.rsplit(":", 1)[1])
    pids = [mesh.replica(stage)["pid"] for stage in stages]
    cuts = 0
    while time.monotonic() < until:
        connections = _connections(port)
        for pid in pids:
            if connections.get(pid):
                _cut(port, connections[pid])
                cuts += 1
        time.sleep(0.15)
    return cuts


def test_requests_in_flight_when_connections_drop_all_succeed_long_before_their_deadline(mesh: Mesh) -> None:
    """A burst of requests, each sleeping 0.25 s in stage a and in stage d, while both replicas'
    control connections are cut again and again: work sent during a drop and outputs sent just before
    one are lost on the wire, and the replica and the coordinator reconcile after each reconnect (work
    placed again, results asked for again). Every request succeeds with the right output, none waits
    for its deadline."""
    _control_connection(mesh, "a")
    _control_connection(mesh, "d")
    _cut_or_skip(*_control_connection(mesh, "a")[::2])
    mark = len(mesh.log())

    def one(i: int) -> tuple[int, float, str]:
        started = time.monotonic()
        response = mesh.request({"n": N}, params={"sleep": {"a": 0.25, "d": 0.25}}, timeout_s=DEADLINE_S)
        took = time.monotonic() - started
        if response.status_code == 200:
            _check(response.json())
        return response.status_code, took, response.text[:300]

    with ThreadPoolExecutor(BURST + 1) as pool:
        cutter = pool.submit(_cut_repeatedly, mesh, ("a", "d"), time.monotonic() + CUT_FOR_S)
        results = list(pool.map(one, range(BURST)))
        more = list(pool.map(one, range(BURST)))  # a second wave, while the cuts go on or just after
        cuts = cutter.result()
    failed = [r for r in results + more if r[0] != 200]
    assert not failed, f"{len(failed)} of {2 * BURST} requests failed across {cuts} cuts: {failed[:3]}"
    slowest = max(took for _, took, _ in results + more)
    assert slowest < DEADLINE_S / 2, f"a request took {slowest:.1f} s: it waited for something lost in a drop"
    assert "control connection back; reconciling" in mesh.log()[mark:]
    print(f"{2 * BURST} requests across {cuts} control connection cuts: all succeeded, slowest {slowest:.2f} s")


STREAM = {
    "name": "reconnect-stream",
    "connectors": TOPOLOGY["connectors"],
    "stages": [
        {"stage_id": 0, "name": "gen", "handler": "mesh_handlers:gen", "output_connectors": {"to_stage_1": "shm"}},
        {"stage_id": 1, "name": "relay", "handler": "mesh_handlers:relay", "engine_input_source": [0],
         "input_connectors": {"from_stage_0": "shm"}, "final_output": True},
    ],
}
CHUNKS = 200
STREAMS = 8  # at once, while the connections are cut (16 of CHUNKS take ~10 s on a busy 2-core host)
STREAM_DEADLINE_S = 30.0


def test_streams_whose_control_connections_drop_get_every_chunk_in_order(tmp_path: Path) -> None:
    """Streams of CHUNKS chunks from `gen` into `relay` (which raises on a chunk out of order, and
    streams to the client) while both replicas' control connections are cut again and again: chunks
    relayed during a drop are sent again to relay from the first it lacks, and chunks gen or relay
    sent that were lost on their way to the coordinator are sent again by the replica from the first
    the coordinator lacks (stage.sent). Every stream is whole and in order: none fails, none waits for
    its deadline (a stream that lost a chunk for good would end in a 504 there)."""
    with running_mesh(tmp_path, STREAM) as mesh:
        _control_connection(mesh, "relay")
        _cut_or_skip(*_control_connection(mesh, "gen")[::2])

        def one(i: int) -> tuple[int, float, Any]:
            started = time.monotonic()
            response = mesh.request({"count": CHUNKS, "size": 4}, timeout_s=STREAM_DEADLINE_S)
            return response.status_code, time.monotonic() - started, response.json()

        with ThreadPoolExecutor(STREAMS + 1) as pool:
            cutter = pool.submit(_cut_repeatedly, mesh, ("gen", "relay"), time.monotonic() + CUT_FOR_S)
            results = list(pool.map(one, range(STREAMS)))
            cuts = cutter.result()
            results += list(pool.map(one, range(4)))  # after the cuts
        log = mesh.log()
    expected = [{"seq": i, "size": 4, "sum": 4.0 * i} for i in range(CHUNKS)]
    failed = [(status, body) for status, _, body in results if status != 200]
    assert not failed, f"{len(failed)} of {len(results)} streams failed across {cuts} cuts: {failed[:3]}"
    for _, _, body in results:
        assert body["outputs"] == expected, "a stream answered with chunks missing or out of order"
    slowest = max(took for _, took, _ in results)
    print(f"{len(results)} streams across {cuts} cuts: all whole, slowest {slowest:.2f} s; chunks sent again to "
          f"{log.count('chunk(s) again')} stream(s), outputs asked for again {log.count('asking for them again')} time(s)")


def _state(pid: int) -> str:
    """The process's state letter (/proc/PID/stat): T when stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _listen_backlog(port: int) -> int:
    """The accept queue's length of the socket listening on `port` (ss shows it as Send-Q)."""
    out = subprocess.run(["ss", "-Hltn", "sport", "=", f":{port}"], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[2])


async def _registered_at(endpoint: str, replica: str, timeout_s: float) -> float | None:
    """When (time.monotonic()) a replica's real link (stage.link) got registered; None if not within
    `timeout_s`. It deregisters at once."""
    from omni_mesh.control import Deregister, Register, Registered, unpack
    from omni_mesh.stage.link import CoordinatorLink

    link = CoordinatorLink(endpoint, replica)

    async def answers() -> None:
        while True:
            message = unpack((await link.receive())[0])
            if isinstance(message, Registered):
                link.accepted(message)

    listening = asyncio.create_task(answers())
    try:
        register = Register("a", replica, os.getpid(), "test", 1, {})
        await asyncio.wait_for(link.register(register, asyncio.Event()), timeout_s)
        at = time.monotonic()
        await link.send(Deregister(replica))
        await asyncio.sleep(0.1)  # the deregister leaves before the socket closes
        return at
    except TimeoutError:
        return None
    finally:
        listening.cancel()
        link.close()


#: How long into a connect whose SYNs are dropped the queue frees: well after a kernel retry. Linux
#: retries a SYN at 1, 3, 7, 15, 31, 63 s (since 6.5: 1, 2, 3, 4, 5, 7, 11, 19.5, 35.5, 67.5 s, late
#: by the timers' slack), so the next one comes 9 s later (13.5 s since 6.5).
PAUSED_S = 22.0


def test_a_replica_connecting_through_a_full_accept_queue_is_registered_soon_after_it_frees(
    mesh: Mesh, keys: MeshKeys
) -> None:
    """The coordinator stands still (SIGSTOP) while a flood of connections fills its control port's
    accept queue; a replica connecting meanwhile has its SYNs dropped. The flood goes and the
    coordinator resumes PAUSED_S into the replica's attempt: it is registered within seconds, not at
    the kernel's next SYN retry (9 s later or more; the retries double up to two minutes)."""
    from omni_mesh.security import reset_mesh_keys, set_mesh_keys

    endpoint, coordinator = control_endpoint(mesh)
    port = int(endpoint.rsplit(":", 1)[1])
    flood: list[socket.socket] = []

    async def attempt() -> tuple[float | None, float]:
        """(when the replica got registered, when the coordinator resumed)"""
        registering = asyncio.create_task(_registered_at(endpoint, "honest-0", 45.0))
        await asyncio.sleep(PAUSED_S)
        for conn in flood:
            conn.close()
        os.kill(coordinator, signal.SIGCONT)
        resumed = time.monotonic()
        return await registering, resumed

    set_mesh_keys(keys)
    os.kill(coordinator, signal.SIGSTOP)
    try:
        wait_for(lambda: _state(coordinator) == "T", 5, "the coordinator to stop")  # kill() does not wait
        for _ in range(_listen_backlog(port) + 1 + 16):  # the queue full, and a few SYNs dropped
            conn = socket.socket()
            conn.setblocking(False)
            conn.connect_ex(("127.0.0.1", port))
            flood.append(conn)
        time.sleep(0.5)
        registered, resumed = asyncio.run(attempt())
    finally:
        for conn in flood:
            conn.close()
        os.kill(coordinator, signal.SIGCONT)
        reset_mesh_keys()
    assert registered is not None, "the replica was not registered within 45 s"
    after = registered - resumed
    print(f"registered {after:.2f} s after the coordinator resumed, {PAUSED_S:g} s into its connect")
    assert after < 4.0, f"registered {after:.1f} s after the coordinator resumed with room in its queue"
    _check(mesh.ok({"n": N}))
