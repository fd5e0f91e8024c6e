"""SharedMemoryConnector's tiny payloads found by key alone.

A tiny payload travels in its metadata; a copy goes into the pool only once a get by key is seen on
the host (shm_wanted), and the tiny payloads put shortly before are copied in then (shm_recent): at
once for producers in the getter's process, within a watcher tick for others.
"""

from __future__ import annotations

import gc
import mmap
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest
import torch
from support.meshkit import wait_for
from support.shm_kit import ShmPeer as Peer
from support.shm_kit import connector

from omni_mesh import codec
from omni_mesh.connectors.shm import cells as shm_cells
from omni_mesh.connectors.shm import recent as shm_recent
from omni_mesh.connectors.shm import wanted as shm_wanted
from omni_mesh.connectors.shm.slots import FREE, RELEASED, SLOT_HEADER

MiB = 1024 * 1024
COPY_FIELDS = {"segment", "offset", "generation"}  # what metadata carries for a pool copy

pytestmark = pytest.mark.usefixtures("no_segment_left")  # tests/conftest.py


def over_the_wire(metadata: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(metadata, use_bin_type=True), raw=False)


def flag_every_pool(consumer) -> None:
    """A get by key (of nothing) flags every pool on the host: their tiny puts keep a copy from now on."""
    assert consumer.get("a", "b", "no-such-key") is None


def test_a_tiny_put_makes_no_pool_copy_until_a_get_by_key_is_seen() -> None:
    with connector({}) as producer, connector({}) as consumer:
        ok, size, metadata = producer.put("a", "b", "t/0", {"t": torch.arange(8)})
        assert ok and set(metadata) == {"frame", "key"}
        assert producer.health()["live_payloads"] == 0
        data, got = consumer.get("a", "b", "t/0", over_the_wire(metadata))
        assert torch.equal(data["t"], torch.arange(8)) and got == size
        flag_every_pool(consumer)
        # t/0 is copied in (its consumer had the metadata, which nobody here can know)
        assert producer.health()["live_payloads"] == 1
        ok, _, metadata = producer.put("a", "b", "t/1", {"t": torch.arange(8)})
        assert ok and set(metadata) >= COPY_FIELDS and producer.health()["live_payloads"] == 2
        data, _ = consumer.get("a", "b", "t/1", over_the_wire(metadata))  # releases its copy
        assert torch.equal(data["t"], torch.arange(8)) and producer.health()["live_payloads"] == 1


def test_payloads_put_before_the_first_get_by_key_in_this_process_are_found_at_once() -> None:
    # More than the 16 cells: the rest are copied into pool slots, found through the key index.
    with connector({"memory_pool_size": MiB}) as producer, connector({}) as consumer:
        values = {f"early/{i}": {"t": torch.full((64,), float(i))} for i in range(40)}
        for key, value in values.items():
            ok, _, metadata = producer.put("a", "b", key, value)
            assert ok and "segment" not in metadata
        for key in reversed(values):
            data, _ = consumer.get("a", "b", key)
            assert torch.equal(data["t"], values[key]["t"]), key
            assert consumer.get("a", "b", key) is None  # taken once
        del data
        producer.reap_consumed()
        assert producer.health()["live_payloads"] == 0 and producer.health()["pool_in_use"] == 0


def test_tiny_payloads_past_the_cells_are_found_by_key_alone_and_free_their_memory() -> None:
    # Gets by key seen: 40 waiting tiny payloads, the first 16 in the pool's cells (found by scanning
    # them), the rest in pool slots (found through the key index); every one is found by key alone, once.
    with connector({"memory_pool_size": MiB}) as producer, connector({}) as consumer:
        producer.warm_up()  # its pool exists: a get by key flags the pools there are
        flag_every_pool(consumer)
        values = {f"tiny/{i}": {"t": torch.full((64,), float(i))} for i in range(40)}
        for key, value in values.items():
            ok, _, metadata = producer.put("a", "b", key, value)
            assert ok and "frame" in metadata and set(metadata) >= COPY_FIELDS
        assert producer.health()["live_payloads"] == 40
        for key in reversed(values):  # not in put order: no cell is found by its position
            data, _ = consumer.get("a", "b", key)
            assert torch.equal(data["t"], values[key]["t"])
            assert consumer.get("a", "b", key) is None
        del data  # its views hold the last slot; gone, it is released
        producer.reap_consumed()
        assert producer.health()["live_payloads"] == 0 and producer.health()["pool_in_use"] == 0
        # the cells are reused: another round takes them again, and the metadata alone still works
        for key, value in values.items():
            _, _, metadata = producer.put("a", "b", key + "/again", value)
            data, _ = consumer.get("a", "b", key + "/again", over_the_wire(metadata))
            assert torch.equal(data["t"], value["t"])
        producer.reap_consumed()
        assert producer.health()["live_payloads"] == 0


