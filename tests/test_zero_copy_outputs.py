"""Outputs allocated where they will be sent from: `connector.empty(shape, dtype)` on
SharedMemoryConnector, ZmqConnector and MooncakeTransferEngineConnector, and `ctx.empty` in a stage.

A put of such a tensor copies none of its bytes: shown by writing into the tensor after the put
(what the rule forbids a handler to do) and seeing the consumer receive the new bytes. Everything
else in the payload still travels as before. Real processes, sockets and engines; nothing left in
/dev/shm.
"""

from __future__ import annotations

import concurrent.futures
import gc
import signal
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from support.meshkit import running_mesh, wait_for
from support.shm_kit import ShmPeer as Peer
from support.shm_kit import connector, our_segments

MiB = 1 << 20
DEMO = Path(__file__).resolve().parents[1] / "compose" / "omni-demo.yaml"
LOCAL_ZMQ = {"host": "127.0.0.1"}
TE_CONFIG = {"host": "127.0.0.1", "memory_pool_size": "64MiB", "prefault": False, "connect_timeout_s": 2.0}


pytestmark = pytest.mark.usefixtures("no_segment_left")  # tests/conftest.py


@pytest.fixture(scope="module")
def shm_consumer() -> Iterator[Peer]:
    peer = Peer()
    yield peer
    peer.stop()


def mixed(hidden: torch.Tensor) -> dict:
    """An output as a handler returns it: the empty() tensor beside ordinary leaves of every size."""
    return {
        "hidden_states": hidden,
        "text": "hello",
        "usage": {"tokens": 3},
        "small": torch.arange(5),
        "large": torch.full((300_000,), 2.5),  # 1.2 MB, not from empty(): copied as today
        "strided": torch.arange(200_000, dtype=torch.float32).view(400, 500).t(),
    }


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(torch.as_tensor(got[key]), value), key
        else:
            assert got[key] == value, key


def filled(conn, shape=(512, 3584), seed: int = 0) -> torch.Tensor:
    tensor = conn.empty(shape, torch.bfloat16)
    tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return tensor


# ------------------------------------------------------------------ SharedMemoryConnector


def test_shm_empty_output_crosses_processes_without_a_copy(shm_consumer: Peer) -> None:
    with connector() as conn:
        hidden = filled(conn)
        want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mixed(hidden).items()}
        ok, size, metadata = conn.put("a", "b", "r/0", mixed(hidden))
        assert ok and "refs" in metadata and len(metadata["refs"]) >= 3
        assert size > hidden.nbytes
        hidden[0, 0] = 42.0  # after the put: breaks the rule on purpose, to show nothing was copied
        want["hidden_states"][0, 0] = 42.0
        assert_same(shm_consumer.get("r/0", metadata), want)
        assert shm_consumer.get("r/0", metadata) is None  # consumed
        health = conn.health()
        assert health["zero_copy_leaves"] == 1 and health["fallbacks"] == 0 and health["errors"] == 0


def test_shm_in_one_process_the_consumer_views_the_producers_tensor() -> None:
    with connector() as conn:
        hidden = filled(conn)
        _, _, metadata = conn.put("a", "b", "r/0", {"hidden_states": hidden})
        got, _ = conn.get("a", "b", "r/0", metadata)
        assert got["hidden_states"].data_ptr() == hidden.data_ptr()
        del got


def test_shm_slot_stays_pinned_while_the_producer_holds_its_tensor(shm_consumer: Peer) -> None:
    with connector() as conn:
        hidden = filled(conn, seed=1)
        keep = hidden.clone()
        _, _, metadata = conn.put("a", "b", "r/0", {"hidden_states": hidden})
        assert_same(shm_consumer.get("r/0", metadata), {"hidden_states": keep})  # consumed and released
        for i in range(3):  # same-sized puts would refill a released slot: never this one
            _, _, other = conn.put("a", "b", f"r/{i + 1}", {"hidden_states": torch.zeros_like(keep)})
            assert other.get("offset") != metadata["refs"][1][1]
            shm_consumer.get(f"r/{i + 1}", other)
        assert torch.equal(hidden, keep)
        in_use = conn.health()["pool_in_use"]
        del hidden
        gc.collect()
        assert conn.health()["pool_in_use"] < in_use  # the slot goes back once the tensor is gone


