"""ZmqConnector: put/get across processes and across two network namespaces, a producer that dies,
expiry of unconsumed payloads, cleanup by request, and the pool's fallback for oversized payloads.

Peers are real separate processes (tests/support/peer.py) that build a connector and answer put/get
commands; the payload and the check on what arrives are tests/support/payloads.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from support.meshkit import wait_until
from support.payloads import assert_same, payload
from support.peer import Peer

from omni_mesh.connectors import ConnectorConfigError, ConnectorError, create_connector
from omni_mesh.connectors.zmq import ZmqConnector

LOCAL = {"host": "127.0.0.1"}


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def producer():
    connector = ZmqConnector(LOCAL)
    yield connector
    connector.close()


@pytest.fixture
def consumer():
    connector = ZmqConnector(LOCAL)
    yield connector
    connector.close()


# --------------------------------------------------------------------------- tests




def test_vllm_omni_payload_types_reach_a_consumer_process(producer, consumer):
    """set, frozenset, slice, dataclass (as a dict) and PIL images, both ways across processes."""
    peer = Peer("ZmqConnector", LOCAL)
    try:
        ok, size, metadata = producer.put("thinker", "talker", "omni/0", payload("vllm_omni_types"))
        assert ok
        reply = peer.get("omni/0", metadata, expect="vllm_omni_types_received")
        assert reply["ok"], reply["error"]
        assert reply["size"] == size
        metadata = peer.put("omni/1", payload="vllm_omni_types")
        data, _ = consumer.get("thinker", "talker", "omni/1", metadata)
        assert_same(data, payload("vllm_omni_types_received"))
        assert type(data["set"]) is set and type(data["frozenset"]) is frozenset and type(data["chunk"]) is dict
    finally:
        peer.close()


def test_across_two_network_namespaces():
    from support.netns import TwoHosts

    with TwoHosts() as hosts:
        producer = Peer("ZmqConnector", {"host": "auto"}, wrap=hosts.a.command([]))
        consumer = Peer("ZmqConnector", {"host": "auto"}, wrap=hosts.b.command([]))
        try:
            metadata = producer.put("req-7/0")
            assert metadata["endpoint"].startswith(f"tcp://{hosts.a.ip}:")  # `auto` found the veth address
            reply = consumer.get("req-7/0", metadata)
            assert reply["ok"], reply["error"]
            # With the link cut the consumer fails at its deadline, naming the producer's endpoint.
            metadata = producer.put("req-8/0")
            hosts.cut()
            reply = consumer.get("req-8/0", metadata, timeout_s=1.5)
            assert (
                not reply["ok"] and metadata["endpoint"] in reply["error"] and "'req-8/0'" in reply["error"]
            )
            assert reply["elapsed"] < 3
            hosts.restore()
        finally:
            producer.close()
            consumer.close()


def test_killed_producer_fails_the_get_before_its_deadline(consumer, producer):
    peer = Peer("ZmqConnector", LOCAL)
    try:
        metadata = peer.put("req-9/0", nbytes=32 << 20)
    finally:
        peer.kill()
    started = time.monotonic()
    with pytest.raises(ConnectorError) as caught:
        consumer.get_with_deadline("thinker", "talker", "req-9/0", metadata, deadline=time.monotonic() + 2.0)
    assert time.monotonic() - started < 3.0
    message = str(caught.value)
    assert metadata["endpoint"] in message and "'req-9/0'" in message and "thinker->talker" in message
    # The timed-out socket was discarded; the same consumer still works with a live producer.
    _, _, live = producer.put("thinker", "talker", "req-10/0", {"x": torch.arange(4)})
    obj, _ = consumer.get("thinker", "talker", "req-10/0", live)
    assert torch.equal(obj["x"], torch.arange(4))
    assert consumer.health()["errors"] == 1


def test_get_from_an_address_nobody_serves_times_out_clearly(consumer):
    metadata = {"endpoint": "tcp://127.0.0.1:9", "key": "a->b/r/0", "token": "00", "size": 10}
    started = time.monotonic()
    with pytest.raises(ConnectorError, match=r"tcp://127\.0\.0\.1:9.*no answer within 0\.\d+s"):
        consumer.get_with_deadline("a", "b", "r/0", metadata, deadline=started + 0.5)
    assert time.monotonic() - started < 1.5
    assert consumer.get("a", "b", "r/0", metadata) is None  # the poll: nobody answered within a second


def test_unconsumed_payloads_are_freed_after_ttl(consumer):
    producer = ZmqConnector({**LOCAL, "ttl_s": 0.3})
    try:
        _, _, metadata = producer.put("a", "b", "r1/0", torch.ones(1 << 20))
        producer.put("a", "b", "r2/0", b"x" * 5000)
        assert producer.health()["held"] == 2 and producer.health()["pool_used_bytes"] > 0
        assert wait_until(lambda: producer.health()["held"] == 0, timeout_s=3)
        health = producer.health()
        assert health["pool_used_bytes"] == 0 and health["expired"] == 2
        assert consumer.get("a", "b", "r1/0", metadata) is None
    finally:
        producer.close()




def test_a_payload_larger_than_the_pool_uses_a_one_off_buffer(consumer):
    producer = ZmqConnector({**LOCAL, "memory_pool_size": "1MiB", "max_pool_size": "1MiB"})  # no growth
    try:
        data = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB
        _, size, metadata = producer.put("a", "b", "big/0", data)
        assert producer.health()["oneoff"] == 1 and producer.health()["pool_used_bytes"] == 0
        obj, got = consumer.get("a", "b", "big/0", metadata)
        assert got == size and torch.equal(obj, data)
    finally:
        producer.close()




def test_a_second_put_of_a_key_replaces_the_first(producer, consumer):
    _, _, first = producer.put("a", "b", "r/0", "first")
    _, _, second = producer.put("a", "b", "r/0", "second")
    assert consumer.get("a", "b", "r/0", first) is None  # another put's token: not this payload
    assert consumer.get("a", "b", "r/0", second)[0] == "second"


def test_a_wait_for_a_payload_another_consumer_took_fails_at_once(producer, consumer):
    """A replica that took a payload (and confirmed it) and died leaves its retry asking for it again: with the put's
    own metadata, the producer's "not there any more" ends the wait at once, saying why, instead of
    asking again until the deadline (a 504 in the mesh). By key alone it may still come: it waits."""
    _, _, metadata = producer.put("a", "b", "r/0", torch.ones(4))
    assert torch.equal(consumer.get("a", "b", "r/0", metadata)[0], torch.ones(4))
    assert wait_until(lambda: producer.health()["held"] == 0, timeout_s=5), "the get was never confirmed"
    other = ZmqConnector(LOCAL)
    try:
        started = time.monotonic()
        with pytest.raises(ConnectorError, match="already consumed"):
            other.get_with_deadline("a", "b", "r/0", metadata, deadline=time.monotonic() + 10)
        assert time.monotonic() - started < 2, "it waited for a payload that will not come back"
        by_key = {"endpoint": metadata["endpoint"]}
        started = time.monotonic()
        # At the deadline: the wait's own error, or, when its last ask got no answer in the moment left, that.
        with pytest.raises(ConnectorError, match="by the deadline|no answer within"):
            other.get_with_deadline("a", "b", "r/0", by_key, deadline=time.monotonic() + 0.5)
        assert time.monotonic() - started >= 0.5
    finally:
        other.close()


#: A consumer that takes a payload and dies before it confirms it arrived (as a replica SIGKILLed
#: right after its transfer): the process ends at once where the get would say so to the producer.
TAKES_AND_DIES = r"""
import json, os, sys, time
from omni_mesh.connectors.zmq import ZmqConnector
metadata = json.loads(sys.argv[1])
consumer = ZmqConnector({"host": "127.0.0.1"})
if hasattr(consumer, "_confirms"):  # the fault: killed between the transfer and its confirmation
    consumer._confirms.add = lambda *args: os._exit(0)
