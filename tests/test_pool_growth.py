"""SharedMemoryConnector's pool grows instead of falling back: a payload that fits no free space adds a
pool segment sized for it, kept for the next payloads, up to max_pool_size; idle grown segments go
back; only past the ceiling does a put take a one-off segment (counted). Crash cleanup and reaping
cover every segment of a process. Real processes (tests/shm_consumer.py), real /dev/shm.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import torch
from support.shm_kit import ShmPeer as Peer
from support.shm_kit import connector, our_segments

from omni_mesh import codec
from omni_mesh.connectors.pools.growth import FIRST_PART
from omni_mesh.connectors.shared_memory import AUTO_CEILING_MAX, GROW_STEP
from omni_mesh.connectors.shm import index as shm_index
from omni_mesh.connectors.shm import slots as shm_slots
from omni_mesh.connectors.shm.segments import owner_of, reap_orphaned_segments, shm_capacity

MiB = 1 << 20
SMALL_POOL = {"memory_pool_size": 2 * MiB, "inline_max_bytes": 0}


pytestmark = pytest.mark.usefixtures("no_segment_left")  # tests/conftest.py


@pytest.fixture(scope="module")
def consumer() -> Iterator[Peer]:
    peer = Peer()
    yield peer
    peer.stop()


def payload(mib: int, fill: float = 1.0) -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.full((mib * MiB // 4,), fill)}


def kind(name: str) -> str:
    """"p" for a segment the pool grew by, "x" for a one-off (their numbers are random)."""
    match = re.search(r"_([px])\d+$", name)
    assert match, name
    return match.group(1)


def same(got: dict, want: dict) -> bool:
    return torch.equal(got["hidden_states"], want["hidden_states"])


def test_a_payload_larger_than_the_pool_grows_it_once_and_reuses_the_segment(consumer: Peer) -> None:
    with connector(SMALL_POOL) as conn:
        grown = set()
        for i in range(5):
            value = payload(6, float(i))
            _, _, metadata = conn.put("a", "b", f"r/{i}", value)
            assert kind(metadata["segment"]) == "p", metadata  # a pool segment, never a one-off
            grown.add(metadata["segment"])
            assert same(consumer.get(f"r/{i}", metadata), value)
        assert len(grown) == 1, grown
        health = conn.health()
        assert health["pool_grown"] == 1 and health["fallbacks"] == 0, health
        assert health["pool_segments"] == 2
        assert health["pool_size"] == 2 * MiB + 16 * MiB  # 6 MiB + headers, rounded up to GROW_STEP
    assert 16 * MiB == GROW_STEP


def test_payloads_in_flight_at_once_each_find_room(consumer: Peer) -> None:
    with connector(SMALL_POOL) as conn:
        values = [payload(6, float(i)) for i in range(4)]
        metadata = [conn.put("a", "b", f"r/{i}", v)[2] for i, v in enumerate(values)]  # none consumed yet
        for i, value in enumerate(values):
            assert same(consumer.get(f"r/{i}", metadata[i]), value)
        health = conn.health()
        assert health["fallbacks"] == 0 and health["pool_grown"] == 2, health  # two 6 MiB slots per segment


def test_past_the_ceiling_a_put_takes_a_counted_one_off_segment(consumer: Peer) -> None:
    with connector({**SMALL_POOL, "max_pool_size": 20 * MiB}) as conn:
        values = [payload(6, float(i)) for i in range(4)]
        metadata = [conn.put("a", "b", f"r/{i}", v)[2] for i, v in enumerate(values)]
        # 2 + 16 MiB fit under 20 MiB; a second growth would not
        assert [kind(m["segment"]) for m in metadata] == ["p", "p", "x", "x"]
        assert metadata[0]["segment"] == metadata[1]["segment"] != metadata[2]["segment"] != metadata[3]["segment"]
        health = conn.health()
        assert health["pool_grown"] == 1 and health["fallbacks"] == 2 and health["max_pool_size"] == 20 * MiB
        for i, value in enumerate(values):
            assert same(consumer.get(f"r/{i}", metadata[i]), value)
        # Consumed: the next put finds its room in the pool again.
        _, _, again = conn.put("a", "b", "r/again", values[0])
        assert again["segment"] == metadata[0]["segment"] and conn.health()["fallbacks"] == 2
        assert same(consumer.get("r/again", again), values[0])


def test_growth_at_the_ceiling_takes_back_empty_grown_segments_before_it_falls_back(consumer: Peer) -> None:
    """A pool that grew for smaller payloads holds that segment, empty, until its idle time runs out:
    a larger payload whose growth the ceiling refuses meanwhile must take that room back and grow, not
    take a one-off (before, whether it fell back depended on how long ago the smaller payloads went)."""
    with connector({**SMALL_POOL, "max_pool_size": 30 * MiB}) as conn:  # idle release: 30 s, not reached
        small = payload(6)
        _, _, metadata = conn.put("a", "b", "r/small", small)
        assert kind(metadata["segment"]) == "p" and same(consumer.get("r/small", metadata), small)
        large = payload(17)  # 2 + 16 MiB held: 17 MiB more would pass 30 MiB
        _, _, metadata = conn.put("a", "b", "r/large", large)
        assert kind(metadata["segment"]) == "p", metadata
        assert same(consumer.get("r/large", metadata), large)
        health = conn.health()
        assert health["fallbacks"] == 0 and health["pool_grown"] == 2 and health["pool_released"] == 1, health
        assert health["pool_size"] <= 30 * MiB


def test_idle_grown_segments_go_back_and_the_consumer_lets_go_of_them(consumer: Peer) -> None:
    with connector({**SMALL_POOL, "pool_idle_release_s": 0.2}) as conn:
        value = payload(6)
        _, _, metadata = conn.put("a", "b", "r/0", value)
        grown = metadata["segment"]
        assert same(consumer.get("r/0", metadata), value)
        assert grown in our_segments()
        conn.put("a", "b", "r/small", payload(1))  # a put reclaims the consumed slot
        time.sleep(0.3)
        health = conn.health()  # stage runtimes read health() every few seconds: it releases too
        assert health["pool_released"] == 1 and health["pool_segments"] == 1, health
        assert grown not in our_segments()
        consumer.call("health")  # ...and a consumer's health() drops its mapping of it
        assert not any(grown in path for path in consumer.call("maps")["maps"])
        conn.cleanup("r")
        # It grows again when needed.
        _, _, metadata = conn.put("a", "b", "r/1", value)
        assert kind(metadata["segment"]) == "p" and metadata["segment"] != grown
        assert conn.health()["pool_grown"] == 2
        assert same(consumer.get("r/1", metadata), value)


def test_get_by_key_alone_finds_payloads_in_grown_and_one_off_segments(consumer: Peer) -> None:
    """The key index lives in the pool's first segment and names the segment each payload lies in: a
    consumer holding only the key finds payloads in a grown segment and in a one-off alike."""
    with connector({**SMALL_POOL, "max_pool_size": 20 * MiB}) as conn:
        values = {f"k/{i}": payload(6, float(i)) for i in range(3)}
        paths = [kind(conn.put("a", "b", key, value)[2]["segment"]) for key, value in values.items()]
        assert paths == ["p", "p", "x"]
        for key in reversed(values):  # no metadata at all: the key alone
            assert same(consumer.get(key, None), values[key]), key
            assert consumer.get(key, None) is None  # taken once
        assert conn.health()["unindexed_puts"] == 0


def test_a_grown_segment_goes_back_with_its_index_entries(consumer: Peer) -> None:
    """A grown segment is released only once it holds no slot, and the index entries that pointed into
    it are cleared first: a get by key then finds nothing, and no mapping of the segment is made."""
    with connector({**SMALL_POOL, "pool_idle_release_s": 0.2}) as conn:
        value = payload(6)
        _, _, metadata = conn.put("a", "b", "gone/0", value)
        grown = metadata["segment"]
        conn.cleanup("gone")  # never consumed: freed, the segment now holds nothing
        time.sleep(0.3)
        assert conn.health()["pool_released"] == 1 and grown not in our_segments()
        assert consumer.get("gone/0", None) is None
        assert not any(grown in path for path in consumer.call("maps")["maps"])
        # The first segment's index no longer names the grown segment anywhere.
        first = conn._pool.first
        digest = shm_slots.digest("a", "b", "gone/0")
        assert shm_index.lookup(first.mm, shm_slots.POOL_HEADER, digest) == []


def test_close_and_a_killed_producer_leave_no_grown_segment() -> None:
    producer = Peer(SMALL_POOL)
    try:
        for i in range(3):  # none consumed: the pool grows twice
            reply = producer.call("put", from_stage="a", to_stage="b", put_key=f"r/{i}", frame=bytes(codec.encode(payload(6))))
            assert reply["ok"], reply
        names = {name for name in our_segments() if owner_of(name).pid == producer.pid}
        assert len(names) == 3 and sum(re.search(r"_p\d+$", name) is not None for name in names) == 2, names
    finally:
        producer.kill()
    assert sorted(reap_orphaned_segments(pid=producer.pid)) == sorted(names)  # every segment of the process
    assert our_segments() == {}
    with connector(SMALL_POOL) as conn:
        conn.put("a", "b", "r/0", payload(6))
        assert len(our_segments()) == 2
    assert our_segments() == {}  # close() unlinks the grown segment with the first


def test_the_automatic_ceiling_is_half_of_dev_shm_at_most_8_gib() -> None:
    with connector() as conn:
        assert conn.health()["max_pool_size"] == max(256 * MiB, min(shm_capacity() // 2, AUTO_CEILING_MAX))
    with connector({"memory_pool_size": "1MiB", "max_pool_size": "64MiB"}) as conn:
        assert conn.health()["max_pool_size"] == 64 * MiB
    with pytest.raises(ValueError, match="pool_idle_release_s must not be negative"):
        connector({"pool_idle_release_s": -1})


# ------------------------------------------------------------------ ZmqConnector: the same rule


@pytest.fixture
def zmq_consumer() -> Iterator:
    from omni_mesh.connectors import create_connector

    made = create_connector("ZmqConnector", {"host": "127.0.0.1"})
    yield made
    made.close()


def zmq_producer(**extra):
    from omni_mesh.connectors import create_connector

    return create_connector("ZmqConnector", {"host": "127.0.0.1", "memory_pool_size": "4MiB", **extra})


def test_zmq_pool_grows_for_payloads_in_flight_and_gives_regions_back(zmq_consumer) -> None:
    producer = zmq_producer(pool_idle_release_s=0.2)
    try:
        values = [payload(6, float(i)) for i in range(3)]
        metadata = [producer.put("a", "b", f"r/{i}", v)[2] for i, v in enumerate(values)]  # all in flight
        health = producer.health()
        assert health["oneoff"] == 0 and health["pool_grown"] == 2 and health["pool_regions"] == 3, health
        for i, value in enumerate(values):
            got, _ = zmq_consumer.get("a", "b", f"r/{i}", metadata[i])
            assert same(got, value)
            del got
        time.sleep(0.3)
        producer.put("a", "b", "tick", b"x")  # reaps what was sent; idle regions go at the next look
        time.sleep(0.3)
        health = producer.health()
        assert health["pool_released"] == 2 and health["pool_regions"] == 1, health
        assert health["pool_bytes"] == 4 * MiB
    finally:
        producer.close()


def test_zmq_past_the_ceiling_a_put_takes_a_counted_one_off_buffer(zmq_consumer) -> None:
    producer = zmq_producer(max_pool_size="20MiB")
    try:
        values = [payload(6, float(i)) for i in range(4)]
        metadata = [producer.put("a", "b", f"r/{i}", v)[2] for i, v in enumerate(values)]
        health = producer.health()
        assert health["pool_grown"] == 1 and health["oneoff"] == 2 and health["max_pool_size"] == 20 * MiB
        for i, value in enumerate(values):
            got, _ = zmq_consumer.get("a", "b", f"r/{i}", metadata[i])
            assert same(got, value)
    finally:
        producer.close()


# ------------------------------------------------------------------ Mooncake TE: send and receive pools


def test_te_send_and_receive_pools_grow_for_a_payload_larger_than_them() -> None:
    from omni_mesh.connectors import create_connector

    # zero_copy_min_bytes 0: the producer lays the whole frame into its pool (no leaf sent from its own memory).
    config = {
        "host": "127.0.0.1",
        "memory_pool_size": "4MiB",
        "prefault": False,
        "pool_idle_release_s": 1.0,
        "zero_copy_min_bytes": 0,
    }
    producer = create_connector("MooncakeTransferEngineConnector", config)
    consumer = create_connector("MooncakeTransferEngineConnector", {**config, "connect_timeout_s": 2.0})
    try:
        for i in range(2):
            value = {"hidden_states": torch.full((6 * MiB // 4,), float(i))}  # 6 MiB: larger than either pool
            _, _, metadata = producer.put("a", "b", f"r/{i}", value)
            got, _ = consumer.get("a", "b", f"r/{i}", metadata)
            assert same(got, value)
            del got
        assert producer.health()["pool_size"] > 4 * MiB and consumer.health()["pool_size"] > 4 * MiB
        assert producer.health()["pool_grown"] == 1 and consumer.health()["pool_grown"] == 1  # then reused
        time.sleep(1.2)
        # An allocation looks for idle regions first: the grown ones go back (unregistered).
        producer.put("a", "b", "tick", {"x": torch.ones(8)})
        health = producer.health()
        assert health["pool_released"] == 1 and health["pool_size"] == 4 * MiB, health
    finally:
        producer.close()
        consumer.close()


def test_a_default_pool_starts_small_and_grows_as_payloads_need(consumer: Peer) -> None:
    """A producer maps what it needs, not memory_pool_size (256 MiB by default) up front: an idle mesh
    holds little shared memory. The usual hand-offs (0.5-2 MiB) fit the first segment; larger ones grow it."""
    with connector() as conn:
        assert conn.config.memory_pool_size == 256 * MiB  # the default stays: it is no longer mapped at once
        conn.warm_up()  # what a stage does at start
        (first,) = our_segments().values()
        assert first <= FIRST_PART + MiB, first  # the slots, plus the key index and tiny-payload cells
        for i in range(3):
            value = payload(2, float(i))
            _, _, metadata = conn.put("a", "b", f"r/{i}", value)
            assert same(consumer.get(f"r/{i}", metadata), value)
        assert conn.health()["pool_grown"] == 0 and len(our_segments()) == 1
        value = payload(20)
        _, _, metadata = conn.put("a", "b", "r/big", value)
        assert kind(metadata["segment"]) == "p" and same(consumer.get("r/big", metadata), value)
        health = conn.health()
        assert health["pool_grown"] == 1 and health["fallbacks"] == 0, health


def test_a_pool_grows_into_what_its_ceiling_leaves_rather_than_fall_back(consumer: Peer) -> None:
    """memory_pool_size 8 MiB, max_pool_size 12 MiB: the pool starts at 4 MiB, and a 6 MiB payload (no
    room there) grows it by what the ceiling leaves, not by a whole GROW_STEP it has no room for."""
    with connector({"memory_pool_size": 8 * MiB, "max_pool_size": 12 * MiB, "inline_max_bytes": 0}) as conn:
        value = payload(6)
        _, _, metadata = conn.put("a", "b", "r/0", value)
        assert kind(metadata["segment"]) == "p", metadata
        assert same(consumer.get("r/0", metadata), value)
        health = conn.health()
        assert health["fallbacks"] == 0 and health["pool_grown"] == 1, health
        assert sum(our_segments().values()) <= 12 * MiB


def test_a_pool_its_ceiling_cannot_grow_enough_maps_all_of_it_at_once(consumer: Peer) -> None:
    """memory_pool_size = max_pool_size = 8 MiB: starting small would leave growth no room for a 6 MiB
    payload, so the pool maps its 8 MiB up front, as before pools grew."""
    with connector({"memory_pool_size": 8 * MiB, "max_pool_size": 8 * MiB, "inline_max_bytes": 0}) as conn:
        value = payload(6)
        _, _, metadata = conn.put("a", "b", "r/0", value)
        assert metadata["segment"] == conn._pool.first.name
        assert same(consumer.get("r/0", metadata), value)
        assert conn.health()["fallbacks"] == 0
