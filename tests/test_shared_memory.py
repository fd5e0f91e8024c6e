"""SharedMemoryConnector: every payload kind through the inline, pool and fallback paths, in one process
and across processes; slot release, stale/foreign/malformed metadata, /dev/shm hygiene and reaping.

The consumer on the far side is tests/support/shm_consumer.py, a real separate process; metadata reaches it as
msgpack through a pipe, as it would over the control plane.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from support.meshkit import wait_until
from support.shm_kit import ShmPeer as Peer
from support.shm_kit import connector, our_segments

from omni_mesh import codec
from omni_mesh.connectors import (
    ConnectorConfigError,
    ConnectorError,
    ConnectorFull,
    available_connectors,
    create_connector,
)
from omni_mesh.connectors.pools.allocator import PoolAllocator, round_up
from omni_mesh.connectors.shared_memory import SharedMemoryConnector
from omni_mesh.connectors.shm import segments as shm_segments
from omni_mesh.connectors.shm.segments import (
    ProcessIdentity,
    list_segments,
    owner_of,
    reap_orphaned_segments,
    segment_name,
    shm_dir,
)
from omni_mesh.hostinfo import process_gone

KiB, MiB = 1024, 1024 * 1024
PATHS = {
    "inline": {"inline_max_bytes": MiB, "max_pool_size": 1, "memory_pool_size": MiB},
    "pool": {"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 4 * MiB},
    "fallback": {"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 0},
}

# --------------------------------------------------------------------------- helpers


def payload_kinds() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32 tensor": torch.randn(16, 16, generator=gen),
        "bf16 tensor": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
        "0-d tensor": torch.tensor(2.5),
        "empty tensor": torch.empty(0, 4),
        "non-contiguous tensor": torch.arange(60.0).reshape(6, 10)[::2, 1::3],
        "expanded tensor": torch.arange(4).reshape(1, 4).expand(3, 4),
        "float8 tensor": torch.arange(16, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "bool tensor": torch.tensor([True, False, True]),
        "complex tensor": torch.randn(5, dtype=torch.complex64, generator=gen),
        "large tensor": torch.arange(200_000, dtype=torch.float32),  # 0.8 MB: inline fits 1 MiB
        "big-endian array": np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2],
        "float16 array": np.linspace(0, 1, 7, dtype=np.float16),
        "str array": np.array(["a", "bcd"]),
        "numpy scalar": np.float16(1.5),
        "small bytes": b"\x00\x01" * 10,
        "large bytes": bytes(range(256)) * 8,
        "bytearray": bytearray(b"xyz" * 300),
        "memoryview": memoryview(b"m" * 700),
        "str": "héllo ✓",
        "int": 2**64 - 1,
        "negative int": -(2**63),
        "float nan": math.nan,
        "bool": True,
        "none": None,
        "nested": {"t": (1, (torch.ones(2, 3), "x")), 7: [np.zeros(3), b"q" * 600], (1, 2): {"deep": [None]}},
        # vllm-omni's serializer types: a dataclass arrives as the dict of its fields
        "set": {1, "two", (3, None), b"s" * 600},
        "frozenset": frozenset({2.5, frozenset({"x"}), b"f"}),
        "slice": slice(1, None, -1),
        "dataclass": Chunk(torch.arange(6).reshape(2, 3), {"step": 1}, slice(0, 4)),
        "PIL image": Image.frombytes("RGB", (5, 3), bytes(range(45))),  # Pillow copies RGB at decode
        "PIL image view": Image.frombytes("L", (300, 200), bytes(range(200)) * 300),  # a view over the slot
    }


@dataclasses.dataclass
class Chunk:
    tokens: torch.Tensor
    meta: dict
    window: slice


def expected(value: Any) -> Any:
    """What a get must return for `value` (the codec's own round trip is checked in test_codec.py)."""
    return codec.decode(codec.encode(value), copy=True)


def assert_same(got: Any, want: Any, path: str = "payload") -> None:
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), path
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), path
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert type(got) is float and math.isnan(got), path
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


