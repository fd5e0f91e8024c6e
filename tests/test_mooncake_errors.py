"""Mooncake's failures surface as the connectors' typed exceptions (omni_mesh/connectors/errors.py),
against a real `mooncake_master` and real transfer engines over TCP: a store with no room is
ConnectorFull, a master that went away ConnectorUnavailable, a frame past a pool's ceiling
PayloadTooLarge, a pool with no room in time ConnectorFull. A failed put still answers vllm-omni's
(False, 0, None); `put_or_raise`, what the stage runtime calls, raises the typed error.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.payloads import MiB

from omni_mesh.connectors import (
    ConnectorFull,
    ConnectorUnavailable,
    PayloadMissing,
    PayloadTooLarge,
    create_connector,
)
from omni_mesh.connectors.mooncake import errors
from omni_mesh.connectors.mooncake.probes import MasterWatch
from omni_mesh.local_services.mooncake_master import MooncakeMaster
from omni_mesh.ports import free_port

TE = "MooncakeTransferEngineConnector"
STORE = "MooncakeStoreConnector"


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test's own: these tests fill it, or stop it."""
    with MooncakeMaster(log_path=str(tmp_path / "master.log")) as running:
        yield running


def store(master: MooncakeMaster, **extra) -> object:
    config = {"host": "127.0.0.1", "master": master.address, "segment": "16MiB", "localbuf": "64MiB"}
    return create_connector(STORE, {**config, "prefault": False, **extra})


def test_a_store_with_no_room_is_connector_full_and_a_smaller_put_still_works(master) -> None:
    connector = store(master)  # the only segment in this master: 16 MiB
    try:
        with pytest.raises(ConnectorFull) as failed:  # room may come: the front door's 503
            connector.put_or_raise("thinker", "talker", "big/0", torch.ones(32 * MiB, dtype=torch.uint8))
        message = str(failed.value)
        assert "'big/0'" in message and "thinker->talker" in message and "NO_AVAILABLE_HANDLE" in message
        assert "raise `segment`" in message
        assert connector.put("thinker", "talker", "small/0", torch.ones(MiB, dtype=torch.uint8))[0]
        assert connector.health()["errors"] == 1 and connector.health()["put_failures"] == 1
    finally:
        connector.close()


def test_a_master_that_went_away_is_connector_unavailable_for_put_and_get(master) -> None:
    connector = store(master)
    try:
        _, _, metadata = connector.put("a", "b", "held/0", torch.ones(1024))
        master.stop()
        with pytest.raises(ConnectorUnavailable, match=r"'after/0'.*RPC_FAIL|RPC_FAIL.*'after/0'"):
            connector.put_or_raise("a", "b", "after/0", torch.ones(1024))  # the client's own retries: 0-4.5 s
        started = time.monotonic()
        for _ in range(3):  # each would spend about 4.4 s in the client's retries; a refused knock is quick
            with pytest.raises(ConnectorUnavailable, match=r"'held/0' on edge a->b.*cannot reach.*RPC_FAIL"):
                connector.get("a", "b", "held/0", None)
        assert time.monotonic() - started < 2
    finally:
        connector.close()  # 10-20 s: the client tries to unmount its segment from the gone master


def test_the_master_watch_knocks_only_after_a_failure_and_lets_calls_through_once_the_port_answers() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    watch = MasterWatch(address, STORE, timeout_s=0.5)
    watch.check("get of key 'k/0' on edge a->b")  # no failure seen: no knock
    watch.failed(errors.OBJECT_NOT_FOUND)  # not the master's absence
    listener.close()
    watch.check("get of key 'k/0' on edge a->b")
    watch.failed(errors.RPC_FAIL)
    with pytest.raises(ConnectorUnavailable, match=rf"'k/0' on edge a->b.*{address}.*RPC_FAIL"):
        watch.check("get of key 'k/0' on edge a->b")
    with socket.create_server(("127.0.0.1", int(address.rsplit(":", 1)[1]))):  # the master is back
        watch.check("get of key 'k/0' on edge a->b")
    watch.check("get of key 'k/0' on edge a->b")  # cleared: no knock on the closed port
    watch.failed(errors.RPC_TIMEOUT)
    with pytest.raises(ConnectorUnavailable, match=r"'k/0' on edge a->b.*RPC_TIMEOUT"):
        watch.check("get of key 'k/0' on edge a->b")


