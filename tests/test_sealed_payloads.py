"""ZmqConnector's payload bytes off CURVE, sealed (served.seal): real sockets, a real packet capture.

With mesh keys a large payload leaves the producer on its plain bulk socket, in AEAD-sealed chunks.
A loopback capture of a put -> get shows none of its plaintext (and, with `encryption: none`, does:
the capture would see it). A chunk flipped in flight, a chunk replayed in place of the next, and a
stream cut short are each refused with an error naming the edge and key, and no data. A stranger on
the bulk port (plain TCP), a replayed pull and a silent connection get nothing, are closed, and leave
the payload where it was.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from support.bulk_proxy import BulkProxy
from support.meshkit import wait_for
from support.payloads import assert_same, payload
from support.peer import Peer

from omni_mesh.connectors import ConnectorError, PayloadMissing, create_connector
from omni_mesh.connectors.served import bulk_client, bulk_server, bulk_wire, seal
from omni_mesh.security import MeshKeys, secure_client

EDGE = ("thinker", "talker")
MARKER = b"OMNI-MESH-PLAINTEXT-MARKER-0123456789"
MiB = 1 << 20


def marked(size: int) -> dict:
    """A payload whose bytes repeat MARKER: any stretch of its plaintext on the wire shows it."""
    raw = (MARKER * (size // len(MARKER) + 1))[:size]
    return {"blob": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}


def pair(encryption: str = "auto") -> tuple:
    producer = create_connector("ZmqConnector", {"host": "127.0.0.1", "encryption": encryption})
    consumer = create_connector("ZmqConnector", {"host": "127.0.0.1", "get_timeout_s": 10})
    return producer, consumer


def get(consumer, key: str, meta: dict, within_s: float = 10):
    return consumer.get_with_deadline(*EDGE, key, meta, deadline=time.monotonic() + within_s)


# --------------------------------------------------------------------------- what the wire shows


class LoopbackCapture:
    """The loopback packets of some TCP ports, captured from the kernel (tcpdump's AF_PACKET socket,
    read here directly: root only) while the `with` block runs."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = set(ports)
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.1)
        self._sock.setsockopt(socket.SOL_SOCKET, 33, 256 * MiB)  # SO_RCVBUFFORCE (root): no drops
        self._stop = threading.Event()
        self.packets: list[bytes] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame, address = self._sock.recvfrom(1 << 18)
            except TimeoutError:
                continue
            if address[2] == socket.PACKET_OUTGOING:  # loopback shows each packet twice
                continue
            ip = frame[14:]
            if frame[12:14] != b"\x08\x00" or ip[9] != 6:  # IPv4, TCP
                continue
            tcp = ip[(ip[0] & 0x0F) * 4 :]
            if {int.from_bytes(tcp[0:2], "big"), int.from_bytes(tcp[2:4], "big")} & self._ports:
                self.packets.append(frame)

    def __enter__(self) -> LoopbackCapture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # the last packets reach the socket
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def captured(producer, consumer, key: str) -> bytes:
    """The loopback bytes of one get (side channel and bulk socket), as captured."""
    _, _, meta = producer.put(*EDGE, key, marked(4 * MiB))
    ports = [int(meta["endpoint"].rsplit(":", 1)[1]), producer._bulk.port]
    with LoopbackCapture(ports) as capture:
        got, _ = get(consumer, key, meta)
        assert bytes(got["blob"].numpy()) == bytes(marked(4 * MiB)["blob"].numpy())
    data = b"".join(capture.packets)
    assert len(data) > 4 * MiB, f"the capture holds {len(data)} bytes: it missed the transfer"
    return data


