"""The connector contract, for every connector that runs here (tests/contract_backends.py).

Written from vllm-omni's documented contract (its OmniConnectorBase and connectors) and DESIGN.md:
`put` -> (True, size, small msgpack-able metadata) or (False, 0, None); `get` is a poll -> (object,
size) or None when the payload is not there (yet, or any more), within about a second, also without
metadata or with partial metadata; `get_with_deadline` blocks until its monotonic deadline, then
raises naming connector, edge and key; `serialize_obj`/`deserialize_obj`, `abandon_get`,
`reap_consumed`, `stage_id`, `cleanup`, idempotent `close`. Every backend is real (a mooncake_master,
a datasystem worker); consumers in another process are real processes (tests/mooncake_fixtures.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from support.contract_backends import BACKENDS, ONE_PROCESS, Backend, running
from support.payloads import SENT, mismatch, payload, received
from support.peer import Peer

from omni_mesh import codec
from omni_mesh.connectors import ConnectorClosed, ConnectorError, GetAbandoned, PayloadMissing

POLL_LIMIT_S = 1.5  # "within about a second": the poll's own limit plus scheduling slack on a loaded host
IN_PROCESS = [name for name in SENT if name not in ("8mib", "16mib")]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tmp_path_factory, datasystem_worker) -> Iterator[Backend]:
    with running(request.param, tmp_path_factory.mktemp("contract"), datasystem_worker) as started:
        yield started


@pytest.fixture(scope="module")
def pair(backend: Backend) -> tuple[Any, Any]:
    """A producer and a consumer of one backend in this process (two instances, as two stages have)."""
    return backend.make(), backend.make()


@pytest.fixture(scope="module")
def peer(backend: Backend, tmp_path_factory) -> Iterator[Peer]:
    if backend.name in ONE_PROCESS:
        pytest.skip(f"{backend.name} carries payloads inside one process: there is no consumer in another")
    log = tmp_path_factory.mktemp("contract-peer") / f"{backend.name}.log"
    started = Peer(backend.name, backend.config, log=log, env=backend.env)
    yield started
    started.close()


def timed(call, *args) -> tuple[Any, float]:
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


def wire(metadata: dict) -> dict:
    """Metadata as the consumer receives it over the control plane."""
    return msgpack.unpackb(msgpack.packb(metadata, use_bin_type=True), raw=False)


# --------------------------------------------------------------------------- put and get


@pytest.mark.parametrize("kind", IN_PROCESS)
def test_every_payload_kind_round_trips_and_sizes_agree(pair, kind: str) -> None:
    producer, consumer = pair
    value = payload(kind)
    result = producer.put("s0", "s1", f"kind-{kind}/0", value)
    assert type(result) is tuple and len(result) == 3
    ok, size, metadata = result
    assert ok is True and type(size) is int and size > 0 and isinstance(metadata, dict)
    got = consumer.get("s0", "s1", f"kind-{kind}/0", wire(metadata))
    assert type(got) is tuple and len(got) == 2
    data, got_size = got
    assert got_size == size
    expected = payload(received(kind))
    assert mismatch(expected, data) is None, mismatch(expected, data)


def test_vllm_omni_payload_types(pair) -> None:
    """set/frozenset/slice come back as themselves, a dataclass instance as a dict of its fields."""

    @dataclasses.dataclass
    class Chunk:
        ids: list
        done: bool

    value = {"s": {1, 2}, "f": frozenset({"a"}), "sl": slice(1, 9, 2), "dc": Chunk([1, 2], True)}
    producer, consumer = pair
    ok, _, metadata = producer.put("s0", "s1", "types/0", value)
    assert ok
    data, _ = consumer.get("s0", "s1", "types/0", wire(metadata))
    assert data == {"s": {1, 2}, "f": frozenset({"a"}), "sl": slice(1, 9, 2), "dc": {"ids": [1, 2], "done": True}}


def test_get_returns_none_quickly_when_never_put(pair, backend: Backend) -> None:
    _, consumer = pair
    producer = pair[0]
    ok, _, metadata = producer.put("s0", "s1", "known/0", b"x" * 100)
    assert ok
    for partial in (None, {}, "not a dict", backend.partial(metadata)):
        got, took = timed(consumer.get, "s0", "s1", "never-put/0", partial)
        assert got is None, partial
        assert took < POLL_LIMIT_S, (partial, took)
    producer.cleanup("known")


def test_get_returns_none_once_consumed(pair) -> None:
    producer, consumer = pair
    ok, _, metadata = producer.put("s0", "s1", "once/0", torch.arange(5000))
    assert ok and consumer.get("s0", "s1", "once/0", wire(metadata)) is not None
    got, took = timed(consumer.get, "s0", "s1", "once/0", wire(metadata))
    assert got is None and took < POLL_LIMIT_S
    assert consumer.get("s0", "s1", "once/0") is None


def test_get_returns_none_after_cleanup_and_cleanup_frees_only_that_request(pair, backend: Backend) -> None:
    producer, consumer = pair
    backend.settle(consumer)  # the module's earlier gets no longer held
    before = backend.held(producer)
    # 20 KB: over SharedMemoryConnector's inline limit (an inline payload rides whole in its metadata,
    # which a get with that metadata always reads, as vllm-omni's does).
    metas = {key: producer.put("s0", "s1", key, torch.ones(5000))[2] for key in ("req-a/0", "req-a/1", "req-ab/0")}
    assert backend.held(producer) == before + 3
    producer.cleanup("req-a")
    assert backend.held(producer) == before + 1
    for key in ("req-a/0", "req-a/1"):
        got, took = timed(consumer.get, "s0", "s1", key, wire(metas[key]))
        assert got is None and took < POLL_LIMIT_S
    data, _ = consumer.get("s0", "s1", "req-ab/0", wire(metas["req-ab/0"]))
    assert torch.equal(data, torch.ones(5000))


def test_get_without_or_with_partial_metadata_finds_the_payload_by_key(pair, backend: Backend) -> None:
    producer, consumer = pair
    for i, value in enumerate([{"t": torch.arange(10)}, torch.zeros(100_000), b"tiny"]):
        ok, size, metadata = producer.put("s0", "s1", f"keyless/{i}", value)
        assert ok
        partial = backend.partial(metadata)
        data, got_size = consumer.get("s0", "s1", f"keyless/{i}", partial)
        assert got_size == size and mismatch(value, data) is None
        assert consumer.get("s0", "s1", f"keyless/{i}", partial) is None  # consumed: not twice


def test_get_of_another_edge_never_hands_out_the_payload(pair, backend: Backend) -> None:
    producer, consumer = pair
    ok, _, metadata = producer.put("s0", "s1", "edge/0", b"for s1")
    assert ok
    assert consumer.get("s0", "s2", "edge/0", backend.partial(metadata)) is None
    data, _ = consumer.get("s0", "s1", "edge/0", wire(metadata))
    assert data == b"for s1"


def test_get_with_deadline_waits_for_a_later_put(pair, backend: Backend) -> None:
    producer, consumer = pair
    warm = producer.put("s0", "s1", "warm/0", b"w")[2]  # the producer's side channel is up: partial works
    consumer.get("s0", "s1", "warm/0", wire(warm))
    timer = threading.Timer(0.3, producer.put, args=("s0", "s1", "later/0", {"late": torch.ones(4)}))
    timer.start()
    try:
        data, _ = consumer.get_with_deadline(
            "s0", "s1", "later/0", backend.partial(warm), deadline=time.monotonic() + 10
        )
    finally:
        timer.join()
    assert torch.equal(data["late"], torch.ones(4))


def test_get_with_deadline_raises_past_it_naming_connector_edge_and_key(pair, backend: Backend) -> None:
    producer, consumer = pair
    warm = producer.put("s0", "s1", "warm2/0", b"w")[2]
    consumer.get("s0", "s1", "warm2/0", wire(warm))
    started = time.monotonic()
    with pytest.raises(PayloadMissing) as info:  # the family's kind for "not there by the deadline"
        consumer.get_with_deadline("s0", "s1", "missing/0", backend.partial(warm), deadline=started + 0.5)
    took = time.monotonic() - started
    assert 0.45 <= took < 0.5 + POLL_LIMIT_S, took
    message = str(info.value)
    assert backend.name in message and "missing/0" in message and "s0" in message and "s1" in message


def test_abandon_get_stops_a_waiting_get(pair) -> None:
    _, consumer = pair
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            consumer.get_with_deadline("s0", "s1", "abandoned/0", None, deadline=time.monotonic() + 30)
        except GetAbandoned as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    consumer.abandon_get("abandoned/0")
    waiter.join(POLL_LIMIT_S + 1)
    assert not waiter.is_alive()
    assert errors and "abandon" in str(errors[0])


# --------------------------------------------------------------------------- put failures and the rest of the API


def test_a_failed_put_answers_false_zero_none_with_the_reason(pair, backend: Backend, caplog) -> None:
    producer, _ = pair
    failures = producer.health()["put_failures"]
    with caplog.at_level("WARNING", logger="omni_mesh.connectors"):
        assert producer.put("s0", "s1", "bad/0", object()) == (False, 0, None)
    assert producer.health()["put_failures"] == failures + 1
    assert any("bad/0" in record.getMessage() for record in caplog.records)
    with pytest.raises(ConnectorError) as failed:  # what our own callers use: the error itself
        producer.put_or_raise("s0", "s1", "bad/1", object())
    reason = str(failed.value)
    assert "bad/1" in reason and "s0->s1" in reason and backend.name in reason and "object" in reason
    assert producer.health()["put_failures"] == failures + 2


def test_serialize_obj_and_deserialize_obj_round_trip_without_pickle(pair) -> None:
    producer, consumer = pair
    value = payload("mixed")
    frame = producer.serialize_obj(value)
    assert type(frame) is bytes and b"pickle" not in frame
    assert mismatch(value, consumer.deserialize_obj(frame)) is None
    assert mismatch(value, type(consumer).deserialize_obj(bytearray(frame))) is None  # vllm-omni: static
    with pytest.raises(codec.FrameError):
        consumer.deserialize_obj(b"\x80\x04 not a frame")


def test_reap_consumed_releases_what_consumers_took(pair, backend: Backend) -> None:
    producer, consumer = pair
    producer.reap_consumed()
    before = backend.held(producer)
    metas = [producer.put("s0", "s1", f"reap/{i}", torch.ones(2000))[2] for i in range(3)]
    for i, metadata in enumerate(metas):
        got = consumer.get("s0", "s1", f"reap/{i}", wire(metadata))
        del got  # views over the producer's memory die here: their slots go back
    deadline = time.monotonic() + 5
    while True:
        producer.reap_consumed()
        if backend.held(producer) <= before or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert backend.held(producer) <= before


def test_stage_id_comes_from_the_config(backend: Backend) -> None:
    assert backend.make().stage_id is None
    connector = backend.make(stage_id=2)
    assert connector.stage_id == 2


def test_close_is_idempotent_and_final(backend: Backend) -> None:
    connector = backend.make()
    ok, _, metadata = connector.put("s0", "s1", "closing/0", b"x" * 100)
    assert ok
    connector.close()
    connector.close()
    assert connector.put("s0", "s1", "closing/1", b"y") == (False, 0, None)
    with pytest.raises(ConnectorClosed):
        connector.put_or_raise("s0", "s1", "closing/2", b"y")
    with pytest.raises(ConnectorClosed):
        connector.get("s0", "s1", "closing/0", wire(metadata))
    assert connector.health()["status"] == "unhealthy"


def test_puts_and_gets_from_many_threads(pair) -> None:
    producer, consumer = pair

    def one(i: int) -> None:
        value = {"i": i, "t": torch.full((1000 + i,), i, dtype=torch.int32)}
        ok, size, metadata = producer.put("s0", "s1", f"thread-{i}/0", value)
        assert ok
        data, got_size = consumer.get_with_deadline(
            "s0", "s1", f"thread-{i}/0", wire(metadata), deadline=time.monotonic() + 20
        )
        assert got_size == size and mismatch(value, data) is None

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(32)))


# --------------------------------------------------------------------------- across processes


@pytest.mark.parametrize("kind", SENT)
def test_a_consumer_in_another_process_gets_what_this_one_put(pair, peer: Peer, kind: str) -> None:
    producer, _ = pair
    ok, size, metadata = producer.put("s0", "s1", f"xproc-{kind}/0", payload(kind))
    assert ok
    edge = {"from": "s0", "to": "s1"}
    reply = peer.ask(op="get", **edge, key=f"xproc-{kind}/0", metadata=metadata, expect=received(kind))
    assert reply.get("error") is None and reply["mismatch"] is None and reply["size"] == size, reply


def test_this_process_gets_by_key_what_another_one_put(peer: Peer, pair, backend: Backend) -> None:
    _, consumer = pair
    put = peer.ask(op="put", **{"from": "s0", "to": "s1"}, key="xkey/0", payload="mixed")
    assert put.get("ok"), put
    partial = backend.partial(put["metadata"])
    data, size = consumer.get_with_deadline("s0", "s1", "xkey/0", partial, deadline=time.monotonic() + 10)
    assert size == put["size"] and mismatch(payload("mixed"), data) is None
    assert consumer.get("s0", "s1", "xkey/0", partial) is None


def test_a_payload_outlives_nothing_it_should_not(pair, backend: Backend) -> None:
    """After a round of puts, gets and cleanups the producer holds nothing more than before."""
    producer, consumer = pair
    producer.reap_consumed()
    before = backend.held(producer)
    for i in range(20):
        ok, _, metadata = producer.put("s0", "s1", f"leak-{i}/0", {"x": torch.ones(1000)})
        assert ok
        if i % 2:
            assert consumer.get("s0", "s1", f"leak-{i}/0", wire(metadata)) is not None
        else:
            producer.cleanup(f"leak-{i}")
    deadline = time.monotonic() + 5
    while backend.held(producer) > before and time.monotonic() < deadline:
        producer.reap_consumed()
        time.sleep(0.05)
    assert backend.held(producer) <= before


def test_no_pickle_in_any_module_of_the_connectors() -> None:
    # codec/ and connectors/ are siblings; the connectors' subpackages are read too.
    paths = sorted((Path(codec.__file__).parent.parent / "connectors").rglob("*.py"))
    assert len(paths) > 40, paths  # it reads the package (it once globbed under codec/ and read nothing)
    for path in paths:
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path