def test_a_store_put_past_localbuf_is_payload_too_large(master) -> None:
    connector = store(master, localbuf="16MiB")
    try:
        with pytest.raises(PayloadTooLarge, match="'huge/0' on edge a->b"):
            connector.put_or_raise("a", "b", "huge/0", torch.ones(16 * MiB + 1, dtype=torch.uint8))
    finally:
        connector.close()


def test_a_store_get_of_nothing_is_none_and_by_its_deadline_payload_missing(master) -> None:
    connector = store(master)
    try:
        assert connector.get("a", "b", "never/0", None) is None  # OBJECT_NOT_FOUND: a poll's None
        with pytest.raises(PayloadMissing, match="'never/0' on edge a->b"):
            connector.get_with_deadline("a", "b", "never/0", None, deadline=time.monotonic() + 0.3)
    finally:
        connector.close()


TE_CONFIG = {"host": "127.0.0.1", "memory_pool_size": "16MiB", "max_pool_size": "16MiB", "prefault": False}


def test_te_frames_past_the_pool_are_too_large_and_a_pool_with_no_room_in_time_is_full() -> None:
    connector = create_connector(TE, {**TE_CONFIG, "pool_wait_s": 0.2, "zero_copy_min_bytes": 0})
    try:
        assert connector.put("a", "b", "huge/0", torch.ones(17 * MiB, dtype=torch.uint8)) == (False, 0, None)
        with pytest.raises(PayloadTooLarge):
            connector.put_or_raise("a", "b", "huge/1", torch.ones(17 * MiB, dtype=torch.uint8))
        # Held until consumed: the first 10 MiB leave no room for a second within pool_wait_s.
        assert connector.put("a", "b", "held/0", torch.ones(10 * MiB, dtype=torch.uint8))[0]
        with pytest.raises(ConnectorFull) as failed:
            connector.put_or_raise("a", "b", "held/1", torch.ones(10 * MiB, dtype=torch.uint8))
        assert "waited 0.2s" in str(failed.value) and "'held/1' on edge a->b" in str(failed.value)
        connector.cleanup("held")  # room again: the same put now works
        assert connector.put("a", "b", "held/1", torch.ones(10 * MiB, dtype=torch.uint8))[0]
    finally:
        connector.close()


def test_te_without_a_reachable_metadata_server_is_connector_unavailable() -> None:
    with pytest.raises(ConnectorUnavailable, match="cannot reach the metadata server"):
        create_connector(TE, {**TE_CONFIG, "metadata_server": f"http://127.0.0.1:{free_port()}/metadata"})


def test_an_engine_that_refuses_the_pool_is_a_connector_error_saying_what_to_change() -> None:
    """A pool the engine will not register (the memory-lock limit under RDMA, say) is a ConnectorError
    naming the connector, the pool's size and what to change, with the engine's return code."""
    from omni_mesh.connectors import ConnectorError
    from omni_mesh.connectors.config import MooncakeTransferEngineConfig
    from omni_mesh.connectors.mooncake.te_engine import registered_pool
    from omni_mesh.connectors.pools.registered import PoolErrors

    class RefusingEngine:
        def register_memory(self, address: int, size: int) -> int:
            return -1

    cfg = MooncakeTransferEngineConfig(memory_pool_size=MiB, prefault=False)
    pool_errors = PoolErrors(TE, "max_pool_size", "payloads", "advice", lambda: None)
    with pytest.raises(ConnectorError) as raised:
        registered_pool(RefusingEngine, TE, cfg, pool_errors)
    said = str(raised.value)
    assert said.startswith(f"{TE}: registering the {MiB}-byte pool with the engine failed")
    assert "memory_pool_size" in said and "(rc=-1)" in said