consumer.get_with_deadline("a", "b", "r/0", metadata, deadline=time.monotonic() + 10)
os._exit(0)
"""


def _taken_by_a_consumer_that_died(metadata: dict) -> None:
    args = [sys.executable, "-c", TAKES_AND_DIES, json.dumps(metadata)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_payload_whose_consumer_died_before_confirming_is_served_to_its_retry(producer, consumer):
    """The producer keeps a payload it served until its consumer confirms it arrived: the retry of a
    replica that died after its get finds it; confirmed by that get, it is gone."""
    _, _, metadata = producer.put("a", "b", "r/0", torch.ones(4))
    _taken_by_a_consumer_that_died(metadata)
    obj, _ = consumer.get_with_deadline("a", "b", "r/0", metadata, deadline=time.monotonic() + 10)
    assert torch.equal(obj, torch.ones(4))
    assert wait_until(lambda: producer.health()["held"] == 0, timeout_s=3)
    assert consumer.get("a", "b", "r/0", metadata) is None


def test_cleanup_frees_a_payload_served_but_never_confirmed(producer):
    _, _, metadata = producer.put("a", "b", "r/0", torch.ones(4))
    _taken_by_a_consumer_that_died(metadata)
    assert producer.health()["held"] == 1, "kept: its consumer never said it arrived"
    producer.cleanup("r")
    health = producer.health()
    assert health["held"] == 0 and health["pool_used_bytes"] == 0, health


def test_get_checks_its_metadata(consumer):
    assert consumer.get("a", "b", "r/0", None) is None  # no producer named anywhere: not there
    metadata = {"endpoint": "tcp://127.0.0.1:9", "key": "x->y/r/0", "token": "00", "size": 1}
    with pytest.raises(ConnectorError, match="metadata is for 'x->y/r/0'"):
        consumer.get("a", "b", "r/0", metadata)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hots": "x"}, "unknown config key 'hots'"),
        ({"port": 70000}, "port must be 0"),
        ({"ttl_s": -1}, "ttl_s must not be negative"),
        ({"get_timeout_s": 0}, "get_timeout_s must be positive"),
        ({"memory_pool_size": "lots"}, "memory_pool_size"),
    ],
)
def test_bad_config_is_named(config, message):
    with pytest.raises(ConnectorConfigError, match=message):
        create_connector("ZmqConnector", config)
    with pytest.raises(ConnectorConfigError, match=message):
        ZmqConnector.validate_config(config)


def test_a_port_in_use_is_reported_with_the_address(producer):
    producer.put("a", "b", "r/0", 1)
    port = int(producer.endpoint.rsplit(":", 1)[1])
    other = ZmqConnector({**LOCAL, "port": port, "memory_pool_size": "256MiB"})
    try:
        with pytest.raises(ConnectorError, match=rf"cannot serve on tcp://127\.0\.0\.1:{port}"):
            other.put_or_raise("a", "b", "r/0", 1)
    finally:
        other.close()

