"""YuanrongConnector against a real openYuanrong datasystem worker.

The worker is the session's shared one (tests/support/shared_worker.py: `dscli start` through
omni_mesh/local_services/datasystem_worker.py, built-in metastore, free loopback ports, a temp dir). These tests
use the connector's default key prefix; the other modules sharing the worker use their own. Consumers
are real separate processes (tests/support/peer.py). Every datasystem key a test touches is checked to be
gone at the end.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest
import torch
from support.payloads import payload
from support.peer import Peer

from omni_mesh.connectors import (
    ConnectorConfigError,
    ConnectorError,
    ConnectorUnavailable,
    backends,
    create_connector,
)
from omni_mesh.connectors.yuanrong import YuanrongConnector, datasystem_key
from omni_mesh.ports import free_port

USED_KEYS: set[str] = set()  # every datasystem key these tests wrote


@pytest.fixture(scope="module")
def worker(datasystem_worker):
    return datasystem_worker.get()


@pytest.fixture(scope="module")
def producer(worker):
    connector = YuanrongConnector(worker.config)
    yield connector
    connector.close()


def used(*keys: str) -> list[str]:
    USED_KEYS.update(keys)
    return list(keys)


# --------------------------------------------------------------------------- tests


def test_every_payload_kind_reaches_a_consumer_process(worker, producer):
    peer = Peer("YuanrongConnector", worker.config, env=worker.env)
    try:
        ok, size, metadata = producer.put("thinker", "talker", "req-1/chunk-0", payload("every_kind"))
        assert ok and size > 4 << 20
        assert metadata == {
            "key": "omni;thinker-%3Etalker%2Freq-1%2Fchunk-0",
            "size": size,
            "worker": f"127.0.0.1:{worker.port}",
        }
        used(metadata["key"])
        reply = peer.get("req-1/chunk-0", metadata)
        assert reply["ok"], reply["error"]
        assert reply["size"] == size
        # The key is derived from the edge and put_key, so a consumer can also get without metadata.
        _, _, second = producer.put("thinker", "talker", "req-2/chunk-0", payload("every_kind"))
        used(second["key"])
        reply = peer.get("req-2/chunk-0", None)
        assert reply["ok"], reply["error"]
        health = peer.ask(op="health")["health"]
        assert health["status"] == "healthy" and health["gets"] == 2 and health["deleted"] == 2
    finally:
        peer.close()
    assert worker.exists([metadata["key"], second["key"]]) == [False, False]  # consumed keys are deleted


def test_get_past_its_deadline_names_key_and_worker(worker, producer):
    started = time.monotonic()
    with pytest.raises(ConnectorError) as caught:
        producer.get_with_deadline("thinker", "talker", "never-put/0", None, deadline=started + 0.5)
    assert time.monotonic() - started < 1.5
    message = str(caught.value)
    assert "'never-put/0'" in message and f"127.0.0.1:{worker.port}" in message and "thinker->talker" in message


def test_waiting_for_a_key_leaves_other_threads_running(producer):
    # The datasystem client holds the GIL while it blocks: get() must poll in short slices.
    gaps, stop = [], threading.Event()
    with pytest.raises(ConnectorError):  # the client's first call sets itself up (0.86 s seen once under load)
        producer.get_with_deadline("a", "b", "missing/0", None, deadline=time.monotonic() + 0.05)

    def spin() -> None:
        last = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            time.sleep(0.001)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        with pytest.raises(ConnectorError):
            producer.get_with_deadline("a", "b", "missing/0", None, deadline=time.monotonic() + 1.0)
    finally:
        stop.set()
        spinner.join()
    # A get holding the GIL for its whole wait would leave a gap of about 1 s; slices of 20 ms leave
    # none near that, even on a loaded machine (0.29 s seen there once).
    assert len(gaps) > 50 and max(gaps) < 0.5, max(gaps)


def test_an_unreachable_worker_is_reported_with_its_address():
    backends.load("yr.datasystem", "test")  # its one-time library load is not what is timed here

    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConnectorUnavailable, match=rf"datasystem worker at 127\.0\.0\.1:{port}.*dscli start"):
        create_connector("YuanrongConnector", {"port": port, "connect_timeout_ms": 1000})
    assert time.monotonic() - started < 3


def test_odd_and_long_keys_roundtrip(worker, producer):
    odd = ("stage one", "ställe#2", "req%1/a.b/ü")
    long_key = "r" * 300 + "/0"
    for from_stage, to_stage, key in (odd, ("a", "b", long_key)):
        _, _, metadata = producer.put(from_stage, to_stage, key, [key])
        used(metadata["key"])
        assert len(metadata["key"]) <= 255
        assert producer.get(from_stage, to_stage, key, metadata)[0] == [key]
    # Escaping is injective: keys that differ only in escaped characters stay apart.
    assert datasystem_key("omni", "a->b/x%2F") != datasystem_key("omni", "a->b/x/")


def test_unconsumed_payloads_expire_in_the_worker(worker):
    connector = YuanrongConnector({**worker.config, "ttl_s": 1})
    try:
        _, _, metadata = connector.put("a", "b", "ttl/0", torch.ones(1000))
        used(metadata["key"])
        assert worker.exists([metadata["key"]]) == [True]
        deadline = time.monotonic() + 10
        while worker.exists([metadata["key"]]) == [True] and time.monotonic() < deadline:
            time.sleep(0.25)
        assert worker.exists([metadata["key"]]) == [False]
    finally:
        connector.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"prot": 1}, "unknown config key 'prot'"),
        ({"port": 0}, "port must be the worker's port"),
        ({"write_mode": "FAST"}, "write_mode must be one of"),
        ({"key_prefix": "a/b"}, "key_prefix may hold"),
        ({"get_sub_timeout_ms": 0}, "get_sub_timeout_ms must be positive"),
    ],
)
def test_bad_config_is_named_before_any_worker_is_contacted(config, message):
    # A listener standing in for the worker: the config error must come before any connection to it.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with pytest.raises(ConnectorConfigError, match=message):
            create_connector("YuanrongConnector", {"host": "127.0.0.1", "port": port, **config})
        assert select.select([listener], [], [], 0.2)[0] == [], "the connector contacted the worker first"


def test_no_keys_left_in_the_worker(worker):
    assert USED_KEYS
    assert not any(worker.exists(sorted(USED_KEYS)))
