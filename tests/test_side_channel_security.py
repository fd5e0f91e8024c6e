"""The side channels our connectors own, as a stranger on the network meets them: real sockets and
real processes, for ZmqConnector and MooncakeTransferEngineConnector.

Producers run with mesh keys (`set_mesh_keys` in this process, OMNI_MESH_CURVE_PUBLIC_KEY /
OMNI_MESH_CURVE_SECRET_KEY in peer processes). A client without keys, and one with a key pair of its
own that knows the producer's public key, get no answer and make nothing happen (no payload served,
no write); the producer counts them, and the mesh's consumer in another process still gets the
payload intact. A mesh member sending a 300 MiB frame is disconnected before the producer buffers
it. A flood of garbage requests leaves the producer serving, with a handful of log lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from support.meshkit import wait_for
from support.payloads import assert_same, payload
from support.peer import Peer
from zmq.utils.monitor import recv_monitor_message

from omni_mesh.connectors import ConnectorError, create_connector
from omni_mesh.procinfo import rss_bytes
from omni_mesh.security import ENV_PUBLIC, MeshKeys, reset_mesh_keys, secure_client

ZMQ = "ZmqConnector"
TE = "MooncakeTransferEngineConnector"
CONFIGS: dict[str, dict[str, Any]] = {
    ZMQ: {"host": "127.0.0.1"},
    TE: {
        "host": "127.0.0.1",
        "memory_pool_size": "64MiB",
        "prefault": False,
        "connect_timeout_s": 2.0,
        "transfer_timeout_s": 10.0,
    },
}
EDGE = ("thinker", "talker")
PAYLOAD_OF = {ZMQ: "every_kind", TE: "mixed"}  # names in support.payloads.PAYLOADS
NO_ANSWER_S = 1.0
MiB = 1 << 20


def data_for(name: str) -> Any:
    return payload(PAYLOAD_OF[name])


def assert_intact(name: str, got: Any) -> None:
    assert_same(got, data_for(name))


def pending(name: str, health: dict) -> int:
    return health["held"] if name == ZMQ else health["pending_payloads"]


class ProducerPeer:
    """A keyed producer in another process (its memory is measured from outside)."""

    def __init__(self, name: str, keys: MeshKeys, log: Path) -> None:
        self.name = name
        self._peer = Peer(name, CONFIGS[name], log=log, env=keys.to_env())
        self.pid = self._peer.pid

    def put(self, key: str) -> dict:
        return self._peer.put(key, payload=PAYLOAD_OF[self.name], **{"from": EDGE[0], "to": EDGE[1]})

    def get(self, key: str, metadata: dict) -> None:
        """The peer gets the payload and checks it is intact."""
        reply = self._peer.get(key, metadata, expect=PAYLOAD_OF[self.name], **{"from": EDGE[0], "to": EDGE[1]})
        assert reply["ok"] and reply["mismatch"] is None, reply

    def close(self) -> None:
        self._peer.close()


def stranger_request(name: str, metadata: dict) -> list[bytes]:
    """What a stranger who saw the metadata would send: ZmqConnector's GET, or a Mooncake PULL that
    names the producer's own segment and pool address as the place to write."""
    if name == ZMQ:
        return [b"GET", metadata["key"].encode(), metadata["token"].encode()]
    request = {name: metadata[name] for name in ("session", "handle", "length", "segment", "addr")}
    return [b"PULL", metadata["key"].encode(), msgpack.packb({**request, "timeout_ms": 5000})]


def next_event(monitor: zmq.Socket, timeout_s: float) -> int | None:
    if not monitor.poll(int(timeout_s * 1000)):
        return None
    return recv_monitor_message(monitor)["event"]


# --------------------------------------------------------------------------- strangers