@pytest.mark.skipif(
    not hasattr(socket, "AF_PACKET") or os.geteuid() != 0, reason="a packet capture needs root"
)
def test_a_capture_of_put_get_shows_no_plaintext_and_with_none_it_does(keys: MeshKeys) -> None:
    for encryption, shows in (("auto", False), ("none", True)):
        producer, consumer = pair(encryption)
        try:
            data = captured(producer, consumer, f"req/{encryption}")
            assert (MARKER in data) is shows, f"encryption {encryption}: plaintext on the wire is {not shows}"
            assert producer.health()["encryption"] == seal.resolve(encryption)
        finally:
            producer.close()
            consumer.close()


# --------------------------------------------------------------------------- altered in flight


@pytest.mark.parametrize(
    "mode, says",
    [("flip", "failed authentication"), ("replay", "failed authentication"), ("cut", "no answer will come")],
)
def test_a_chunk_altered_replayed_or_cut_short_is_refused_naming_edge_and_key(
    keys: MeshKeys, mode: str, says: str
) -> None:
    producer, consumer = pair()
    proxy = None
    try:
        _, _, meta = producer.put(*EDGE, "req-7/hidden", marked(8 * MiB))
        proxy = BulkProxy(producer._bulk.port, mode, after=2)
        producer._bulk.port = proxy.port  # the description sends the consumer through the proxy
        with pytest.raises(ConnectorError) as caught:
            get(consumer, "req-7/hidden", meta)
        message = str(caught.value)
        assert proxy.altered.is_set()
        # A stream cut short: the producer is gone as far as this get knows (the errors family's kind).
        assert isinstance(caught.value, PayloadMissing) is (mode == "cut"), type(caught.value)
        assert says in message and "thinker->talker" in message and "req-7/hidden" in message, message
    finally:
        if proxy is not None:
            proxy.close()
        producer.close()
        consumer.close()


def test_unaltered_through_the_same_proxy_arrives_intact(keys: MeshKeys) -> None:
    """The proxy itself is faithful: the refusals above are the alterations'."""
    producer, consumer = pair()
    proxy = None
    try:
        _, _, meta = producer.put(*EDGE, "req-8/hidden", marked(8 * MiB))
        proxy = BulkProxy(producer._bulk.port, "flip", after=10**6)
        producer._bulk.port = proxy.port
        got, size = get(consumer, "req-8/hidden", meta)
        assert bytes(got["blob"].numpy()) == bytes(marked(8 * MiB)["blob"].numpy()) and size > 8 * MiB
    finally:
        if proxy is not None:
            proxy.close()
        producer.close()
        consumer.close()


# --------------------------------------------------------------------------- strangers on the bulk port


def until_closed(sock: socket.socket, within_s: float) -> bytes:
    """What `sock` receives until the bulk port closes it; fails if that takes over `within_s`."""
    sock.settimeout(within_s)
    answer = b""
    try:
        while more := sock.recv(1 << 16):
            answer += more
    except ConnectionResetError:  # closed with bytes of ours unread: a close all the same
        pass
    except TimeoutError:
        raise AssertionError(f"the bulk port kept a connection open {within_s} s") from None
    return answer


def refused(port: int, data: bytes, within_s: float = 5) -> bytes:
    """What the bulk port answers `data` with before it closes the connection (a stranger: b"")."""
    with socket.create_connection(("127.0.0.1", port), timeout=within_s) as sock:
        sock.sendall(data)
        return until_closed(sock, within_s)


