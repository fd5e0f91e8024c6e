"""The control plane as an attacker on the same network meets it: real `omni-mesh up`, real sockets.

The mesh runs with keys the test knows (OMNI_MESH_KEYS_DIR), so the test can play two attackers: a
stranger (no keys, or a key pair of its own) whom CURVE keeps out, and a connection that holds the
mesh keys but tries to act in another replica's name, which the coordinator's identity binding stops.
After every attack, requests in flight and after it still succeed with correct outputs, and no
shared-memory segment of the mesh has been unlinked.
"""

from __future__ import annotations

import html
import inspect
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from html.parser import HTMLParser
from pathlib import Path

import msgpack
import pytest
from support.browser import rendered
from support.control_peer import Peer, control_endpoint, health, register_message
from support.meshkit import Mesh, running_mesh, wait_for

from omni_mesh import codec
from omni_mesh.connectors.shm.lifecycle import shm_domain
from omni_mesh.connectors.shm.segments import owner_of, process_start_time
from omni_mesh.hostinfo import machine_id, namespace
from omni_mesh.procinfo import rss_bytes
from omni_mesh.security import ENV_KEYS_DIR, MeshKeys


def _stage(stage_id: int, name: str, **more: object) -> dict:
    return {"stage_id": stage_id, "name": name, "handler": "mesh_handlers:step", **more}


# a (entry) -> d (final): x = arange(n); a: 2x + 1; d: 2(2x + 1) + 4 = 4x + 6, summarised.
TOPOLOGY = {
    "name": "security",
    "connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {"memory_pool_size": 8 * 1024 * 1024}}},
    "stages": [
        _stage(0, "a", output_connectors={"to_stage_1": "shm"}),
        _stage(1, "d", input_connectors={"from_stage_0": "shm"}, final_output=True),
    ],
}
N = 50_000  # 400 KB of float64: travels through a pool segment, not inline


def _check(body: dict, n: int = N) -> None:
    out = body["outputs"]
    assert out["trail"] == ["a", "d"], out
    assert out["n"] == n and out["sum"] == 4 * (n * (n - 1) / 2) + 6 * n, out


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    MeshKeys.generate().write(directory)
    return directory


@pytest.fixture(scope="module")
def keys(keys_dir: Path) -> MeshKeys:
    return MeshKeys.load(keys_dir)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, keys_dir: Path) -> Iterator[Mesh]:
    saved = os.environ.get(ENV_KEYS_DIR)
    os.environ[ENV_KEYS_DIR] = str(keys_dir)
    try:
        with running_mesh(tmp_path_factory.mktemp("security"), TOPOLOGY) as mesh:
            yield mesh
    finally:
        if saved is None:
            os.environ.pop(ENV_KEYS_DIR, None)
        else:
            os.environ[ENV_KEYS_DIR] = saved


def mesh_segments(mesh: Mesh) -> set[str]:
    mesh.remember_tree()
    return set(mesh.our_segments())


def replica_ids(mesh: Mesh) -> dict[str, list[str]]:
    return {stage: [r["id"] for r in replicas] for stage, replicas in mesh.stages().items()}


def requests_succeed(mesh: Mesh, count: int = 4) -> None:
    with ThreadPoolExecutor(count) as pool:
        for body in pool.map(lambda _: mesh.ok({"n": N}), range(count)):
            _check(body)


# ------------------------------------------------------------------ what listens where


def test_the_coordinator_binds_its_control_plane_on_loopback_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_mesh import cli
    from omni_mesh.coordinator import serve

    monkeypatch.delenv("OMNI_MESH_CONTROL_BIND", raising=False)
    assert cli._build_parser().parse_args(["coordinator", "t.yaml"]).control == "tcp://127.0.0.1:5555"
    assert inspect.signature(serve).parameters["control"].default == "tcp://127.0.0.1:5555"
    monkeypatch.setenv("OMNI_MESH_CONTROL_BIND", "tcp://0.0.0.0:5555")  # what containers set
    assert cli._build_parser().parse_args(["coordinator", "t.yaml"]).control == "tcp://0.0.0.0:5555"


# ------------------------------------------------------------------ strangers: CURVE keeps them out