def test_shm_unsent_outputs_and_aborted_puts_give_their_memory_back() -> None:
    with connector() as conn:
        baseline = conn.health()["pool_in_use"]
        unused = conn.empty((4 * MiB,), torch.uint8)
        assert conn.health()["pool_in_use"] >= baseline + 4 * MiB
        del unused
        gc.collect()
        assert conn.health()["pool_in_use"] == baseline
        hidden = filled(conn)
        _, _, metadata = conn.put("a", "b", "req-7/0", {"hidden_states": hidden})
        conn.cleanup("req-7")  # aborted before anyone consumed it
        assert conn.get("a", "b", "req-7/0", metadata) is None
        del hidden
        gc.collect()
        assert conn.health()["pool_in_use"] == baseline


def test_shm_an_output_sent_over_two_edges_is_copied_for_the_second(shm_consumer: Peer) -> None:
    with connector() as conn:
        hidden = filled(conn, seed=2)
        keep = hidden.clone()
        _, _, first = conn.put("a", "b", "r/0", {"hidden_states": hidden})
        _, _, second = conn.put("a", "c", "r/0", {"hidden_states": hidden})
        assert "refs" in first and "refs" not in second  # the second is an ordinary frame
        assert_same(shm_consumer.get("r/0", first), {"hidden_states": keep})
        assert_same(shm_consumer.get("r/0", second, edge=("a", "c")), {"hidden_states": keep})
        assert conn.health()["zero_copy_leaves"] == 1


@pytest.mark.parametrize("where", ["value", "key"])
def test_shm_a_large_header_goes_as_a_whole_frame_with_small_metadata(shm_consumer: Peer, where: str) -> None:
    """The metadata travels on the control plane (1 MiB a message): an output whose codec header is
    large (a 1.2 MB prompt beside the hidden states, or as a key) is put as a whole frame, its empty()
    tensor copied, rather than carrying the header in the metadata."""
    prompt = "omni mesh " * 120_000
    with connector() as conn:
        hidden = filled(conn, seed=3)
        data = {"hidden_states": hidden, "prompt": prompt} if where == "value" else {prompt: hidden}
        want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in data.items()}
        ok, size, metadata = conn.put("a", "b", "r/0", data)
        assert ok and "refs" not in metadata and len(msgpack.packb(metadata)) < 1024, sorted(metadata)
        assert size > len(prompt) + hidden.nbytes
        assert_same(shm_consumer.get("r/0", metadata), want)
        assert conn.health()["zero_copy_leaves"] == 0
        _, _, small = conn.put("a", "b", "r/1", {"hidden_states": hidden, "prompt": "hello"})  # parts form as before
        assert "refs" in small and conn.health()["zero_copy_leaves"] == 1
        shm_consumer.get("r/1", small)


def test_shm_small_and_bad_requests() -> None:
    with connector() as conn:
        small = conn.empty((4, 4), torch.float32)  # not worth a slot: an ordinary tensor
        assert small.shape == (4, 4) and conn.health()["live_payloads"] == 0
        with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
            conn.empty((1 << 20,), "float32")
        hidden = filled(conn)
        _, _, metadata = conn.put("a", "b", "r/0", {"hidden_states": hidden})
        assert conn.get("a", "b", "r/1", metadata) is None  # another key's metadata: never its data
        with pytest.raises(Exception, match="bad part"):
            conn.get("a", "b", "r/0", {**metadata, "refs": [["x", -1, 0, 0]]})


def test_shm_close_with_live_outputs_leaves_nothing(shm_consumer: Peer) -> None:
    conn = connector()
    hidden = filled(conn)
    _, _, metadata = conn.put("a", "b", "r/0", {"hidden_states": hidden})
    also = conn.empty((2 * MiB,), torch.uint8)
    conn.close()
    assert our_segments() == {}
    del hidden, also


# ------------------------------------------------------------------ ZmqConnector


@pytest.fixture
def zmq_pair() -> Iterator[tuple]:
    from omni_mesh.connectors import create_connector

    producer, consumer = create_connector("ZmqConnector", LOCAL_ZMQ), create_connector("ZmqConnector", LOCAL_ZMQ)
    yield producer, consumer
    producer.close()
    consumer.close()


def test_zmq_empty_output_is_served_from_the_pool_without_a_copy(zmq_pair) -> None:
    producer, consumer = zmq_pair
    hidden = filled(producer)
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mixed(hidden).items()}
    _, size, metadata = producer.put("a", "b", "r/0", mixed(hidden))
    assert size == metadata["size"] and size > hidden.nbytes
    hidden[0, 0] = 42.0  # after the put: the consumer still gets it, so the put copied nothing
    want["hidden_states"][0, 0] = 42.0
    got, got_size = consumer.get("a", "b", "r/0", metadata)
    assert_same(got, want)
    assert got_size == size
    assert consumer.health()["errors"] == 0