def test_a_stranger_on_the_bulk_port_gets_nothing_and_a_replayed_pull_neither(
    keys: MeshKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk_server, "STRANGER_WAIT_S", 1.0)  # the short message's wait
    producer, consumer = pair()
    try:
        _, _, meta = producer.put(*EDGE, "req-9/x", marked(2 * MiB))
        port = producer._bulk.port
        session = seal.Session.fresh()  # a pull for a session the producer never offered
        strangers = {
            "a pull for a session never offered": bulk_wire.PULL + session.sid + session.proof(),
            "a pull of garbage": bulk_wire.PULL + b"x" * 16 + b"y" * 32,
            "52 bytes of garbage": b"GET " * 13,
            "a short message, then silence": b"GET",
        }
        assert all(len(data) == bulk_wire.PULL_BYTES for data in list(strangers.values())[:3])
        for what, data in strangers.items():
            assert refused(port, data) == b"", f"the bulk port answered {what}"
        wait_for(lambda: producer.health()["refused_peers"] >= len(strangers), 5, "a refusal per stranger")
        assert producer.health()["held"] == 1  # nothing served
        # The mesh's consumer still gets it; its pull, replayed by someone who saw it, gets nothing.
        seen: list[bytes] = []
        real_send_pull = bulk_client.BulkLinks.send_pull

        def watched(self, sock: socket.socket, pull: bytes) -> None:
            seen.append(bytes(pull))
            real_send_pull(self, sock, pull)

        monkeypatch.setattr(bulk_client.BulkLinks, "send_pull", watched)
        got, _ = get(consumer, "req-9/x", meta)
        assert bytes(got["blob"].numpy()) == bytes(marked(2 * MiB)["blob"].numpy())
        assert len(seen) == 1 and seen[0].startswith(bulk_wire.PULL), seen
        before = producer.health()["refused_peers"]
        assert refused(port, seen[0]) == b"", "a replayed pull was served"
        wait_for(lambda: producer.health()["refused_peers"] == before + 1, 5, "the replay's refusal")
    finally:
        producer.close()
        consumer.close()


