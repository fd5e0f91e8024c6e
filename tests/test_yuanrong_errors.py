"""openYuanrong's failures surface as the connectors' typed exceptions (omni_mesh/connectors/errors.py),
against real datasystem workers: a frame past the 4 GiB value limit is PayloadTooLarge naming edge, key
and size; a worker that went away is ConnectorUnavailable for put and get; a key not there is a poll's
None and, waited for, PayloadMissing. The session's shared worker serves the first tests (under their
own key prefix); the worker that goes away is this module's own.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from omni_mesh.connectors import (
    ConnectorUnavailable,
    PayloadMissing,
    PayloadTooLarge,
    create_connector,
)
from omni_mesh.local_services.datasystem_worker import running_worker

PREFIX = "errors"


@pytest.fixture(scope="module")
def worker(datasystem_worker):
    return datasystem_worker.get()


@pytest.fixture(scope="module")
def connector(worker):
    made = create_connector("YuanrongConnector", {**worker.config, "key_prefix": PREFIX})
    yield made
    made.close()


def test_a_frame_past_the_value_limit_is_payload_too_large_naming_edge_key_and_size(worker, connector):
    huge = torch.empty(1 << 32, dtype=torch.uint8)  # never written: planning a frame reads nothing
    with pytest.raises(PayloadTooLarge) as failed:  # no worker can ever hold it: no retry
        connector.put_or_raise("thinker", "talker", "huge/0", huge)
    message = str(failed.value)
    assert "thinker->talker" in message and "'huge/0'" in message
    size = int(message.split("the frame is ")[1].split(" bytes")[0])
    assert size > (1 << 32) and "4294967295-byte value limit" in message
    assert connector.health()["errors"] == 1 and connector.health()["put_failures"] == 1
    del huge


def test_a_key_not_there_is_none_to_a_poll_and_payload_missing_to_a_wait(connector):
    assert connector.get("a", "b", "never/0", None) is None
    started = time.monotonic()
    with pytest.raises(
        PayloadMissing, match=r"'never/0' on edge a->b: not there by the deadline on datasystem worker"
    ) as caught:
        connector.get_with_deadline("a", "b", "never/0", None, deadline=started + 0.3)
    assert caught.type is PayloadMissing and time.monotonic() - started < 3


def test_a_worker_that_went_away_is_connector_unavailable_for_put_and_get():
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(running_worker(shared_memory_mb=64))
        connector = create_connector("YuanrongConnector", {**worker.config, "req_timeout_ms": 1000})
        try:
            assert connector.put("a", "b", "held/0", torch.ones(16))[0]
            stack.close()  # the worker stops
            with pytest.raises(ConnectorUnavailable) as failed:
                connector.put_or_raise("a", "b", "after/0", torch.ones(16))
            assert "'after/0'" in str(failed.value) and f"worker {worker.host}:{worker.port}" in str(failed.value)
            with pytest.raises(ConnectorUnavailable, match=r"get a->b key 'held/0'.*RPC unavailable"):
                connector.get("a", "b", "held/0", None)
            assert connector.health()["status"] == "unhealthy"
        finally:
            connector.close()  # several seconds: the client gives up on the gone worker
