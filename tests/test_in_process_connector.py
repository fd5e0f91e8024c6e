"""InProcessConnector beyond the contract suite (which runs it too): namespaces and the memory limit."""

from __future__ import annotations

import os

import pytest
import torch

from omni_mesh.connectors import ConnectorConfigError, ConnectorFull, create_connector


def make(namespace: str, **extra: object):
    return create_connector("InProcessConnector", {"namespace": f"{namespace}-{os.getpid()}", **extra})


def test_connectors_of_one_namespace_share_payloads_and_other_namespaces_see_none() -> None:
    producer, consumer, stranger = make("shared"), make("shared"), make("other")
    try:
        ok, size, metadata = producer.put("a", "b", "r1/0", {"t": torch.arange(4)})
        assert ok and size > 0
        assert stranger.get("a", "b", "r1/0", metadata) is None
        data, got = consumer.get("a", "b", "r1/0", metadata)
        assert got == size and torch.equal(data["t"], torch.arange(4))
    finally:
        for connector in (producer, consumer, stranger):
            connector.close()


def test_a_put_past_the_memory_limit_fails_naming_it_until_a_get_makes_room() -> None:
    producer, consumer = make("small", memory_limit=64 * 1024), make("small", memory_limit=64 * 1024)
    try:
        assert producer.put("a", "b", "big/0", b"x" * 40_000)[0]
        with pytest.raises(ConnectorFull) as failed:  # the front door: 503
            producer.put_or_raise("a", "b", "big/1", b"y" * 40_000)
        assert "is full" in str(failed.value) and "memory_limit" in str(failed.value) and "big/1" in str(failed.value)
        assert producer.put("a", "b", "big/2", b"z" * 40_000) == (False, 0, None)
        assert consumer.get("a", "b", "big/0") is not None
        assert producer.put("a", "b", "big/1", b"y" * 40_000)[0]
        assert producer.health()["held"] == 1 and producer.health()["put_failures"] == 2
    finally:
        producer.close()
        consumer.close()


def test_closing_a_producer_drops_what_it_held() -> None:
    producer, consumer = make("closing"), make("closing")
    try:
        assert producer.put("a", "b", "k/0", b"payload")[0]
        producer.close()
        assert consumer.get("a", "b", "k/0") is None
    finally:
        consumer.close()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"namespace": ""}, "namespace"),
        ({"memory_limit": 0}, "memory_limit"),
        ({"nmespace": "x"}, "nmespace"),
    ],
)
def test_a_bad_config_is_named(extra: dict, named: str) -> None:
    with pytest.raises(ConnectorConfigError, match=named):
        create_connector("InProcessConnector", extra)