def test_zmq_a_dict_of_outputs_alone_is_sent_from_the_pool(zmq_pair) -> None:
    """The usual stage output, a dict of empty() tensors and nothing else, takes the put's shortest path
    (a cached header, no frame plan): still nothing is copied, and a second put of the same tensor
    (another edge) is an ordinary one."""
    producer, consumer = zmq_pair
    hidden, other = filled(producer, seed=3), filled(producer, shape=(64, 3584), seed=4)
    _, size, metadata = producer.put("a", "b", "d/0", {"hidden_states": hidden, "other": other})
    assert size >= hidden.nbytes + other.nbytes
    _, _, again = producer.put("a", "c", "d/0", {"hidden_states": hidden})  # copied: the put above sends it
    hidden[0, 0], other[0, 0] = 42.0, 43.0  # after the puts: only the first one sees it
    got, _ = consumer.get("a", "b", "d/0", metadata)
    assert got["hidden_states"][0, 0] == 42.0 and got["other"][0, 0] == 43.0
    assert torch.equal(got["hidden_states"][1:], hidden[1:]) and torch.equal(got["other"], other)
    copied, _ = consumer.get("a", "c", "d/0", again)
    assert copied["hidden_states"][0, 0] != 42.0 and torch.equal(copied["hidden_states"][1:], hidden[1:])
    assert consumer.health()["errors"] == 0


def test_zmq_deferred_bookkeeping_keeps_put_order_cleanup_and_replacement(zmq_pair) -> None:
    """A put of empty() outputs leaves its bookkeeping to the table's next reader: a second put of the
    key still replaces the first (whose metadata then finds nothing), and a cleanup before any get
    frees what was never asked for."""
    producer, consumer = zmq_pair
    producer.put("a", "b", "warm", b"x")
    baseline = producer.health()["pool_used_bytes"]
    first, second = filled(producer, seed=6), filled(producer, seed=7)
    _, _, old = producer.put("a", "b", "q/0", {"hidden_states": first})
    _, _, new = producer.put("a", "b", "q/0", {"hidden_states": second})
    assert consumer.get("a", "b", "q/0", old) is None  # replaced: its token no longer matches
    got, _ = consumer.get("a", "b", "q/0", new)
    assert torch.equal(got["hidden_states"], second)
    _, _, dropped = producer.put("a", "b", "q/1", {"hidden_states": first})
    producer.cleanup("q")  # before anyone asked
    assert consumer.get("a", "b", "q/1", dropped) is None
    del got, first, second
    gc.collect()
    producer.put("a", "b", "tick", b"x")
    assert producer.health()["pool_used_bytes"] <= baseline + 256


def test_zmq_output_slots_go_back_once_sent_and_dropped(zmq_pair) -> None:
    producer, consumer = zmq_pair
    producer.put("a", "b", "warm", b"x")
    baseline = producer.health()["pool_used_bytes"]
    hidden = filled(producer)
    _, _, metadata = producer.put("a", "b", "r/0", {"hidden_states": hidden})
    got, _ = consumer.get("a", "b", "r/0", metadata)
    del got
    producer.put("a", "b", "tick", b"x")  # lets the producer reap what it sent
    assert producer.health()["pool_used_bytes"] >= baseline + hidden.nbytes  # still pinned by `hidden`
    unsent = producer.empty((2 * MiB,), torch.uint8)
    del hidden, unsent
    gc.collect()
    producer.put("a", "b", "tock", b"x")

    def only_the_small_puts_remain() -> bool:  # the sent slot goes back once the server thread is done
        producer.reap_consumed()
        return producer.health()["pool_used_bytes"] <= baseline + 256

    wait_for(only_the_small_puts_remain, 10, "the output slots to go back")


# ------------------------------------------------------------------ MooncakeTransferEngineConnector


@pytest.fixture(scope="module")
def te_pair() -> Iterator[tuple]:
    from omni_mesh.connectors import create_connector

    producer = create_connector("MooncakeTransferEngineConnector", TE_CONFIG)
    consumer = create_connector("MooncakeTransferEngineConnector", {**TE_CONFIG, "transfer_timeout_s": 10.0})
    yield producer, consumer
    producer.close()
    consumer.close()