@pytest.mark.parametrize("name", [ZMQ, TE])
def test_strangers_get_no_answer_and_the_mesh_still_gets_its_payload(
    name: str, keys: MeshKeys, tmp_path: Path
) -> None:
    producer = create_connector(name, CONFIGS[name])
    ctx = zmq.Context()
    try:
        _, _, metadata = producer.put(*EDGE, "req-1/x", data_for(name))
        assert producer.health()["curve"] is True
        for who, own_pair in (("no keys", None), ("a key pair of its own", zmq.curve_keypair())):
            refused = producer.health()["refused_peers"]
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if own_pair is not None:  # knows the producer's public key, not the mesh's secret one
                sock.curve_serverkey = keys.public
                sock.curve_publickey, sock.curve_secretkey = own_pair
            sock.connect(metadata["endpoint"])
            sock.send_multipart(stranger_request(name, metadata))
            assert not sock.poll(int(NO_ANSWER_S * 1000)), f"the producer answered a stranger with {who}"
            sock.close()
            wait_for(lambda seen=refused: producer.health()["refused_peers"] > seen, 5, f"a refusal of {who}")
        health = producer.health()
        assert pending(name, health) == 1, health  # nothing was served, nothing written
        consumer = ProducerPeer(name, keys, tmp_path / "consumer.log")  # a mesh member, another process
        try:
            consumer.get("req-1/x", metadata)
        finally:
            consumer.close()
        assert pending(name, producer.health()) == 0
    finally:
        ctx.destroy(linger=0)
        producer.close()


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize("name", [ZMQ, TE])
def test_a_300_mib_frame_disconnects_its_sender_before_the_producer_buffers_it(
    name: str, keys: MeshKeys, tmp_path: Path
) -> None:
    producer = ProducerPeer(name, keys, tmp_path / "producer.log")
    consumer = create_connector(name, CONFIGS[name])
    ctx = zmq.Context()
    try:
        metadata = producer.put("big/x")
        before = rss_bytes(producer.pid)
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        secure_client(sock, keys)  # a mesh member: admitted, then over the size limit
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(metadata["endpoint"])
        assert next_event(monitor, 5) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        sock.send_multipart([b"GET", bytearray(300 * MiB)], copy=False)
        assert next_event(monitor, 30) == zmq.EVENT_DISCONNECTED
        sock.disable_monitor()
        monitor.close()
        sock.close()
        grown = rss_bytes(producer.pid) - before
        assert grown < 32 * MiB, f"the producer's RSS grew by {grown / MiB:.0f} MiB"
        data, _ = consumer.get(*EDGE, "big/x", metadata)  # it keeps serving the mesh
        assert_intact(name, data)
    finally:
        ctx.destroy(linger=0)
        consumer.close()
        producer.close()


@pytest.mark.parametrize("name", [ZMQ, TE])
def test_a_flood_of_garbage_leaves_the_producer_serving_and_its_log_quiet(
    name: str, keys: MeshKeys, caplog: pytest.LogCaptureFixture
) -> None:
    producer = create_connector(name, CONFIGS[name])
    consumer = create_connector(name, CONFIGS[name])
    ctx = zmq.Context()
    try:
        _, _, metadata = producer.put(*EDGE, "flood/x", data_for(name))
        caplog.clear()
        caplog.set_level(logging.INFO)
        garbage = [
            [b"\x00"],
            [b"NOPE", b"x"],
            [b"GET"],
            [b"GET", b"\xff\xfe"],
            [b"PULL", b"k", b"\xc1 not msgpack"],
            [b"PULL", b"k", msgpack.packb([1, 2])],
            [b"PULL", b"\xff", msgpack.packb({"session": 1})],
            [b"CLAIM"],
            [os.urandom(40), os.urandom(8)],
        ]
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        secure_client(sock, keys)  # a member gone wrong: its requests reach the server
        sock.connect(metadata["endpoint"])
        count = 3000
        for i in range(count):
            sock.send_multipart(garbage[i % len(garbage)])
        host, port = metadata["endpoint"].removeprefix("tcp://").rsplit(":", 1)
        for _ in range(20):  # and peers with a broken ZeroMQ greeting (bytes libzmq takes for an
            # older protocol are dropped without a monitor event, so they are not counted)
            with socket.create_connection((host, int(port)), timeout=2) as raw:
                raw.sendall(b"\xff" + os.urandom(63))
                with contextlib.suppress(OSError):  # until libzmq drops us
                    raw.recv(64)
        wait_for(lambda: producer.health()["malformed_requests"] >= count, 20, f"{count} malformed requests counted")
        wait_for(lambda: producer.health()["refused_peers"] >= 1, 5, "the flooding peer refused")
        sock.close()
        data, _ = consumer.get(*EDGE, "flood/x", metadata)
        assert_intact(name, data)
        health = producer.health()
        assert health["status"] == "healthy" and health["malformed_requests"] == count, health
        lines = [r for r in caplog.records if r.name.startswith("omni_mesh") and r.levelno >= logging.WARNING]
        assert 1 <= len(lines) <= 4, [r.getMessage() for r in lines]
    finally:
        ctx.destroy(linger=0)
        consumer.close()
        producer.close()


# --------------------------------------------------------------------------- without keys


def test_without_keys_one_warning_per_process_says_how_to_set_them() -> None:
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from omni_mesh.connectors import create_connector\n"
        "for _ in range(3):\n"
        "    connector = create_connector('ZmqConnector', {'host': '127.0.0.1'})\n"
        "    connector.put('a', 'b', 'k', 1)\n"
        "    connector.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_MESH_")}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stderr.count("omni-mesh keys generate") == 1, plain.stderr
    assert "OMNI_MESH_KEYS_DIR" in plain.stderr
    insecure = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OMNI_MESH_INSECURE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert insecure.returncode == 0, insecure.stderr[-2000:]
    assert "omni-mesh keys generate" not in insecure.stderr  # asked for: security.py says so once itself


def test_half_configured_keys_are_an_error_naming_the_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PUBLIC, MeshKeys.generate().public.decode())
    reset_mesh_keys()
    try:
        with pytest.raises(ConnectorError, match="ZmqConnector: set both"):
            create_connector(ZMQ, CONFIGS[ZMQ])
    finally:
        monkeypatch.undo()
        reset_mesh_keys()