@pytest.mark.parametrize("who", ["no keys", "own key pair"])
def test_a_stranger_cannot_register_or_read_work(mesh: Mesh, keys: MeshKeys, who: str) -> None:
    endpoint, _ = control_endpoint(mesh)
    before = mesh_segments(mesh)
    refused = health(mesh)["refused_connections"]
    stranger = Peer(endpoint, keys if who == "own key pair" else None, own_pair=True)
    try:
        # Queued or not (the refused handshake may already have dropped the pipe), none must act.
        stranger.offer(register_message(mesh, "a", "evil"))
        stranger.offer({"type": "heartbeat", "replica": "a-0", "inflight": 0})
        stranger.offer({"type": "deregister", "replica": "a-0"})
        requests_succeed(mesh)  # every request goes to the real replicas, none to the stranger
        assert stranger.receive(0.5) is None, "the stranger got an answer"
    finally:
        stranger.close()
    assert "evil" not in replica_ids(mesh)["a"]
    assert replica_ids(mesh) == {"a": ["a-0"], "d": ["d-0"]}
    if who == "own key pair":  # a plain-text peer fails the handshake before ZAP is even asked
        wait_for(lambda: health(mesh)["refused_connections"] > refused, 5, "the coordinator to count the refusal")
    assert mesh_segments(mesh) >= before
    assert mesh.ready().status_code == 200


# ------------------------------------------------------------------ members acting in another's name


def test_registering_a_live_replica_id_is_refused(mesh: Mesh, keys: MeshKeys) -> None:
    endpoint, _ = control_endpoint(mesh)
    pid_before = mesh.replica("a")["pid"]
    forged = health(mesh)["forged_messages"]
    attacker = Peer(endpoint, keys)
    try:
        attacker.send(register_message(mesh, "a", "a-0"))
        answer = attacker.receive(5)
        assert answer is not None and answer["type"] == "rejected", answer
        assert "held by a live connection" in answer["error"]
        requests_succeed(mesh)
    finally:
        attacker.close()
    assert mesh.replica("a")["pid"] == pid_before
    assert health(mesh)["forged_messages"] > forged


def test_heartbeats_deregister_and_errors_in_another_replicas_name_are_dropped(mesh: Mesh, keys: MeshKeys) -> None:
    endpoint, _ = control_endpoint(mesh)
    forged = health(mesh)["forged_messages"]
    attacker = Peer(endpoint, keys)
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            attacker.send({"type": "heartbeat", "replica": "a-0", "inflight": 99, "draining": True})
            attacker.send({"type": "deregister", "replica": "d-0"})
            time.sleep(0.02)

    forger = threading.Thread(target=forge)
    forger.start()
    try:
        for _ in range(3):
            requests_succeed(mesh)
            assert mesh.ready().status_code == 200
    finally:
        stop.set()
        forger.join()
        attacker.close()
    stages = mesh.stages()
    assert [r["id"] for r in stages["d"]] == ["d-0"] and stages["a"][0]["health"] == "healthy"
    assert health(mesh)["forged_messages"] > forged


def test_outputs_only_count_from_the_replica_that_was_sent_the_request(mesh: Mesh, keys: MeshKeys) -> None:
    """A member registers a replica of stage a, takes some requests, and answers them in d-0's name and
    at the wrong stage with a forged final output. None of it reaches a client: once it leaves, its
    requests are retried on a-0 and every client gets the true output."""
    endpoint, _ = control_endpoint(mesh)
    rogue = Peer(endpoint, keys)
    try:
        rogue.send(register_message(mesh, "a", "rogue"))
        assert rogue.receive(5)["type"] == "registered"
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(mesh.ok, {"n": N}, timeout_s=20) for _ in range(6)]
            work = [m for m in rogue.messages(2.0) if m["type"] == "work"]
            assert work, "the rogue replica got no work (round robin should have sent it some)"
            forged_frame = bytes(codec.encode({"trail": ["forged"], "n": 1, "sum": -1.0}))
            for message in work:
                rid = message["rid"]
                base = {"type": "output", "rid": rid, "edges": {}, "seq": 0, "last": True, "final": True}
                rogue.send({**base, "stage": "d", "replica": "d-0"}, forged_frame)  # another's name
                rogue.send({**base, "stage": "d", "replica": "rogue"}, forged_frame)  # a stage it is not
                forged = {"error": "forged", "kind": "handler_failed"}
                rogue.send({"type": "error", "rid": rid, "stage": "a", "replica": "a-0", **forged})
            time.sleep(0.3)
            rogue.send({"type": "deregister", "replica": "rogue"})  # its requests are retried on a-0
            for future in futures:
                _check(future.result())
    finally:
        rogue.close()
    assert "rogue" not in replica_ids(mesh)["a"]


