"""The bulk stream's time bounds, with real sockets: a peer dripping its pull a byte at a time is
dropped after STRANGER_WAIT_S (for the whole pull, not per byte), and a consumer whose stream trickles
in far too slowly gives up at its deadline, not when the last byte comes.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from support.bulk_proxy import BulkProxy
from support.meshkit import wait_for

from omni_mesh.connectors import PayloadMissing, create_connector
from omni_mesh.connectors.served import bulk_server, bulk_wire, seal
from omni_mesh.security import MeshKeys

EDGE = ("thinker", "talker")
MiB = 1 << 20


def test_a_pull_dripped_a_byte_at_a_time_is_dropped_after_stranger_wait_s(
    keys: MeshKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STRANGER_WAIT_S bounds the whole pull, not each wait for more of it: a peer sending one byte
    now and then cannot hold a connection (one of the few served at once) for long."""
    wait_s = 1.0
    monkeypatch.setattr(bulk_server, "STRANGER_WAIT_S", wait_s)
    producer = create_connector("ZmqConnector", {"host": "127.0.0.1"})
    try:
        producer.put(*EDGE, "req-11/x", {"blob": torch.ones(2 * MiB, dtype=torch.uint8)})
        session = seal.Session.fresh()
        pull = bulk_wire.PULL + session.sid + session.proof()
        started, answer, closed = time.monotonic(), b"", False
        with socket.create_connection(("127.0.0.1", producer._bulk.port), timeout=5) as drip:
            drip.settimeout(wait_s / 4)
            for byte in pull[:-1]:  # never the whole pull
                try:
                    drip.sendall(bytes([byte]))
                    answer = drip.recv(1 << 16)
                    closed = True  # b"": the close; bytes: an answer (the assertion below)
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                if closed:
                    break
        waited = time.monotonic() - started
        assert closed and answer == b"", (
            f"a dripped pull was kept (or answered) after {waited:.1f} s ({answer!r})"
        )
        assert waited < wait_s + 2, (
            f"a dripped pull held its connection {waited:.1f} s (STRANGER_WAIT_S {wait_s})"
        )
        wait_for(lambda: producer.health()["refused_peers"] == 1, 5, "the dripped pull's refusal")
        assert producer.health()["held"] == 1
    finally:
        producer.close()


def test_a_stream_that_trickles_ends_the_get_at_its_deadline(keys: MeshKeys) -> None:
    """Each wait for more bytes is bounded by what is left of the pull's deadline: a producer whose
    bytes come at 10 KB/s (8 MiB: about 14 minutes) does not hold its consumer past it."""
    producer = create_connector("ZmqConnector", {"host": "127.0.0.1"})
    consumer = create_connector("ZmqConnector", {"host": "127.0.0.1", "get_timeout_s": 2})
    proxy = None
    try:
        _, _, meta = producer.put(*EDGE, "req-12/slow", {"blob": torch.ones(8 * MiB, dtype=torch.uint8)})
        proxy = BulkProxy(producer._bulk.port, "trickle", after=1)
        producer._bulk.port = proxy.port  # the description sends the consumer through the proxy
        caught: list[BaseException] = []

        def slow_get() -> None:
            try:
                consumer.get_with_deadline(*EDGE, "req-12/slow", meta, deadline=time.monotonic() + 2)
            except BaseException as exc:  # noqa: BLE001 - what the get ended with, checked below
                caught.append(exc)

        started = time.monotonic()
        getter = threading.Thread(target=slow_get, daemon=True)
        getter.start()
        getter.join(2 + 5)
        waited = time.monotonic() - started
        assert not getter.is_alive(), (
            f"a get with a 2 s deadline still waits for a trickle after {waited:.1f} s"
        )
        assert proxy.altered.is_set()
        assert caught and isinstance(caught[0], PayloadMissing), caught
        message = str(caught[0])
        assert "stopped coming" in message and "thinker->talker" in message and "req-12/slow" in message, (
            message
        )
    finally:
        if proxy is not None:
            proxy.close()
        consumer.close()  # wakes a get still blocked on the trickle (the assertion above said so)
        producer.close()