def holds_views(value: Any) -> bool:
    """Does a decoded payload keep its slot (through a non-empty tensor or array view)?"""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.nbytes > 0
    if isinstance(value, Image.Image):  # Pillow maps these modes over the frame, copies the others
        mapped = ("L", "P", "RGBA", "RGBX", "CMYK", "I;16", "I;16L", "I;16B")
        return value.mode in mapped and value.width * value.height > 0
    if isinstance(value, dict):
        return any(holds_views(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_views(v) for v in value)
    return False


def over_the_wire(metadata: dict | None) -> dict | None:
    """Metadata as the far side gets it: it must survive msgpack, and stay small."""
    packed = msgpack.packb(metadata, use_bin_type=True)
    if metadata is not None and "inline" not in metadata and "frame" not in metadata:
        assert len(packed) < 200
    return msgpack.unpackb(packed, raw=False)


def parts_size(value: Any) -> int:
    """What an inline put reports: the header plus its leaves (tiny payloads skip the frame layout)."""
    header, _, lengths = codec.split(value)
    return len(header) + sum(lengths)


def assert_path(metadata: dict, path: str) -> None:
    if path == "inline":  # the frame in the metadata (and a pool copy once gets by key are seen), or parts
        assert {"frame", "key"} <= set(metadata) or set(metadata) == {"inline", "parts", "key"}
    elif path == "pool":
        assert "_x" not in metadata["segment"], metadata
    else:
        assert "_x" in metadata["segment"], metadata


pytestmark = pytest.mark.usefixtures("no_segment_left")  # tests/conftest.py


@pytest.fixture(scope="module")
def consumer() -> Iterator[Peer]:
    peer = Peer()
    yield peer
    peer.stop()


# --------------------------------------------------------------------------- in one process


@pytest.mark.parametrize("path", PATHS)
def test_every_kind_in_process(path: str) -> None:
    with connector(PATHS[path]) as conn:
        for name, value in payload_kinds().items():
            ok, size, metadata = conn.put("a", "b", f"req/{name}", value)
            inline_size = len(metadata["frame"]) if "frame" in metadata else parts_size(value)
            assert ok and size == (inline_size if path == "inline" else codec.plan(value).nbytes)
            assert_path(metadata, path)
            data, got_size = conn.get("a", "b", f"req/{name}", over_the_wire(metadata))
            assert got_size == size
            assert_same(data, expected(value), name)
        health = conn.health()
        kinds = len(payload_kinds())
        assert health["puts"] == health["gets"] == kinds
        assert health["inline_puts"] == (kinds if path == "inline" else 0)
        assert health["fallbacks"] == (kinds if path == "fallback" else 0)


def test_views_are_writable() -> None:
    for path in PATHS:
        with connector(PATHS[path]) as conn:
            _, _, metadata = conn.put("a", "b", "k", {"t": torch.zeros(1000), "a": np.zeros(3)})
            data, _ = conn.get("a", "b", "k", over_the_wire(metadata))
            data["t"] += 1
            data["a"] += 1
            assert data["t"].sum().item() == 1000 and data["a"].sum() == 3
            del data


def test_copy_on_get_releases_the_slot_at_once() -> None:
    with connector({**PATHS["pool"], "copy_on_get": True}) as conn:
        value = torch.arange(50_000, dtype=torch.int32)
        _, _, metadata = conn.put("a", "b", "k1", value)
        data, _ = conn.get("a", "b", "k1", metadata)
        in_use = conn.health()["pool_in_use"]
        conn.put("a", "b", "k2", value + 1)  # reclaims k1's slot although `data` is alive
        assert conn.health()["live_payloads"] == 1
        assert conn.health()["pool_in_use"] <= in_use + 4096  # frames differ only in page padding
        assert_same(data, value)
        conn.cleanup("k2")


def test_slot_is_released_when_the_views_die() -> None:
    with connector(PATHS["pool"]) as conn:
        value = {"t": torch.ones(100_000), "a": np.ones(1000)}
        _, _, metadata = conn.put("a", "b", "k1", value)
        data, _ = conn.get("a", "b", "k1", metadata)
        view = data["t"][10:20]  # a view of a view keeps the slot too
        in_use = conn.health()["pool_in_use"]
        del data
        gc.collect()
        conn.put("a", "b", "k2", b"x" * 100)
        assert conn.health()["live_payloads"] == 2  # k1 is still held through `view`
        assert view.sum().item() == 10
        del view
        gc.collect()
        conn.put("a", "b", "k3", b"x" * 100)
        assert conn.health()["live_payloads"] == 2  # k1 freed; k2 and k3 never consumed
        assert conn.health()["pool_in_use"] < in_use
        conn.cleanup("k2")
        conn.cleanup("k3")
        assert conn.health()["live_payloads"] == 0 and conn.health()["pool_in_use"] == 0


# --------------------------------------------------------------------------- across processes


@pytest.mark.parametrize("path", PATHS)
def test_every_kind_across_processes(consumer: Peer, path: str) -> None:
    kinds = payload_kinds()
    with connector(PATHS[path]) as conn:
        for name, value in kinds.items():
            _ok, size, metadata = conn.put("a", "b", f"req/{name}", value)
            assert_path(metadata, path)
            reply = consumer.call(
                "get", from_stage="a", to_stage="b", get_key=f"req/{name}", metadata=metadata, hold=name
            )
            assert reply["size"] == size, reply
            assert_same(codec.decode(reply["frame"]), expected(value), name)
        # The consumer's views pin their slots: new puts go elsewhere and the held data stays intact.
        for i in range(8):
            conn.put("a", "b", f"churn/{i}", torch.full((100_000,), float(i)))
        for name, value in kinds.items():
            assert_same(codec.decode(consumer.call("check", hold=name)["frame"]), expected(value), name)
        conn.cleanup("churn")
        pinned = [name for name, value in kinds.items() if holds_views(expected(value))]
        assert conn.health()["live_payloads"] == (0 if path == "inline" else len(pinned))
        for name in kinds:
            consumer.call("drop", hold=name)
        conn.put("a", "b", "probe", b"p" * 5000)  # the next put reclaims every released slot
        # the probe; a tiny one only in its metadata, as no get by key flagged this pool
        assert conn.health()["live_payloads"] == (0 if path == "inline" else 1)
        conn.cleanup("probe")
        assert conn.health()["pool_in_use"] == 0
        assert [name for name in our_segments() if "_x" in name] == []


def test_consumer_views_outlive_the_producer(consumer: Peer) -> None:
    conn = connector(PATHS["pool"])
    value = torch.arange(10_000, dtype=torch.float64)
    _, _, metadata = conn.put("a", "b", "k", value)
    assert_same(consumer.get("k", metadata, hold="k"), value)
    conn.close()  # unlinks the pool; the consumer's mapping keeps its views valid
    assert our_segments() == {}
    assert_same(codec.decode(consumer.call("check", hold="k")["frame"]), value)
    consumer.call("drop", hold="k")
    gone = metadata["segment"]
    assert any(gone in path for path in consumer.call("maps")["maps"])  # still cached by the consumer
    with connector(PATHS["pool"]) as restarted:  # e.g. the producer's replica restarts
        _, _, metadata = restarted.put("a", "b", "k", value)
        assert_same(consumer.get("k", metadata), value)
        assert not any(gone in path for path in consumer.call("maps")["maps"])  # the dead pool is unmapped


def test_stale_and_foreign_metadata_across_processes(consumer: Peer) -> None:
    stale_before = consumer.call("health")["stale_gets"]
    with connector(PATHS["pool"]) as conn:
        value = torch.arange(1000)
        _, _, meta1 = conn.put("a", "b", "req1", value)
        for key, edge in [("req2", ("a", "b")), ("req1", ("a", "c")), ("req1", ("x", "b"))]:
            assert consumer.get(key, meta1, edge=edge) is None  # foreign: never another request's data
        assert_same(consumer.get("req1", meta1), value)  # and the foreign gets did not take it
        assert consumer.get("req1", meta1) is None  # consumed
        _, _, meta2 = conn.put("a", "b", "req2", value + 1)
        assert (meta2["segment"], meta2["offset"]) == (meta1["segment"], meta1["offset"])  # reused
        assert consumer.get("req1", meta1) is None  # stale
        assert_same(consumer.get("req2", meta2), value + 1)
        assert consumer.call("health")["stale_gets"] - stale_before == 5


def test_fallback_payload_across_processes_is_unmapped_after_use(consumer: Peer) -> None:
    with connector(PATHS["fallback"]) as conn:
        maps_before = set(consumer.call("maps")["maps"])
        for i in range(20):
            value = torch.full((20_000,), float(i))
            _, _, metadata = conn.put("a", "b", f"r/{i}", value)
            assert_same(consumer.get(f"r/{i}", metadata), value)
        conn.cleanup("r")
        assert [name for name in our_segments() if "_x" in name] == []
        leftover = set(consumer.call("maps")["maps"]) - maps_before
        assert leftover == set(), f"the consumer still maps {len(leftover)} fallback segments"


def test_no_shm_growth_after_1000_pairs_across_processes(consumer: Peer) -> None:
    pool = 256 * KiB
    payloads = [
        b"inline",
        torch.arange(4000, dtype=torch.float32),  # 16 KB: the pool
        torch.arange(80_000, dtype=torch.float32),  # 320 KB: larger than the pool, so a fallback segment
        {"mixed": [np.arange(100), (torch.ones(3, 3), "s")]},
    ]
    with connector({"inline_max_bytes": 1024, "max_pool_size": 1, "memory_pool_size": pool}) as conn:

        def rounds(start: int, count: int) -> None:
            for i in range(start, start + count):
                _, size, metadata = conn.put("a", "b", f"r/{i}", payloads[i % len(payloads)])
                reply = consumer.call(
                    "get", from_stage="a", to_stage="b", get_key=f"r/{i}", metadata=metadata, summary=True
                )
                assert reply.get("size") == size, reply

        rounds(0, 40)
        conn.cleanup("r")
        segments, maps = our_segments(), set(consumer.call("maps")["maps"])
        rounds(40, 1000)
        conn.cleanup("r")
        assert our_segments() == segments  # the same pool segment, the same size: nothing grew
        assert len(segments) == 1
        assert set(consumer.call("maps")["maps"]) <= maps
        health = conn.health()
        assert health["puts"] == 1040 and health["live_payloads"] == 0 and health["pool_in_use"] == 0
        inline = sum(parts_size(p) <= 1024 for p in payloads)
        assert health["inline_puts"] == 260 * inline and health["fallbacks"] == 260


def test_no_shm_growth_after_1000_pairs_in_process() -> None:
    with connector({"inline_max_bytes": 1024, "max_pool_size": 1, "memory_pool_size": 256 * KiB}) as conn:
        payloads = [b"tiny", torch.ones(4000), torch.ones(80_000), np.arange(3000)]

        def rounds(start: int, count: int) -> None:
            for i in range(start, start + count):
                value = payloads[i % len(payloads)]
                _, _, metadata = conn.put("a", "b", f"r/{i}", value)
                data, _ = conn.get("a", "b", f"r/{i}", over_the_wire(metadata))
                if i % 97 == 0:
                    assert_same(data, expected(value))

        rounds(0, 40)
        conn.cleanup("r")
        segments = our_segments()
        rounds(40, 1000)
        conn.cleanup("r")
        assert our_segments() == segments and len(segments) == 1
        assert conn.health()["live_payloads"] == 0 and conn.health()["pool_in_use"] == 0


def test_fallback_only_producer_unlinks_consumed_segments() -> None:
    # Every payload is larger than the pool: the pool is never the target, yet released segments
    # must still be unlinked by the next put, not pile up in /dev/shm until cleanup() or close().
    with connector(PATHS["fallback"]) as conn:
        for i in range(50):
            value = torch.full((5000,), i)
            _, _, metadata = conn.put("a", "b", f"r/{i}", value)
            assert_same(conn.get("a", "b", f"r/{i}", metadata)[0], value)
            fallbacks = [name for name in our_segments() if "_x" in name]
            assert len(fallbacks) == 1, fallbacks  # the one just consumed; the put unlinked its predecessor
        assert conn.health()["fallbacks"] == 50


# --------------------------------------------------------------------------- cleanup and close


def test_cleanup_and_close_free_what_was_never_consumed() -> None:
    conn = connector({"inline_max_bytes": 64, "max_pool_size": 1, "memory_pool_size": 256 * KiB})
    for i in range(5):
        conn.put("a", "b", f"req/{i}", torch.ones(1000))  # pool
        conn.put("a", "b", f"req/{i}/big", torch.ones(100_000))  # fallback
        conn.put("a", "b", f"other/{i}", torch.ones(100_000))
    assert len(our_segments()) == 1 + 10
    conn.cleanup("req")
    assert len(our_segments()) == 1 + 5
    assert conn.health()["live_payloads"] == 5
    conn.close()
    conn.close()  # idempotent
    assert our_segments() == {}
    assert conn.health()["status"] == "unhealthy"
    assert conn.put("a", "b", "late", torch.ones(100_000)) == (False, 0, None)
    with pytest.raises(ConnectorError, match="closed"):
        conn.put_or_raise("a", "b", "late", torch.ones(100_000))


def test_cleanup_matches_whole_key_segments() -> None:
    with connector({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 64 * KiB}) as conn:
        metas = {}
        for key in ["req1", "req1/0", "req1/1", "req1/0/x", "req10/0", "req1x", "req"]:
            metas[key] = conn.put("a", "b", key, {"key": key, "t": torch.ones(5000)})[2]  # some fall back
        conn.cleanup("req1")
        for key in ["req1", "req1/0", "req1/1", "req1/0/x"]:
            assert conn.get("a", "b", key, metas[key]) is None, key
        for key in ["req10/0", "req1x", "req"]:
            assert conn.get("a", "b", key, metas[key])[0]["key"] == key


def test_cleanup_keeps_payloads_a_consumer_holds(consumer: Peer) -> None:
    with connector(PATHS["pool"]) as conn:
        value = torch.arange(5000)
        _, _, metadata = conn.put("a", "b", "req/0", value)
        assert_same(consumer.get("req/0", metadata, hold="h"), value)
        conn.cleanup("req")
        conn.put("a", "b", "other", torch.zeros(5000))  # must not land on the held slot
        assert_same(codec.decode(consumer.call("check", hold="h")["frame"]), value)
        consumer.call("drop", hold="h")
        conn.cleanup("req")
        conn.cleanup("other")
        assert conn.health()["live_payloads"] == 0


def test_close_with_views_alive_keeps_them_valid() -> None:
    conn = connector(PATHS["pool"])
    value = torch.arange(20_000)
    _, _, metadata = conn.put("a", "b", "k", value)
    data, _ = conn.get("a", "b", "k", metadata)
    conn.close()
    assert our_segments() == {}
    assert_same(data, value)
    del data
    gc.collect()


def test_forked_child_does_not_unlink_the_parents_segments() -> None:
    conn = connector(PATHS["pool"])
    _, _, metadata = conn.put("a", "b", "k", torch.ones(1000))
    pid = os.fork()
    if pid == 0:  # the child drops its inherited copy, as any exiting process may
        code = 1
        try:
            conn.close()
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert metadata["segment"] in list_segments()
    with connector() as other:  # a connector that is not the producer maps the segment by name
        assert_same(other.get("a", "b", "k", metadata)[0], torch.ones(1000))
    conn.close()


# --------------------------------------------------------------------------- metadata checks


def test_stale_and_foreign_metadata_in_process() -> None:
    for path in ("pool", "fallback"):
        with connector(PATHS[path]) as conn:
            value = torch.arange(3000)
            _, _, meta1 = conn.put("a", "b", "req1", value)
            assert conn.get("a", "b", "req2", meta1) is None
            assert conn.get("a", "c", "req1", meta1) is None
            assert conn.get("z", "b", "req1", meta1) is None
            data, _ = conn.get("a", "b", "req1", meta1)
            assert_same(data, value)
            assert conn.get("a", "b", "req1", meta1) is None  # taken
            del data
            gc.collect()
            assert conn.get("a", "b", "req1", meta1) is None  # released
            _, _, meta2 = conn.put("a", "b", "req2", value * 2)
            assert conn.get("a", "b", "req1", meta1) is None  # reclaimed and maybe reused
            assert_same(conn.get("a", "b", "req2", meta2)[0], value * 2)
            assert conn.health()["stale_gets"] == 6


def _malformed(valid: dict) -> dict[str, Any]:
    return {
        "segment is an int": {**valid, "segment": 5},
        "segment is bytes": {**valid, "segment": valid["segment"].encode()},
        "offset is a str": {**valid, "offset": "0"},
        "offset is negative": {**valid, "offset": -64},
        "offset is a bool": {**valid, "offset": True},
        "offset is a float": {**valid, "offset": 64.0},
        "generation is None": {**valid, "generation": None},
        "length is a list": {**valid, "length": [1]},
        "offset is huge": {**valid, "offset": 2**70},
        "offset past the end": {**valid, "offset": 2**40},
        "offset inside the slot": {**valid, "offset": valid["offset"] + 8},
        "length is huge": {**valid, "length": 2**63},
        "length is off by one": {**valid, "length": valid["length"] + 1},
        "generation is wrong": {**valid, "generation": valid["generation"] + 1},
        "generation is zero": {**valid, "generation": 0},
        "segment escapes /dev/shm": {**valid, "segment": "../etc/passwd"},
        "segment is a path": {**valid, "segment": f"/dev/shm/{valid['segment']}"},
        "segment is empty": {**valid, "segment": ""},
        "segment has a NUL": {**valid, "segment": valid["segment"] + "\x00"},
        "segment has a newline": {**valid, "segment": valid["segment"] + "\n"},
        "segment does not exist": {**valid, "segment": "omnimesh_1_2_3_abcdefabcdef"},
        "segment of a fallback that never was": {**valid, "segment": valid["segment"] + "_x999"},
        "inline is an int": {"inline": 5, "key": INLINE_KEY},
        "inline is a str": {"inline": "not a frame", "key": INLINE_KEY},
        "inline is garbage": {"inline": b"\x00" * 100, "key": INLINE_KEY},
        "inline is a hostile frame": {
            "inline": struct.pack("<4sHHIIQ", b"OMF1", 1, 0, 2**32 - 1, 0, 48) + bytes(24),
            "key": INLINE_KEY,
        },
        "inline is a list": {"inline": [1, 2], "key": INLINE_KEY},
        "inline without its key": {"inline": codec.encode("x")},
        "inline of another key": {"inline": codec.encode("x"), "key": "a->b/other"},
    }


INLINE_KEY = "a->b/k"  # the edge key inline metadata of ("a", "b", "k") carries


def test_malformed_metadata_is_refused_or_ignored() -> None:
    with connector(PATHS["pool"]) as conn:
        value = torch.arange(2000)
        _, _, valid = conn.put("a", "b", "k", value)
        for name, metadata in _malformed(valid).items():
            try:
                result = conn.get("a", "b", "k", metadata)
            except ConnectorError as exc:
                assert "SharedMemoryConnector" in str(exc), name
            else:
                assert result is None, f"{name}: {result!r}"
        assert conn.health()["errors"] >= 3  # the bad inline frames
        assert_same(conn.get("a", "b", "k", valid)[0], value)  # nothing above took the payload


def test_malformed_metadata_across_processes(consumer: Peer) -> None:
    with connector(PATHS["pool"]) as conn:
        value = torch.arange(2000)
        _, _, valid = conn.put("a", "b", "k", value)
        for name, metadata in _malformed(valid).items():
            try:
                msgpack.packb(metadata)
            except OverflowError:
                continue  # cannot travel over the control plane at all
            reply = consumer.call("get", from_stage="a", to_stage="b", get_key="k", metadata=metadata)
            assert reply.get("none") or reply.get("error") == "ConnectorError", f"{name}: {reply}"
        assert_same(consumer.get("k", valid), value)


# --------------------------------------------------------------------------- segments


def test_segments_are_private_to_their_user() -> None:
    with connector({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 64 * KiB}) as conn:
        conn.put("a", "b", "pool", torch.ones(10))
        conn.put("a", "b", "fallback", torch.ones(100_000))
        names = list(our_segments())
        assert len(names) == 2 and any("_x" in n for n in names)
        for name in names:
            assert stat.S_IMODE((shm_dir() / name).stat().st_mode) == 0o600, name
            assert owner_of(name) == ProcessIdentity.current()


def test_killed_producer_is_reaped_and_live_ones_are_not() -> None:
    producer = Peer({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 256 * KiB})
    try:
        value = torch.arange(1000, dtype=torch.int64)
        pool_put = producer.call(
            "put", from_stage="a", to_stage="b", put_key="k", frame=bytes(codec.encode(value))
        )
        producer.call(
            "put", from_stage="a", to_stage="b", put_key="big", frame=bytes(codec.encode(torch.ones(100_000)))
        )
        names = sorted(n for n in list_segments() if owner_of(n) and owner_of(n).pid == producer.pid)
        assert len(names) == 2
        assert reap_orphaned_segments(pid=producer.pid) == []  # alive: left alone
        with connector(PATHS["pool"]) as conn:
            data, _ = conn.get("a", "b", "k", pool_put["metadata"])  # views over the producer's pool
            conn.put("a", "b", "mine", torch.ones(100))
            mine = list(our_segments().keys() - set(names))
            producer.kill()
            assert sorted(n for n in list_segments() if n in names) == names  # SIGKILL leaves them
            assert reap_orphaned_segments(pid=os.getpid()) == []
            assert sorted(reap_orphaned_segments(pid=producer.pid)) == names
            assert not set(names) & set(list_segments())
            assert set(mine) <= set(list_segments())
            assert_same(data, value)  # the mapping outlives the unlinked segment
            del data
    finally:
        producer.kill()


def test_reaper_tells_reused_pids_and_other_namespaces_apart() -> None:
    me = ProcessIdentity.current()
    reused = segment_name(ProcessIdentity(me.pidns, me.pid, me.start + 1), "ab" * 6)  # same pid, other start
    elsewhere = segment_name(ProcessIdentity(me.pidns + 1, 1, 1), "cd" * 6)  # another PID namespace
    alive = segment_name(me, "ef" * 6)
    try:
        for name in (reused, elsewhere, alive):
            shm_segments.create_segment(name, 4096, populate=False).close()
        assert reap_orphaned_segments(pid=me.pid) == [reused]
        assert reap_orphaned_segments(pid=1) == []
        assert {elsewhere, alive} <= set(list_segments())
    finally:
        for name in (reused, elsewhere, alive):
            shm_segments.unlink_segment(name)


def test_full_shm_is_a_clear_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    # tmpfs grows on write: without reserving the pages up front, a full /dev/shm shows up as SIGBUS
    # inside a memcpy. Simulate ENOSPC where the space is reserved.
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    with connector({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 64 * KiB}) as conn:
        conn.put("a", "b", "ok", torch.ones(10))
        monkeypatch.setattr(shm_segments.os, "posix_fallocate", no_space)
        with pytest.raises(ConnectorFull, match="shm"):  # room may come: the front door's 503
            conn.put_or_raise("a", "b", "big", torch.ones(100_000))
        assert len(our_segments()) == 1  # no half-made segment left
        assert conn.health()["errors"] == 1
        assert conn.put("a", "b", "big2", torch.ones(100_000)) == (False, 0, None)
    with connector({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": 64 * KiB}) as conn:
        assert conn.put("a", "b", "first", torch.ones(10)) == (False, 0, None)  # the pool cannot be made
        with pytest.raises(ConnectorFull, match="shm"):
            conn.put_or_raise("a", "b", "second", torch.ones(10))


# --------------------------------------------------------------------------- config, registry, health


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConnectorConfigError, match="memory_pool_sise"):
        create_connector("SharedMemoryConnector", {"memory_pool_sise": 1})
    with pytest.raises(ConnectorConfigError, match="copy_on_get"):
        create_connector("SharedMemoryConnector", {"copy_on_get": "yes"})
    with pytest.raises(ConnectorConfigError, match="memory_pool_size"):
        create_connector("SharedMemoryConnector", {"max_pool_size": 1, "memory_pool_size": "lots"})
    with connector({"max_pool_size": 1, "memory_pool_size": "1MiB", "inline_max_bytes": "2 KiB"}) as conn:
        assert conn.config.memory_pool_size == MiB and conn.config.inline_max_bytes == 2048


def test_unknown_connector_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match="Nope") as info:
        create_connector("Nope")
    assert "SharedMemoryConnector" in str(info.value)
    assert "SharedMemoryConnector" in available_connectors()


def test_health_counters() -> None:
    with connector({"inline_max_bytes": 256, "max_pool_size": 1, "memory_pool_size": 64 * KiB}) as conn:
        assert conn.health()["status"] == "healthy" and conn.health()["puts"] == 0
        _, s1, m1 = conn.put("a", "b", "inline", "tiny")
        _, s2, m2 = conn.put("a", "b", "pool", torch.ones(1000))
        _, s3, m3 = conn.put("a", "b", "fallback", torch.ones(100_000))
        health = conn.health()
        assert health["puts"] == 3 and health["bytes_put"] == s1 + s2 + s3
        assert health["inline_puts"] == 1 and health["fallbacks"] == 1
        assert health["pool_size"] == 64 * KiB and 0 < health["pool_in_use"] < 8 * KiB
        assert health["live_payloads"] == 2  # the tiny one is in its metadata only: no get by key yet
        for key, metadata in [("inline", m1), ("pool", m2), ("fallback", m3)]:
            assert conn.get("a", "b", key, metadata) is not None
        assert conn.get("a", "b", "pool", m2) is None
        with pytest.raises(ConnectorError):
            conn.get("a", "b", "x", {"inline": b"junk", "key": "a->b/x"})
        health = conn.health()
        assert health["gets"] == 3 and health["bytes_got"] == s1 + s2 + s3
        assert health["stale_gets"] == 1 and health["errors"] == 1
        conn.put("a", "b", "fill", torch.ones(15_000))  # 60 KB of a 64 KiB pool
        assert conn.health()["status"] == "degraded"
        conn.cleanup("fill")
        assert conn.health()["status"] == "healthy"


def test_unsupported_payload_allocates_nothing() -> None:
    with connector(PATHS["pool"]) as conn:
        with pytest.raises(ConnectorError, match=r"payload\['x'\]"):  # sets are carried now
            conn.put_or_raise("a", "b", "k", {"x": object()})
        assert conn.health()["live_payloads"] == 0 and conn.health()["puts"] == 0


# --------------------------------------------------------------------------- allocator


@settings(deadline=None, max_examples=150)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6000), st.integers(0, 1000)), max_size=80))
def test_pool_allocator_never_overlaps_and_coalesces(ops: list[tuple[bool, int, int]]) -> None:
    size, start = 64 * KiB, 64
    allocator = PoolAllocator(size, start=start)
    live: dict[int, int] = {}
    for allocate, nbytes, pick in ops:
        if allocate or not live:
            offset = allocator.allocate(nbytes)
            need = round_up(max(nbytes, 1))
            if offset is None:
                assert allocator.largest_free < need  # first fit fails only when nothing fits
                continue
            assert offset % 64 == 0 and start <= offset and offset + need <= size
            assert all(offset + need <= o or o + n <= offset for o, n in live.items())
            live[offset] = need
        else:
            offset = sorted(live)[pick % len(live)]
            allocator.free(offset)
            del live[offset]
        assert allocator.in_use == sum(live.values())
        assert all(o in allocator for o in live)
    for offset in list(live):
        allocator.free(offset)
    assert allocator.in_use == 0 and allocator.largest_free == size - start  # one extent again