def test_a_get_by_key_in_this_process_finds_what_another_put_before_it() -> None:
    producer = Peer()  # a fresh process: no get by key has flagged its pool
    try:
        frame = bytes(codec.encode({"t": torch.arange(100)}))
        reply = producer.call("put", from_stage="a", to_stage="b", put_key="x/0", frame=frame)
        assert reply["ok"] and "segment" not in reply["metadata"]
        with connector({}) as consumer:
            started = time.monotonic()
            data, _ = consumer.get_with_deadline("a", "b", "x/0", None, deadline=started + 30)
            # found once the producer's watcher saw the flag (a tick is 50 ms), not at the deadline
            assert torch.equal(data["t"], torch.arange(100)) and time.monotonic() - started < 10
            assert consumer.get("a", "b", "x/0") is None
            # from now on the producer's tiny puts keep a copy at once
            reply = producer.call("put", from_stage="a", to_stage="b", put_key="x/1", frame=frame)
            assert set(reply["metadata"]) >= COPY_FIELDS
            data, _ = consumer.get("a", "b", "x/1")
            assert torch.equal(data["t"], torch.arange(100))
    finally:
        producer.stop()


def test_a_cleanup_before_the_first_get_by_key_keeps_its_payloads_from_being_copied_in() -> None:
    with connector({}) as producer, connector({}) as consumer:
        for key, value in (("req-1/0", b"one"), ("req-1/1", b"two"), ("req-10/0", b"ten")):
            assert producer.put("a", "b", key, value)[0]
        producer.cleanup("req-1")
        assert producer.put("a", "b", "req-1/2", b"after")[0]  # put after the cleanup: kept
        assert consumer.get("a", "b", "req-1/0") is None and consumer.get("a", "b", "req-1/1") is None
        assert consumer.get("a", "b", "req-10/0")[0] == b"ten"  # another key that starts alike
        assert consumer.get("a", "b", "req-1/2")[0] == b"after"


def test_copies_nobody_takes_are_freed_and_older_payloads_are_not_copied_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_recent, "BACKFILL_S", 0.5)
    with connector({}) as producer, connector({}) as consumer:
        _, _, old = producer.put("a", "b", "old/0", b"old")
        time.sleep(0.6)
        _, _, new = producer.put("a", "b", "new/0", b"new")
        assert consumer.get("a", "b", "new/0", over_the_wire(new))[0] == b"new"  # through its metadata
        flag_every_pool(consumer)
        assert consumer.get("a", "b", "old/0") is None  # put more than BACKFILL_S before: not copied in
        assert consumer.get("a", "b", "old/0", over_the_wire(old))[0] == b"old"  # its metadata still works
        health = producer.health()
        assert health["live_payloads"] == health["tiny_copies"] == 1, health  # new/0's copy, untaken
        wait_for(lambda: producer.health()["live_payloads"] == 0, 10, "the untaken copy to be freed")
        assert producer.health()["tiny_copies"] == 0


def test_the_watcher_thread_ends_once_no_producer_waits_for_the_flag() -> None:
    script = textwrap.dedent(
        """
        import threading, time
        from omni_mesh.connectors import create_connector

        def watching():
            return any(t.name == "omni-mesh-shm-wanted" for t in threading.enumerate())

        producer = create_connector("SharedMemoryConnector", {})
        assert not watching()
        assert producer.put("a", "b", "k", b"tiny")[0]
        assert watching()
        producer.close()
        deadline = time.monotonic() + 10
        while watching() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not watching(), "the watcher thread outlived every producer"
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_cell_being_written_is_never_handed_out_twice() -> None:
    # Puts from several threads: a cell taken by one put shows "being written" until that put seals
    # it, so another put never takes it meanwhile (its last consumer had released it).
    size = shm_cells.cell_size(SLOT_HEADER, 4096)
    with mmap.mmap(-1, 64 + shm_cells.COUNT * size) as mm:
        cells = shm_cells.Cells(mm, 64, size, reusable=(RELEASED,), writing=FREE)
        first = [cells.take(f"k/{i}") for i in range(shm_cells.COUNT)]
        for offset in first:
            mm[offset] = RELEASED  # sealed, got and released by its consumer
        again = [cells.take(f"r/{i}") for i in range(shm_cells.COUNT)]
        assert sorted(again) == sorted(first)
        assert cells.take("one more") is None  # every cell is being written


def test_a_producer_collected_while_the_watcher_holds_its_lock_does_not_deadlock() -> None:
    # The garbage collector may finalize a connector (its __del__ closes it) at any allocation, also
    # inside the watcher's tick, which holds the watcher's lock while it lists the producers.
    producer = connector({})
    assert producer.put("a", "b", "k", b"tiny")[0]  # now watched
    del producer  # unreachable; its reference cycles wait for the collector
    collected = threading.Event()

    def collect_as_the_tick_would() -> None:
        with shm_wanted._lock:
            gc.collect()
        collected.set()

    threading.Thread(target=collect_as_the_tick_would, daemon=True).start()
    assert collected.wait(30), "a finalizer waited for the watcher's lock: the watcher is deadlocked"


def test_a_producer_whose_copy_in_fails_is_logged_and_dropped_not_the_watcher(caplog: pytest.LogCaptureFixture) -> None:
    class Failing:
        def notice_wanted(self) -> bool:
            raise RuntimeError("copy-in failed")

    failing = Failing()
    shm_wanted.watch(failing)
    shm_wanted.tick()  # does not raise: the watcher thread runs this same loop
    assert "copying recent tiny payloads in for gets by key failed" in caplog.text
    assert failing not in shm_wanted._waiting