class _Markup(HTMLParser):
    """Every element, attribute name and element id in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attributes: set[str] = set()
        self.ids: set[str | None] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes.update(name for name, _ in attrs)
        self.ids.update(value for name, value in attrs if name == "id")


def test_a_replica_id_of_html_is_shown_as_text_on_the_dashboard(mesh: Mesh, keys: MeshKeys) -> None:
    """A member registers a replica whose id is markup. Headless Chromium renders /dashboard: the id
    is in the page as text, and nothing of it became an element or an attribute."""
    endpoint, _ = control_endpoint(mesh)
    rogue_id = '<img src=x onerror="document.title=1"><b id=pwned>'
    rogue = Peer(endpoint, keys)
    try:
        rogue.send(register_message(mesh, "a", rogue_id))
        assert rogue.receive(5)["type"] == "registered"
        stop = threading.Event()

        def beat() -> None:  # a silent replica is dropped after the heartbeat timeout; Chromium takes a while
            while not stop.wait(0.5):
                rogue.send({"type": "heartbeat", "replica": rogue_id, "inflight": 0})

        beating = threading.Thread(target=beat)
        beating.start()
        try:
            page = rendered(f"{mesh.url}/dashboard")
        finally:
            stop.set()
            beating.join()
        rogue.send({"type": "deregister", "replica": rogue_id})
    finally:
        rogue.close()
    markup = _Markup()
    markup.feed(page)
    assert "td" in markup.tags and 'data-replica="a-0"' in page, page[-3000:]  # the page drew its data
    assert html.escape(rogue_id, quote=False) in page, page[-3000:]  # the id, as text
    assert "img" not in markup.tags and "pwned" not in markup.ids, (markup.tags, markup.ids)
    assert "onerror" not in markup.attributes, markup.attributes


def test_dashboard_answers_carry_a_strict_content_security_policy(mesh: Mesh) -> None:
    for path, kind in (("/dashboard", "text/html"), ("/dashboard.js", "text/javascript"), ("/dashboard.css", "text/css")):
        response = mesh.client.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind), path
        policy = {d.split()[0]: d.split()[1:] for d in response.headers["content-security-policy"].split("; ")}
        assert policy["default-src"] == ["'self'"] and policy["script-src"] == ["'self'"], policy
        assert policy["frame-ancestors"] == ["'none'"] and "'unsafe-inline'" not in str(policy), policy
        assert response.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in mesh.client.get("/dashboard").text  # no inline script: the policy would block it


def test_an_oversized_output_fails_its_request_at_once_naming_the_stage(mesh: Mesh, keys: MeshKeys) -> None:
    """A member's replica answers its work with an output message over the 1 MiB limit (what a stage
    did when its metadata carried a large header). The coordinator refuses to decode it, but reads the
    request id from its first fields and fails that request at once (502 naming the stage and the
    reason), not at its deadline; the other requests are served as before."""
    endpoint, _ = control_endpoint(mesh)
    rogue = Peer(endpoint, keys)
    try:
        rogue.send(register_message(mesh, "a", "bloated"))
        assert rogue.receive(5)["type"] == "registered"
        with ThreadPoolExecutor(2) as pool:  # one of the two goes to the rogue (the least loaded)
            def timed_request():
                response = mesh.request({"n": N}, timeout_s=30)
                return response, time.monotonic()

            futures = [pool.submit(timed_request) for _ in range(2)]
            work = None
            while work is None or work["type"] != "work":
                work = rogue.receive(5)
                assert work is not None, "the rogue replica got no work"
            meta = {"header": bytes(1_200_000), "refs": []}
            sent = time.monotonic()
            rogue.send({"type": "output", "rid": work["rid"], "stage": "a", "replica": "bloated",
                        "edges": {"d": {"key": "k", "meta": meta}}, "seq": 0, "last": True})
            answered = [future.result() for future in futures]
        responses = [response for response, _ in answered]
        failed, ended = next(a for a in answered if a[0].headers["x-request-id"] == work["rid"])
        # Well inside the heartbeat timeout (5 s), after which a silent replica's work is retried. (Only
        # the rogue's request is timed: the other is served by a real replica, slow on a loaded host.)
        assert ended - sent < 2.5, f"the request ended {ended - sent:.1f} s after the output"
        assert failed.status_code == 502, failed.text
        assert "stage 'a' replica 'bloated'" in failed.json()["error"] and "exceeds" in failed.json()["error"]
        _check(next(r for r in responses if r is not failed).json())
    finally:
        rogue.send({"type": "deregister", "replica": "bloated"})
        rogue.close()
    wait_for(lambda: "bloated" not in replica_ids(mesh)["a"], 5, "the rogue replica to leave")
    requests_succeed(mesh)


@pytest.mark.parametrize(
    ("kind", "status", "says"),
    [
        ("on_fire", 502, "field 'kind' is 'on_fire', not one of handler_failed"),
        ("connector_full", 503, "stage 'a' failed: no room for 4 MiB"),
        ("invalid_input", 422, "stage 'a': no room for 4 MiB"),
    ],
    ids=["unknown kind", "connector full", "invalid input"],
)
def test_a_stage_says_how_it_failed_and_the_coordinator_answers_for_it(
    mesh: Mesh, keys: MeshKeys, kind: str, status: int, says: str
) -> None:
    """A replica fails its request with a failure kind, never an HTTP status: the coordinator answers
    the status for it (503 with Retry-After for a full connector), and an error of a kind it does not
    know fails the request at once (502 naming the field and the kinds), not at its deadline."""
    endpoint, _ = control_endpoint(mesh)
    rogue = Peer(endpoint, keys)
    try:
        rogue.send(register_message(mesh, "a", "failing"))
        assert rogue.receive(5)["type"] == "registered"
        # One of the two goes to the new replica (the least loaded): a-0 takes its time with the other.
        slow = {"sleep": {"a": 1.0}}
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(mesh.request, {"n": N}, params=slow, timeout_s=30) for _ in range(2)]
            work = None
            while work is None or work["type"] != "work":
                work = rogue.receive(5)
                assert work is not None, "the new replica got no work"
            sent = time.monotonic()
            rogue.send({"type": "error", "rid": work["rid"], "stage": "a", "replica": "failing",
                        "error": "no room for 4 MiB", "kind": kind})
            answered = {}  # response -> seconds after the error
            for future in as_completed(futures):
                answered[future.result()] = time.monotonic() - sent
        failed = next(r for r in answered if r.headers["x-request-id"] == work["rid"])
        assert answered[failed] < 2.5, f"the request ended {answered[failed]:.1f} s after the error"
        assert failed.status_code == status and says in failed.json()["error"], failed.text
        assert failed.headers.get("retry-after") == ("1" if status == 503 else None), failed.headers
        _check(next(r for r in answered if r is not failed).json())
    finally:
        rogue.send({"type": "deregister", "replica": "failing"})
        rogue.close()
    wait_for(lambda: "failing" not in replica_ids(mesh)["a"], 5, "the failing replica to leave")


def test_a_silent_replica_with_a_greedy_prefix_reaps_nothing(mesh: Mesh, keys: MeshKeys) -> None:
    """Registers claiming a live process's pid and the whole segment namespace as its prefix, then goes
    silent: it is taken out, and no segment is unlinked (the coordinator derives the prefix itself and
    only for a process it has seen die)."""
    endpoint, _ = control_endpoint(mesh)
    a_pid = mesh.replica("a")["pid"]
    requests_succeed(mesh)  # the producers' pools exist
    before = mesh_segments(mesh)
    assert before, "the mesh has no segments to protect"
    attacker = Peer(endpoint, keys)
    try:
        message = register_message(
            mesh, "a", "greedy", pid=a_pid, start=process_start_time(a_pid), pidns=namespace("pid"),
            machine=machine_id(), cleanup={"SharedMemoryConnector": {"domain": shm_domain(), "prefix": "omnimesh_"}},
        )
        attacker.send(message)
        assert attacker.receive(5)["type"] == "registered"
    finally:
        attacker.close()  # silent from now on
    wait_for(lambda: "greedy" not in replica_ids(mesh)["a"], 15, "the silent replica to be taken out")
    assert mesh_segments(mesh) >= before
    requests_succeed(mesh)


# ------------------------------------------------------------------ limits


def test_an_oversized_frame_is_refused_not_buffered(mesh: Mesh, keys: MeshKeys) -> None:
    endpoint, coordinator_pid = control_endpoint(mesh)
    rss_before = rss_bytes(coordinator_pid)
    attacker = Peer(endpoint, keys)
    try:
        huge = bytes(300 * 1024 * 1024)
        attacker.send({"type": "heartbeat", "replica": "a-0", "inflight": 0}, huge)
        del huge
        time.sleep(2.0)
        requests_succeed(mesh)
    finally:
        attacker.close()
    grown = rss_bytes(coordinator_pid) - rss_before
    assert grown < 100 * 1024 * 1024, f"the coordinator grew by {grown >> 20} MiB"


def test_registers_and_heartbeats_over_their_size_limit_are_dropped_not_kept(mesh: Mesh, keys: MeshKeys) -> None:
    """What a register or heartbeat says, the coordinator keeps while its replica lives and shows on
    /v1/stages: a member padding them to 200 KB (under the 1 MiB of other control messages) is not
    registered, and its heartbeat is dropped and counted, the replica keeping what it said before."""
    endpoint, _ = control_endpoint(mesh)
    padded = {"side": {"status": "healthy", "pad": "x" * 200_000}}
    malformed = health(mesh)["malformed_messages"]
    member = Peer(endpoint, keys)
    try:
        member.send(register_message(mesh, "a", "padded-0", connectors=padded))
        assert member.receive(2) is None, "an oversized register was answered"
        assert "padded-0" not in replica_ids(mesh)["a"]
        member.send(register_message(mesh, "a", "small-0", connectors={"side": {"status": "healthy"}}))
        assert member.receive(5)["type"] == "registered"
        member.send({"type": "heartbeat", "replica": "small-0", "inflight": 0, "connectors": padded})
        wait_for(lambda: health(mesh)["malformed_messages"] >= malformed + 2, 5, "both to be counted")
        small = next(r for r in mesh.stages()["a"] if r["id"] == "small-0")
        assert small["connectors"] == {"side": {"status": "healthy"}}, str(small)[:300]
        member.send({"type": "deregister", "replica": "small-0"})
        wait_for(lambda: "small-0" not in replica_ids(mesh)["a"], 5, "small-0 to deregister")
    finally:
        member.close()
    requests_succeed(mesh)


def test_a_garbage_flood_is_counted_and_logged_sparingly(mesh: Mesh, keys: MeshKeys) -> None:
    endpoint, _ = control_endpoint(mesh)
    log_before = mesh.log().count("refused")
    malformed = health(mesh)["malformed_messages"]
    attacker = Peer(endpoint, keys)
    garbage = [
        b"\xc1", b"not msgpack at all", msgpack.packb([1, 2, 3]), msgpack.packb({"type": "nope"}),
        msgpack.packb({"type": "output", "rid": "x"}), msgpack.packb({"type": "heartbeat", "replica": 5}),
        msgpack.packb({"type": "work", "rid": "x", "stage": "a", "params": {}}),  # only we send work
    ]
    try:
        for i in range(5000):
            attacker.sock.send(garbage[i % len(garbage)])
        requests_succeed(mesh)
        wait_for(lambda: health(mesh)["malformed_messages"] >= malformed + 4000, 10, "the flood to be counted")
    finally:
        attacker.close()
    assert mesh.log().count("refused") - log_before < 20, "the flood filled the log"
    assert mesh.ready().status_code == 200


def _open_idle(address: tuple[str, int], count: int) -> list[socket.socket]:
    """Up to `count` idle TCP connections to `address` (one refused or timed out ends the attempt)."""
    conns = []
    for _ in range(count):
        try:
            conns.append(socket.create_connection(address, timeout=2))
        except OSError:
            break
    return conns


def test_running_the_coordinator_out_of_descriptors_takes_no_live_replica_out(mesh: Mesh) -> None:
    """Idle connections to the control and REST ports exhaust the coordinator's file descriptors
    (its limit lowered to a few more than it uses). It cannot read /proc then, which says nothing
    about its replicas: none is taken out or registers again, no segment is unlinked, the failure is
    logged once (not every 50 ms), and once the connections go the mesh serves as before."""
    requests_succeed(mesh)
    endpoint, coordinator = control_endpoint(mesh)
    before, replicas = mesh_segments(mesh), mesh.stages()
    assert before, "the mesh has no segments to protect"
    mark = len(mesh.log())
    soft, hard = resource.prlimit(coordinator, resource.RLIMIT_NOFILE)
    limit = max(int(fd) for fd in os.listdir(f"/proc/{coordinator}/fd")) + 1 + 16
    control_port = int(endpoint.rsplit(":", 1)[1])
    rest_port = int(mesh.url.rsplit(":", 1)[1])
    resource.prlimit(coordinator, resource.RLIMIT_NOFILE, (limit, hard))
    conns: list[socket.socket] = []
    try:
        # Fewer than either listener's backlog: past it, connect() would wait for minutes.
        conns += _open_idle(("127.0.0.1", control_port), 60)
        conns += _open_idle(("127.0.0.1", rest_port), 150)
        time.sleep(0.5)
        assert len(os.listdir(f"/proc/{coordinator}/fd")) >= limit - 1, "the coordinator's descriptors are not used up"
        time.sleep(3.5)  # 70 ticks of the monitor loop, every one of them without descriptors
    finally:
        for conn in conns:
            conn.close()
        resource.prlimit(coordinator, resource.RLIMIT_NOFILE, (soft, hard))
    requests_succeed(mesh)
    after = mesh.stages()
    for stage, was in replicas.items():
        now = after[stage]
        assert [(r["id"], r["pid"], r["restarts"]) for r in now] == [(r["id"], r["pid"], r["restarts"]) for r in was]
        assert now[0]["uptime_s"] > was[0]["uptime_s"] + 4, f"a replica of stage {stage} registered again: {now}"
    assert mesh_segments(mesh) >= before, "a live replica's shared memory was unlinked"
    log = mesh.log()[mark:]
    assert "died" not in log and "registered from" not in log and "deregistered" not in log, log[-3000:]
    assert log.count("Traceback") <= 1 and log.count("treating it as alive") <= 2, log[-3000:]


# ------------------------------------------------------------------ a frozen replica


def test_a_frozen_replica_fails_its_request_fast_and_comes_back(mesh: Mesh) -> None:
    """SIGSTOP the only replica of stage a for 30 s while it holds a request: the request fails when
    the replica is taken out (about the heartbeat timeout, not the 60 s deadline), /ready says so, its
    memory stays, and once resumed it registers again and serves."""
    requests_succeed(mesh)
    a = mesh.replica("a")
    pid = a["pid"]
    own = {name for name in mesh_segments(mesh) if owner_of(name).pid == pid}
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        pending = pool.submit(mesh.request, {"n": N}, params={"sleep": {"a": 2}}, timeout_s=60)
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)
        try:
            response = pending.result()
            failed_after = time.monotonic() - started
            assert response.status_code == 502, response.text
            assert "'a'" in response.json()["error"], response.text
            assert failed_after < 12, f"the request failed only after {failed_after:.1f} s"
            wait_for(lambda: mesh.ready().status_code == 503, 10, "/ready to say stage a is down")
            assert "'a'" in " ".join(mesh.ready().json()["missing"])
            frozen_until = started + 30
            while time.monotonic() < frozen_until:
                assert mesh.ready().status_code == 503
                assert own <= set(mesh.our_segments()), "a frozen replica's memory was unlinked"
                time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: mesh.ready().status_code == 200, 15, "the resumed replica to register again")
    assert mesh.replica("a")["pid"] == pid and mesh.replica("a")["restarts"] == 0
    requests_succeed(mesh)