# --------------------------------------------------------------------------- threads


def test_threads_put_and_get_concurrently() -> None:
    errors: list[BaseException] = []
    with connector({"inline_max_bytes": 512, "max_pool_size": 1, "memory_pool_size": 512 * KiB}) as conn:

        def worker(tid: int) -> None:
            try:
                held = []
                for i in range(60):
                    size = (10, 3000, 40_000, 150_000)[(tid + i) % 4]  # inline, pool, pool, fallback
                    value = torch.full((size,), tid * 1000 + i, dtype=torch.int32)
                    key = f"t{tid}/{i}"
                    _, _, metadata = conn.put("a", "b", key, value)
                    data, _ = conn.get("a", "b", key, over_the_wire(metadata))
                    assert torch.equal(data, value), key
                    held.append((data, value))
                    if len(held) > 3:  # keep a few views alive while others put
                        old, want = held.pop(0)
                        assert torch.equal(old, want)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(tid,)) for tid in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors[0]
        gc.collect()
        conn.put("a", "b", "last", torch.ones(3000))
        health = conn.health()
        # A get by key anywhere on the host (another test's) has this pool copy tiny puts in for it.
        assert health["live_payloads"] - health["tiny_copies"] == 1, health
        conn.cleanup("last")


def test_a_put_in_progress_is_never_reclaimed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another thread's put may run while this one copies its frame (memcpy releases the GIL). Freshly
    # allocated pool space holds stale bytes of older frames; none of them may pass for a slot state.
    with connector({"inline_max_bytes": 0, "max_pool_size": 1, "memory_pool_size": MiB}) as conn:
        released_byte = 3  # the state byte value of a released slot
        filler = torch.full((MiB - 16 * KiB,), released_byte, dtype=torch.uint8)
        conn.put("a", "b", "filler", filler)
        conn.cleanup("filler")  # frees the space; the released-looking bytes stay behind
        a1, a2, b = torch.full((8000,), 1), torch.full((8000,), 2), torch.full((8000,), 9)
        conn.put("a", "b", "a1", a1)
        original = codec.FramePlan.write_at
        interleave = []

        def write_then_let_another_put_run(self: codec.FramePlan, address: int) -> int:
            written = original(self, address)
            if interleave:
                interleave.pop()()
            return written

        monkeypatch.setattr(codec.FramePlan, "write_at", write_then_let_another_put_run)
        results = {}
        interleave.append(lambda: results.setdefault("b", conn.put("a", "b", "b", b)[2]))
        meta_a2 = conn.put("a", "b", "a2", a2)[2]
        assert_same(conn.get("a", "b", "a2", meta_a2)[0], a2)
        assert_same(conn.get("a", "b", "b", results["b"])[0], b)