def test_a_silent_connection_is_dropped(keys: MeshKeys, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that never sends its pull is closed after STRANGER_WAIT_S, and meanwhile holds
    up no one: the mesh's consumer gets its payload while it waits."""
    wait_s = 3.0
    monkeypatch.setattr(bulk_server, "STRANGER_WAIT_S", wait_s)
    producer, consumer = pair()
    try:
        _, _, meta = producer.put(*EDGE, "req-10/x", marked(2 * MiB))
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", producer._bulk.port), timeout=wait_s + 5) as silent:
            got, _ = get(consumer, "req-10/x", meta)
            assert bytes(got["blob"].numpy()) == bytes(marked(2 * MiB)["blob"].numpy())
            silent.setblocking(False)
            with pytest.raises(BlockingIOError):  # still open (nothing to read): it held up no one
                silent.recv(1)
            assert time.monotonic() - started < wait_s, "the get was not done before the silence ended"
            answer = until_closed(silent, wait_s + 5)
            waited = time.monotonic() - started
        assert answer == b"", "the bulk port wrote to a connection that never pulled"
        assert waited >= wait_s - 0.05, f"dropped after {waited:.2f} s, before STRANGER_WAIT_S ({wait_s} s)"
        wait_for(lambda: producer.health()["refused_peers"] == 1, 5, "the silent connection's refusal")
    finally:
        producer.close()
        consumer.close()


def test_a_poll_that_gave_up_is_resumed_with_its_own_session(keys: MeshKeys, tmp_path: Path) -> None:
    """vllm-omni's get() gives up after about a second and the next get waits on the same request:
    the transfer its late answer describes was sealed for that request's session, not a new one."""
    producer = Peer("ZmqConnector", {"host": "127.0.0.1"}, log=tmp_path / "producer.log", env=keys.to_env())
    consumer = create_connector("ZmqConnector", {"host": "127.0.0.1", "get_timeout_s": 10})
    try:
        meta = producer.put("late/x", payload="every_kind", **{"from": EDGE[0], "to": EDGE[1]})
        os.kill(producer.pid, signal.SIGSTOP)  # its answer comes after the poll gave up
        try:
            assert consumer.get(*EDGE, "late/x", meta) is None
        finally:
            os.kill(producer.pid, signal.SIGCONT)
        got, _ = get(consumer, "late/x", meta)
        assert_same(got, payload("every_kind"))
        assert consumer.health()["errors"] == 0
    finally:
        consumer.close()
        producer.close()


def test_a_consumer_that_stops_reading_holds_up_nobody_else(
    keys: MeshKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mesh member pulls a 64 MiB payload and never reads it: its chunks back up in its socket, and
    the producer's other consumers still get theirs (it holds a few sealing buffers, not all)."""
    # The stuck consumer is not dropped for a minute: a get that waited for its buffers would still be
    # waiting at its own 10 s deadline (with the default 10 s stall it could end at about 9.5 s).
    monkeypatch.setattr(bulk_server, "SEND_STALL_S", 60.0)
    producer, consumer = pair()
    ctx = zmq.Context()
    bulk = socket.socket()
    try:
        _, _, stuck_meta = producer.put(*EDGE, "stuck", marked(64 * MiB))
        session = seal.Session.fresh()
        side = ctx.socket(zmq.DEALER)
        side.linger = 0
        secure_client(side, keys)  # a mesh member
        side.connect(stuck_meta["endpoint"])
        side.send_multipart([b"GET", b"thinker->talker/stuck", stuck_meta["token"].encode(), session.offer()])
        assert side.poll(5000), "no answer to the GET"
        reply = side.recv_multipart()
        assert reply[0] == b"OK" and reply[2] == b"S", reply[:3]
        bulk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing: what it is sent backs up
        bulk.connect(("127.0.0.1", producer._bulk.port))
        bulk.sendall(bulk_wire.PULL + session.sid + session.proof())
        wait_for(lambda: producer.health()["bulk_transfers"] == 1, 5, "the stuck pull")
        time.sleep(0.5)  # its chunks fill the socket buffers
        expected = bytes(marked(16 * MiB)["blob"].numpy())
        for i in range(3):  # more sealed chunks than the producer has buffers
            _, _, meta = producer.put(*EDGE, f"other/{i}", marked(16 * MiB))
            started = time.monotonic()
            got, _ = get(consumer, f"other/{i}", meta)
            # 16 MiB sealed and opened in this process: 0.03-0.34 s on a quiet 2-core host, 0.04-0.73 s beside
            # two busy loops, 2.55 s once at load 6.5 (the bound was 4 s). Well short of the deadline still.
            assert time.monotonic() - started < 8, f"get {i} waited for the stuck consumer's buffers"
            assert bytes(got["blob"].numpy()) == expected
        side.close()
    finally:
        bulk.close()
        ctx.destroy(linger=0)
        producer.close()
        consumer.close()


def test_small_payloads_stay_in_the_curve_reply(keys: MeshKeys) -> None:
    producer, consumer = pair()
    try:
        _, _, meta = producer.put(*EDGE, "small", {"t": torch.arange(1000)})
        got, _ = get(consumer, "small", meta)
        assert torch.equal(got["t"], torch.arange(1000))
        assert producer.health()["bulk_transfers"] == 0  # it came in the CURVE reply
        _, _, meta = producer.put(*EDGE, "large", marked(MiB))
        get(consumer, "large", meta)
        assert producer.health()["bulk_transfers"] == 1
    finally:
        producer.close()
        consumer.close()


def test_encryption_must_be_a_known_algorithm() -> None:
    with pytest.raises(ValueError, match="encryption must be one of"):
        create_connector("ZmqConnector", {"encryption": "rot13"})
    with pytest.raises(ValueError, match="bulk_port"):
        create_connector("ZmqConnector", {"bulk_port": 70000})


def test_the_bulk_socket_binds_bulk_port(keys: MeshKeys) -> None:
    with socket.socket() as probe:  # a port free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    producer = create_connector("ZmqConnector", {"host": "127.0.0.1", "bulk_port": port})
    consumer = create_connector("ZmqConnector", {"host": "127.0.0.1"})
    try:
        _, _, meta = producer.put(*EDGE, "fixed", marked(MiB))
        assert producer._bulk.port == port
        got, _ = get(consumer, "fixed", meta)
        assert bytes(got["blob"].numpy()) == bytes(marked(MiB)["blob"].numpy())
    finally:
        producer.close()
        consumer.close()
