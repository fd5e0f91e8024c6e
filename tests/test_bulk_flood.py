"""Strangers on a stage's bulk port cannot starve its consumers (issue 37, finding 1).

In one process, real sockets from several loopback addresses: strangers are capped per address and in
all, the oldest closed first, and hold no thread.

A real `omni-mesh up` (mesh keys: payloads from 256 KiB on are pulled from the producer's bulk port),
a keyless client on loopback holding 320 idle TCP connections to stage a's bulk port and opening a new
one whenever one is closed, and meanwhile 8 concurrent requests whose 700 KB tensors cross the
ZmqConnector edge a->d: every one succeeds, the flood holds no thread each in the stage, and the
stage counts the strangers it closed. A connector failure on an edge is a 502 naming it, never a 500.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.bulk_flood import Flooder
from support.meshkit import Mesh, running_mesh, wait_for

from omni_mesh.connectors import create_connector
from omni_mesh.connectors.served import bulk_client, bulk_door, bulk_server
from omni_mesh.security import MeshKeys

N = 87_500  # float64 elements: 700 KB on the edge a->d, over the bulk socket's 256 KiB threshold
FLOOD = 320
REQUESTS = 8
THREADS_MAX = 80  # the stage's threads during the flood (a thread per stranger: 266 and more)


def _topology(name: str, extra: dict, d: dict | None = None) -> dict:
    """Stage a -> stage d (`d`: more of d's settings) over one ZmqConnector (`extra`)."""
    edge = {"output_connectors": {"to_stage_1": "side"}}, {"input_connectors": {"from_stage_0": "side"}}
    stages = [
        {"stage_id": i, "name": stage, "handler": "mesh_handlers:step", **edge[i]}
        for i, stage in enumerate("ad")
    ]
    stages[1].update(final_output=True, **(d or {}))
    return {"name": name, "connectors": {"side": {"name": "ZmqConnector", "extra": extra}}, "stages": stages}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    topology = _topology("flood", {"memory_pool_size": 32 * 1024 * 1024})
    with running_mesh(tmp_path_factory.mktemp("flood"), topology) as mesh:
        yield mesh


def _check(body: dict) -> None:
    assert body["outputs"]["trail"] == ["a", "d"] and body["outputs"]["n"] == N, body


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for process {pid}")


def test_a_flood_of_strangers_on_the_bulk_port_starves_no_consumer(mesh: Mesh) -> None:
    _check(mesh.ok({"n": N}))  # the first put starts stage a's bulk port
    a = mesh.replica("a")
    assert a is not None
    side = a["connectors"]["side"]
    assert side["bulk_transfers"] >= 1, side  # the edge's payloads take the bulk port
    host = side["endpoint"].removeprefix("tcp://").rsplit(":", 1)[0]  # the bulk port's host
    port, pid, refused = side["bulk_port"], a["pid"], side["refused_peers"]

    with Flooder(host, port, FLOOD, limit_s=90) as flood:
        wait_for(lambda: flood.reopened >= FLOOD, 20, f"the bulk port to close {FLOOD} strangers")
        threads: list[int] = []
        with ThreadPoolExecutor(REQUESTS) as pool:
            pending = [pool.submit(mesh.request, {"n": N}, timeout_s=30) for _ in range(REQUESTS)]
            while not all(p.done() for p in pending):
                threads.append(_threads(pid))
                time.sleep(0.05)
            responses = [p.result() for p in pending]
        pressed = flood.reopened
    ok = [r for r in responses if r.status_code == 200]
    assert len(ok) == REQUESTS, [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
    for response in ok:
        _check(response.json())
    assert max(threads) <= THREADS_MAX, f"stage a ran {max(threads)} threads during the flood"
    assert pressed >= 2 * FLOOD, f"the flood was not pressing: {pressed} connections closed"
    wait_for(  # health comes with the replica's heartbeats
        lambda: mesh.connector_health("a")["side"]["refused_peers"] >= refused + FLOOD,
        10,
        "the strangers counted",
    )
    _check(mesh.ok({"n": N}))  # and after it


def test_a_connector_failure_on_an_edge_is_a_502_naming_the_edge(tmp_path: Path) -> None:
    """Stage d works on one request at a time: the second's payload waits at stage a past its ttl_s and
    is dropped there, so d's get finds nothing by get_timeout_s. The connector failed, not a handler:
    502 naming the stage, the edge and the key (it was a 500 'StageInputError')."""
    topology = _topology("lost", {"ttl_s": 0.5, "get_timeout_s": 1.5}, {"max_inflight": 1})
    with running_mesh(tmp_path, topology) as mesh, ThreadPoolExecutor(2) as pool:
        busy = pool.submit(mesh.request, {"n": 10}, params={"sleep": {"d": 2.5}}, timeout_s=30)
        time.sleep(0.3)
        lost = mesh.request({"n": 10}, timeout_s=30)
        assert busy.result().status_code == 200, busy.result().text
        assert lost.status_code == 502, lost.text
        body = lost.json()
        assert body["stage"] == "d" and "edge 0->1 (ZmqConnector)" in body["error"], body
        assert body["request_id"] in body["error"], body  # the payload's key
        assert "StageInputError" not in body["error"], body


def _strangers(source: str, port: int, count: int) -> list[socket.socket]:
    """`count` idle connections to the bulk port from `source`, opened one after the other."""
    conns = []
    for _ in range(count):
        conn = socket.socket()
        conn.bind((source, 0))
        conn.connect(("127.0.0.1", port))
        conns.append(conn)
        time.sleep(0.01)  # accepted in this order
    return conns


def _closed(conns: list[socket.socket]) -> list[bool]:
    """Which of `conns` the server closed (EOF or reset), without waiting."""
    readable = set(select.select(conns, [], [], 0)[0])
    out = []
    for conn in conns:
        gone = False
        if conn in readable:
            try:
                gone = conn.recv(1, socket.MSG_DONTWAIT) == b""
            except OSError:
                gone = True
        out.append(gone)
    return out


def test_strangers_are_capped_per_address_and_in_all_oldest_first(
    keys: MeshKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk_server, "STRANGER_WAIT_S", 30.0)  # only the caps close them here
    per, total = bulk_door.MAX_STRANGERS_PER_SOURCE, bulk_door.MAX_STRANGERS
    producer = create_connector("ZmqConnector", {"host": "127.0.0.1"})
    consumer = create_connector("ZmqConnector", {"host": "127.0.0.1", "get_timeout_s": 10})
    conns: list[socket.socket] = []
    try:
        producer.put("a", "d", "r/0", torch.ones(1 << 20, dtype=torch.uint8))  # starts the bulk port
        port, threads = producer._bulk.port, threading.active_count()
        first = _strangers("127.0.0.2", port, per + 4)  # one address past its cap: its 4 oldest go
        conns += first
        wait_for(
            lambda: _closed(first) == [True] * 4 + [False] * per, 5, "the 4 oldest from one address closed"
        )
        # More addresses, each within its cap: past the cap in all, the oldest of all go (127.0.0.2's).
        others = [_strangers(f"127.0.0.{3 + i}", port, per) for i in range(total // per)]
        conns += [c for group in others for c in group]
        wait_for(lambda: not any(_closed(others[-1])) and all(_closed(first)), 5, "the oldest of all closed")
        assert not any(c for group in others for c in _closed(group)), (
            "a stranger newer than others was closed"
        )
        assert threading.active_count() <= threads + 1, "the strangers got threads"
        assert producer.health()["refused_peers"] == len(first)
        _, _, meta = producer.put("a", "d", "r/1", torch.arange(1 << 18, dtype=torch.int32))
        got, _ = consumer.get_with_deadline("a", "d", "r/1", meta, deadline=time.monotonic() + 10)
        assert torch.equal(got, torch.arange(1 << 18, dtype=torch.int32))  # the consumer was served meanwhile
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()
        consumer.close()
        producer.close()


@pytest.mark.parametrize("slow", [1, bulk_client.STALE_ATTEMPTS - 1])
def test_a_consumer_whose_fresh_connection_is_closed_unanswered_pulls_again_on_another(
    keys: MeshKeys, monkeypatch: pytest.MonkeyPatch, slow: int
) -> None:
    """The door closes a stranger that is slow to pull (here: the consumer's first `slow` connections,
    each pull held back past STRANGER_WAIT_S, as a busy host's scheduler may hold it while a flood
    pushes it out). Nothing was served, so the consumer pulls again on a fresh connection and gets the
    payload (a full suite's load once closed two in a row, when only one retry was made)."""
    monkeypatch.setattr(bulk_server, "STRANGER_WAIT_S", 0.1)
    real_send_pull = bulk_client.BulkLinks.send_pull
    sent: list[socket.socket] = []

    def slow_first(self: bulk_client.BulkLinks, sock: socket.socket, pull: bytes) -> None:
        sent.append(sock)
        if len(sent) <= slow:
            wait_for(lambda: _closed([sock]) == [True], 5, "the door to close the slow stranger")
        real_send_pull(self, sock, pull)

    monkeypatch.setattr(bulk_client.BulkLinks, "send_pull", slow_first)
    producer = create_connector("ZmqConnector", {"host": "127.0.0.1"})
    consumer = create_connector("ZmqConnector", {"host": "127.0.0.1", "get_timeout_s": 10})
    try:
        _, _, meta = producer.put("a", "d", "r/0", torch.arange(1 << 18, dtype=torch.int32))
        got, _ = consumer.get_with_deadline("a", "d", "r/0", meta, deadline=time.monotonic() + 10)
        assert torch.equal(got, torch.arange(1 << 18, dtype=torch.int32))
        assert len(sent) == slow + 1 and len(set(map(id, sent))) == slow + 1, sent
        assert producer.health()["refused_peers"] == slow  # the slow connections, closed as strangers
    finally:
        consumer.close()
        producer.close()