def test_a_released_slot_is_refilled_by_the_next_put_of_its_size() -> None:
    """Steady streams reuse the slot the consumer just released; its old metadata then reads as stale."""
    with connector(PATHS["pool"]) as conn:
        first, second, other = torch.arange(5000), torch.arange(5000) * 3, torch.arange(7000)
        _, _, meta1 = conn.put("a", "b", "r1", first)
        data, _ = conn.get("a", "b", "r1", meta1)
        assert_same(data, first)
        del data
        gc.collect()
        in_use = conn.health()["pool_in_use"]
        _, _, meta2 = conn.put("a", "b", "r2", second)
        assert (meta2["segment"], meta2["offset"]) == (meta1["segment"], meta1["offset"])
        assert meta2["generation"] != meta1["generation"]
        assert conn.health()["pool_in_use"] == in_use  # refilled, not allocated anew
        assert conn.get("a", "b", "r1", meta1) is None
        assert_same(conn.get("a", "b", "r2", meta2)[0], second)
        gc.collect()
        _, _, meta3 = conn.put("a", "b", "r3", other)  # another size: freed and allocated as usual
        assert_same(conn.get("a", "b", "r3", meta3)[0], other)
        gc.collect()
        assert conn.health()["live_payloads"] == 0  # r3's views are gone: its slot waits released