def test_te_empty_output_is_written_by_the_engine_from_the_pool(te_pair) -> None:
    producer, consumer = te_pair
    hidden = filled(producer)
    assert producer.health()["pool_in_use"] >= hidden.nbytes  # it lives in the registered pool
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mixed(hidden).items()}
    _, _, metadata = producer.put("a", "b", "r/0", mixed(hidden))
    hidden[0, 0] = 42.0  # after the put: the engine still sends it from there
    want["hidden_states"][0, 0] = 42.0
    got, _ = consumer.get("a", "b", "r/0", metadata)
    assert_same(got, want)
    del got, hidden
    gc.collect()


def test_te_a_dict_of_outputs_alone_is_laid_out_in_place(te_pair) -> None:
    """A dict of empty() tensors alone: its frame head goes into an output's headroom, the engine sends
    head and tensors from the pool (nothing copied at put). A second put of the same output while the
    first is held takes the general path, and both arrive; the regions go back once all is dropped."""
    producer, consumer = te_pair
    baseline = producer.health()["pool_in_use"]
    hidden = filled(producer, seed=5)
    keep = hidden.clone()
    _, _, first = producer.put("a", "b", "d/0", {"hidden_states": hidden})
    _, _, second = producer.put("a", "c", "d/0", {"hidden_states": hidden})  # the headroom is taken
    assert first["addr"] != second["addr"]
    hidden[0, 0] = 42.0  # after the puts: both are sent from the tensor itself
    keep[0, 0] = 42.0
    for edge, metadata in ((("a", "b"), first), (("a", "c"), second)):
        got, _ = consumer.get(*edge, "d/0", metadata)
        assert torch.equal(got["hidden_states"], keep), edge
        del got
    _, _, third = producer.put("a", "b", "d/1", {"hidden_states": hidden})  # headroom free again
    assert third["addr"] == first["addr"]
    producer.cleanup("d")
    del hidden
    gc.collect()
    assert producer.health()["pool_in_use"] == baseline


@pytest.mark.parametrize(("name", "config"), [("ZmqConnector", LOCAL_ZMQ), ("SharedMemoryConnector", {})])
def test_two_producers_outputs_of_other_shapes_keep_their_own_layout(name: str, config: dict) -> None:
    """Layouts of empty() outputs are cached per process: the first output of a second connector, of
    another shape and dtype under the same key, must not reuse the first connector's layout."""
    from omni_mesh.connectors import create_connector

    first, second, consumer = (create_connector(name, config) for _ in range(3))
    try:
        wide = first.empty((64, 1024), torch.float32)
        wide.fill_(1.0)
        first.put("a", "b", "shape/0", {"hidden_states": wide})
        narrow = second.empty((128, 512), torch.float16)
        narrow.fill_(2.0)
        _, _, metadata = second.put("a", "b", "shape/1", {"hidden_states": narrow})
        got, _ = consumer.get("a", "b", "shape/1", metadata)
        assert got["hidden_states"].dtype == torch.float16 and got["hidden_states"].shape == (128, 512)
        assert torch.equal(got["hidden_states"], narrow)
        del got, wide, narrow
    finally:
        for connector in (first, second, consumer):
            connector.close()
        gc.collect()


@pytest.mark.parametrize("pair", ["zmq_pair", "te_pair"])
def test_puts_of_outputs_are_counted_exactly_from_every_thread(pair: str, request: pytest.FixtureRequest) -> None:
    """A put of a dict of empty() outputs leaves its counting to the next health(): the counts are
    still exact, from several threads at once."""
    producer, _ = request.getfixturevalue(pair)
    before = producer.health()

    def put_some(thread: int) -> int:
        sent = 0
        for i in range(5):
            hidden = producer.empty((64, 1024), torch.float32)
            _, size, _ = producer.put("a", "b", f"count/{thread}/{i}", {"hidden_states": hidden})
            sent += size
        return sent

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        sent = sum(pool.map(put_some, range(4)))
    after = producer.health()
    assert after["puts"] - before["puts"] == 20
    assert after["bytes_put"] - before["bytes_put"] == sent
    producer.cleanup("count")
    gc.collect()


# ------------------------------------------------------------------ puts laid out at empty()

# In-place changes that leave a tensor object over other bytes, of another shape or layout or dtype:
# a put laid out at empty() (`pools.outputs.ReadyPuts`) must not send what empty() made.
IN_PLACE = {
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "t_ (square: same shape, other strides)": lambda t: t.t_(),
    "resize_ smaller": lambda t: t.resize_(512, 1024),
    "as_strided_": lambda t: t.as_strided_((1024, 1024), (1, 1024)),
    "set_ to other memory": lambda t: t.set_(torch.full((1024, 1024), 3.0, dtype=torch.bfloat16)),
    ".data of another dtype over the same bytes": lambda t: setattr(t, "data", t.view(torch.int16)),
}