def test_close_waits_for_a_put_that_is_copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts copy through the mapping's raw address: close() from another thread must not unmap under them."""
    conn = connector(PATHS["pool"])
    copying, closing = threading.Event(), threading.Event()
    original = codec.FramePlan.write_at

    def slow_write(self: codec.FramePlan, address: int) -> int:
        copying.set()
        closing.wait(5)
        time.sleep(0.2)  # close() is waiting by now; it must not have unmapped the pool
        return original(self, address)

    monkeypatch.setattr(codec.FramePlan, "write_at", slow_write)
    results: list[Any] = []
    writer = threading.Thread(target=lambda: results.append(conn.put("a", "b", "k", torch.arange(5000))))
    writer.start()
    assert copying.wait(5)
    closer = threading.Thread(target=conn.close)
    closer.start()
    closing.set()
    closer.join(10)
    writer.join(10)
    assert not closer.is_alive() and not writer.is_alive()
    assert results and results[0][0] is True
    with pytest.raises(ConnectorError, match="closed"):
        conn.put_or_raise("a", "b", "k2", torch.arange(5000))


class RecordingExport:
    """Stands in for a cuda_ipc.Exported on this CPU-only machine: records give-backs of its reference."""

    def __init__(self) -> None:
        self.released = 0
        self.tensor = torch.empty(0)

    def release_unmapped(self) -> None:
        self.released += 1