def test_ready_puts_match_only_the_tensor_empty_made_alone_under_its_name() -> None:
    from omni_mesh.connectors.pools.outputs import ReadyPuts

    ready = ReadyPuts()
    tensor = torch.zeros((1024, 1024), dtype=torch.bfloat16)
    ready.add(tensor, "hidden_states", "laid out")
    assert ready.match({"hidden_states": tensor}) == "laid out"
    assert ready.match({"other_name": tensor}) is None
    assert ready.match({"hidden_states": tensor, "text": "hi"}) is None
    assert ready.match({"hidden_states": tensor.clone()}) is None
    assert ready.match({"hidden_states": tensor.view(1024, 1024)}) is None  # a view is another object
    for name, change in IN_PLACE.items():
        changed = torch.zeros((1024, 1024), dtype=torch.bfloat16)
        ready.add(changed, "hidden_states", "laid out")
        change(changed)
        assert ready.match({"hidden_states": changed}) is None, name
    del tensor, changed
    gc.collect()
    assert len(ready) == 0  # each tensor's death forgot it: its id may name another object now


def ready_puts(producer):  # the connector's ReadyPuts: which of its empty() tensors are laid out
    node = getattr(producer, "_node", producer)  # Mooncake TE keeps its outputs in its node
    return node._outputs._ready if hasattr(node, "_outputs") else node._pool.ready


@pytest.mark.parametrize("change", list(IN_PLACE))
@pytest.mark.parametrize("pair", ["zmq_pair", "te_pair"])
def test_a_laid_out_put_sends_what_the_tensor_is_at_the_put(
    pair: str, change: str, request: pytest.FixtureRequest
) -> None:
    """Once an output of a kind was put alone, the next one is laid out for the same put at empty();
    a tensor changed in place since still arrives exactly as it is, and one under another key too."""
    producer, consumer = request.getfixturevalue(pair)
    shape = (1024, 1024)
    first = filled(producer, shape, seed=8)
    _, _, metadata = producer.put("a", "b", "ready/0", {"hidden_states": first})
    assert torch.equal(consumer.get("a", "b", "ready/0", metadata)[0]["hidden_states"], first)
    laid_out = ready_puts(producer)
    before = len(laid_out)  # tensors of earlier tests may still be alive (the fixture is the module's)
    as_laid_out = filled(producer, shape, seed=9)  # laid out for {"hidden_states": ...} at empty()
    assert len(laid_out) == before + 1, "the second empty() of the kind was not laid out for the put"
    _, _, metadata = producer.put("a", "b", "ready/1", {"hidden_states": as_laid_out})
    assert torch.equal(consumer.get("a", "b", "ready/1", metadata)[0]["hidden_states"], as_laid_out)
    renamed = filled(producer, shape, seed=10)
    _, _, metadata = producer.put("a", "b", "ready/2", {"thinker_states": renamed})
    assert torch.equal(consumer.get("a", "b", "ready/2", metadata)[0]["thinker_states"], renamed)
    before = len(laid_out)
    changed = filled(producer, shape, seed=11)
    assert len(laid_out) == before + 1  # it too was laid out: only the check at the put sends it elsewhere
    IN_PLACE[change](changed)
    _, _, metadata = producer.put("a", "b", "ready/3", {"hidden_states": changed})
    got = consumer.get("a", "b", "ready/3", metadata)[0]["hidden_states"]
    assert got.dtype == changed.dtype and got.shape == changed.shape and torch.equal(got, changed)
    assert consumer.health()["errors"] == 0
    del got, first, as_laid_out, renamed, changed
    gc.collect()


# ------------------------------------------------------------------ ctx.empty in a stage


def test_demo_thinker_sends_its_hidden_states_without_a_copy(tmp_path: Path) -> None:
    with running_mesh(tmp_path, DEMO, sig=signal.SIGINT) as mesh:
        body = mesh.ok({"prompt": "Hello, zero copy!"}, params={"max_tokens": 32})
        assert "Hello, zero copy!" in body["outputs"]["text"] and body["outputs"]["duration_s"] > 0
        # The replica reports its connectors' health with its heartbeats: wait for one after the request.
        sent = wait_for(
            lambda: max(h.get("zero_copy_leaves", 0) for h in mesh.connector_health("thinker").values()) or None,
            timeout_s=15,
            what="the thinker's connector health to count a zero-copy leaf",
        )
        assert sent >= 1