def put_with_exports(conn: SharedMemoryConnector, key: str, count: int = 2) -> tuple[dict, list[RecordingExport]]:
    exports = [RecordingExport() for _ in range(count)]
    frame = codec.plan({"host part": torch.arange(2000)})
    _, metadata = conn._put_with_exports("a", "b", key, frame, exports)  # type: ignore[arg-type]
    return metadata, exports


def test_a_payload_with_cuda_tensors_gives_their_references_back_unless_a_consumer_mapped_them() -> None:
    """The IPC reference counting of CUDA tensors (torch's) needs one give-back per export that no
    consumer mapped: freed unconsumed, closed, or taken by a consumer that died."""
    with connector(PATHS["pool"]) as conn:
        consumed_meta, consumed = put_with_exports(conn, "consumed")
        data, _ = conn.get("a", "b", "consumed", consumed_meta)
        del data
        gc.collect()
        _, unconsumed = put_with_exports(conn, "unconsumed")
        conn.cleanup("unconsumed")
        assert [e.released for e in unconsumed] == [1, 1]
        put_with_exports(conn, "next")  # reclaims (refills) the consumed slot: its consumer gives back
        assert [e.released for e in consumed] == [0, 0]
        assert conn.health()["cuda_ipc_tensors"] == 6
        _, at_close = put_with_exports(conn, "at close", count=1)
    assert [e.released for e in at_close] == [1]
    with connector(PATHS["pool"]) as conn:
        meta, taken_by_the_dead = put_with_exports(conn, "dead")
        peer = Peer()
        assert peer.get("dead", meta, hold="x") is not None
        peer.proc.kill()
        peer.proc.wait()
        # The reclaim acts on positive evidence only (/proc has no entry for the taker): wait for it,
        # as a sandboxed /proc may show a reaped process a moment longer.
        assert wait_until(lambda: process_gone(peer.pid), 10), f"/proc still lists the killed consumer {peer.pid}"
        states = [slot.segment.mm[slot.offset] for slot in conn._pool.slots.values()]
        conn.put("a", "b", "fill", torch.zeros((4 * MiB - 16 * KiB) // 4))  # the pool runs short: dead takers go
        assert [e.released for e in taken_by_the_dead] == [1, 1], f"slot states before the fill: {states}"
        conn.cleanup("fill")


def test_the_cuda_ipc_switch_changes_nothing_for_host_payloads() -> None:
    value = {"x": torch.arange(50_000), "y": np.ones(7)}
    for switch in (True, False):
        with connector({**PATHS["pool"], "cuda_ipc": switch}) as conn:
            _, _, metadata = conn.put("a", "b", "k", value)
            assert_same(conn.get("a", "b", "k", metadata)[0], value)
            assert conn.health()["cuda_ipc_tensors"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_cross_processes_by_ipc_handle() -> None:
    source = torch.randn(1 << 20, device="cuda")
    strided = torch.arange(4096, dtype=torch.float16, device="cuda").view(64, 64).t()
    value = {"big": source, "strided": strided, "host": torch.ones(5)}
    with connector(PATHS["pool"]) as conn:
        _, _, metadata = conn.put("a", "b", "cuda", value)
        peer = Peer()
        reply = peer.call("get", from_stage="a", to_stage="b", get_key="cuda", metadata=over_the_wire(metadata))
        assert reply.get("cuda_leaves") == 2, reply
        assert_same(codec.decode(reply["frame"]), {k: v.cpu() for k, v in value.items()})
        assert conn.health()["cuda_ipc_tensors"] == 2


def test_a_slot_taken_by_a_killed_consumer_can_be_taken_again() -> None:
    """The coordinator retries work whose replica died before producing output: the new replica must be
    able to get the input the dead one had taken. A live taker's slot stays refused."""
    value = torch.arange(50_000)
    with connector(PATHS["pool"]) as conn:
        _, _, metadata = conn.put("a", "b", "retry/0", value)
        first = Peer()
        try:
            assert_same(first.get("retry/0", metadata, hold="x"), value)
            second = Peer()
            try:
                assert second.get("retry/0", metadata) is None  # the first consumer is alive: taken
                first.kill()
                assert_same(second.get("retry/0", metadata), value)
            finally:
                second.stop()
        finally:
            if first.proc.poll() is None:
                first.kill()


def test_allocator_aligns_large_frames_and_frees_all_it_took() -> None:
    """allocate(align=PAGE, skew=h) puts offset + h on a page boundary; free returns the whole extent."""
    from omni_mesh.connectors.pools.allocator import PAGE, PoolAllocator

    allocator = PoolAllocator(1 << 20, start=64)
    small = allocator.allocate(100)
    offsets = [allocator.allocate(70_000, align=PAGE, skew=64) for _ in range(5)]
    assert small == 64 and all(o is not None and (o + 64) % PAGE == 0 for o in offsets)
    assert len(set(offsets)) == 5
    for offset in [small, *offsets]:
        allocator.free(offset)
    assert allocator.in_use == 0 and allocator.largest_free == (1 << 20) - 64


def test_a_planted_symlink_is_never_followed(tmp_path: Path) -> None:
    """Metadata naming a segment that is a symlink (to a file of someone else's) must not map that file."""
    from omni_mesh.connectors.shm.segments import shm_dir

    target = tmp_path / "secret"
    target.write_bytes(b"x" * 8192)
    name = "omnimesh_1_2_3_abcdefabcdef"
    (shm_dir() / name).symlink_to(target)
    try:
        with connector(PATHS["pool"]) as conn:
            metadata = {"segment": name, "offset": 0, "generation": 1, "length": 100}
            with pytest.raises(ConnectorError, match="cannot map"):
                conn.get("a", "b", "k", metadata)
    finally:
        (shm_dir() / name).unlink()
