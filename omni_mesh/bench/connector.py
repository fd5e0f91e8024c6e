"""`omni-mesh bench connector`: cross-process put -> get through one connector, against references.

The producer (this process) puts a dict holding one bfloat16 tensor and sends the metadata to a
consumer process over ZeroMQ; the consumer gets it and reports its timings back. For each size we
print medians of:

- put->get: the producer's put time plus the consumer's get time, i.e. the data plane's cost of moving
  the payload (the metadata hop belongs to the control plane and is shown separately as e2e);
- memcpy: copying the same number of bytes between two pre-faulted buffers in this process, measured
  in the same run, and the ratio put->get / memcpy bandwidth (with --device cuda the payload lives on
  the GPU and the reference is a device-to-device `copy_`; the consumer synchronizes before it stops
  its clock, so a get counts the work the device still had queued);
- raw: where a raw transport exists (Mooncake, ZeroMQ, Yuanrong), the same bytes moved with the raw
  library between two processes in the same run, and the ratio connector / raw.

The first transfer of each size is verified byte for byte (outside the timings).

The connector runs with its default config unless --config says otherwise (the bench does not size
its pool for the workload: users do not either). Each size also reports the producer pool's growth
and its fallbacks (one-off buffers), in all and after the first put of that size.

`--zero-copy` allocates each payload with `connector.empty()` (where the connector keeps memory) and
fills it outside the timings, as a handler computing its output into it would: the put of such a
tensor copies nothing. Connectors without a pool of their own give plain tensors there.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import msgpack
import torch

from omni_mesh import codec
from omni_mesh.bench.connector_report import SizeResult, summarize
from omni_mesh.bench.peer import PeerProcess, consumer_socket
from omni_mesh.connectors import connector_class, create_connector, parse_size
from omni_mesh.connectors.config.parse import parse_config
from omni_mesh.security import mesh_keys

DEFAULT_SIZES = ["4KiB", "1MiB", "16MiB", "256MiB"]
EDGE = ("producer", "consumer")

# Raw baselines by connector: "module:function(size, repeats, ...) -> list[seconds]".
RAW_BASELINES: dict[str, str] = {
    "MooncakeTransferEngineConnector": "omni_mesh.bench.raw_mooncake:transfer_engine_seconds",
    "MooncakeStoreConnector": "omni_mesh.bench.raw_mooncake:store_seconds",
    "ZmqConnector": "omni_mesh.bench.raw_zmq:zmq_seconds",
    "YuanrongConnector": "omni_mesh.bench.raw_yuanrong:kv_seconds",
}


def repeats_for(size: int) -> int:
    """Enough repetitions for a stable median on a noisy machine, without making 256 MiB take minutes."""
    floor = 8 if size >= 256 << 20 else 40
    return max(floor, min(200, (2 << 30) // max(size, 1) // 16))


def payload(size: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    return {"hidden_states": torch.randn(max(1, size // 2), generator=generator).to(torch.bfloat16).to(device)}


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def memcpy_seconds(size: int, repeats: int, device: str = "cpu") -> list[float]:
    """The reference: one memcpy (the codec's copy primitive) between two pre-faulted buffers, or on a
    CUDA device one device-to-device copy_, synchronized.

    The destination sits 64 bytes behind the source modulo 4096, the placement the codec gives large
    leaves. Two tensors allocated the plain way start at the same page offset, where 4K aliasing can
    slow memcpy (on this project's VM: by up to a quarter at 1 MiB in some runs, not at all in others);
    a reference slowed that way would flatter the ratios against it.
    """
    if device != "cpu":
        return _device_copy_seconds(size, repeats, device)
    src = torch.ones(size, dtype=torch.uint8)
    room = torch.zeros(size + 2 * codec.PAGE, dtype=torch.uint8)
    dst = (room.data_ptr() // codec.PAGE + 1) * codec.PAGE + (src.data_ptr() - codec.ALIGN) % codec.PAGE
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        ctypes.memmove(dst, src.data_ptr(), size)
        times.append(time.perf_counter() - started)
    return times[1:]


def _device_copy_seconds(size: int, repeats: int, device: str) -> list[float]:
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.zeros(size, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times[1:]


def in_process_seconds(
    name: str, config: dict, size: int, repeats: int, *, budget_s: float = 2.0, at_least: int = 100
) -> list[float]:
    """put + get in one process (small payloads: the latency floor of the connector): `repeats` of
    them after 50 warm-ups, or fewer (never under `at_least`) once `budget_s` is spent, so a backend
    whose round trip takes milliseconds (a datasystem worker) costs seconds, not half a minute."""
    connector = create_connector(name, config)
    data = payload(size)

    def round_trip(key: str) -> float:
        started = time.perf_counter()
        _, _, meta = connector.put(*EDGE, key, data)
        connector.get(*EDGE, key, meta)
        return time.perf_counter() - started

    times: list[float] = []
    try:
        for i in range(50):
            round_trip(f"inproc/warm/{i}")
        ends = time.perf_counter() + budget_s
        for i in range(repeats):
            times.append(round_trip(f"inproc/{i}"))
            if len(times) >= at_least and time.perf_counter() > ends:
                break
    finally:
        connector.close()
    return times


class ConsumerProcess(PeerProcess):
    """The other side of the benchmark: builds the connector from the same config, gets, reports."""

    def __init__(self, name: str, config: dict) -> None:
        super().__init__("omni_mesh.bench.connector", name, config)

    def ask(self, message: dict) -> dict:
        reply = msgpack.unpackb(self.exchange(msgpack.packb(message, use_bin_type=True), "consumer process"), raw=False)
        if "error" in reply:
            raise RuntimeError(f"consumer: {reply['error']}")
        return reply

    def close(self) -> None:  # type: ignore[override]
        super().close(msgpack.packb({"stop": True}))


def consumer_main(name: str, config_json: str, port: int) -> int:
    ctx, socket = consumer_socket(port)
    connector = create_connector(name, json.loads(config_json))
    try:
        while True:
            message = msgpack.unpackb(socket.recv(), raw=False)
            if message.get("stop"):
                return 0
            try:
                reply = _consume(connector, message)
            except Exception as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            socket.send(msgpack.packb(reply, use_bin_type=True))
    finally:
        connector.close()
        socket.close(0)
        ctx.term()


def _consume(connector: Any, message: dict) -> dict:
    received = time.perf_counter()
    # The stage runtime's blocking get: a plain get() is a poll that gives up after about a second.
    result = connector.get_with_deadline(*EDGE, message["key"], message["meta"], deadline=time.monotonic() + 120)
    if result is not None and result[0]["hidden_states"].is_cuda:
        torch.cuda.synchronize()  # the mapping waits on the producer's event asynchronously
    got = time.perf_counter()
    if result is None:
        return {"error": f"get returned None for {message['key']}"}
    reply = {"received": received, "get_s": got - received, "done": got}
    if message.get("verify"):
        reply["digest"] = digest(result[0]["hidden_states"])
    del result  # release the payload before the next round
    return reply


# Health counters of one-off buffers, by connector: a payload that fit no pool space.
FALLBACK_COUNTERS = ("fallbacks", "oneoff")


def pool_counters(connector: Any) -> tuple[int, int]:
    """(segments the pool grew by, one-off fallbacks) so far, from the connector's health()."""
    health = connector.health()
    return int(health.get("pool_grown", 0)), sum(int(health.get(name, 0)) for name in FALLBACK_COUNTERS)


def make_payload(connector: Any, source: dict[str, torch.Tensor], zero_copy: bool) -> dict[str, torch.Tensor]:
    """The payload to put: `source` itself, or (zero copy) a copy of it in `connector.empty()` memory."""
    if not zero_copy:
        return source
    tensor = source["hidden_states"]
    output = connector.empty(tuple(tensor.shape), tensor.dtype)
    # The handler's own computation, outside the timings. A memmove, not copy_: torch's intra-op
    # threads spin-wait after a parallel copy and would slow the timed put that follows.
    if tensor.is_cuda:
        output.copy_(tensor)
    else:
        ctypes.memmove(output.data_ptr(), tensor.data_ptr(), tensor.nbytes)
    return {"hidden_states": output}


def measure(
    connector: Any,
    consumer: ConsumerProcess,
    size: int,
    repeats: int,
    device: str = "cpu",
    round_: int = 0,
    *,
    zero_copy: bool = False,
    warm_ups: int = 2,
) -> tuple[list[float], list[float], list[float]]:
    """Producer put, consumer get and end-to-end times of `repeats` transfers (after `warm_ups`)."""
    name = type(connector).__name__
    source = payload(size, device)
    expected = digest(source["hidden_states"])
    put_s, get_s, e2e_s = [], [], []
    for i in range(repeats + warm_ups):
        key = f"bench-{size}/{round_}/{i}"  # never reused: a consumed key may still be being deleted
        data = make_payload(connector, source, zero_copy)
        started = time.perf_counter()
        ok, _, meta = connector.put(*EDGE, key, data)
        put_done = time.perf_counter()
        if not ok:
            raise RuntimeError(f"put of {key} failed")
        del data  # a zero-copy payload's memory goes back once the consumer is done with it too
        reply = consumer.ask({"key": key, "meta": meta, "verify": i == 0})
        if i == 0 and reply["digest"] != expected:
            raise RuntimeError(f"{name}: the consumer received different bytes at {size} bytes")
        if i >= warm_ups:
            put_s.append(put_done - started)
            get_s.append(reply["get_s"])
            e2e_s.append(reply["done"] - started)  # perf_counter is CLOCK_MONOTONIC: one clock per host
    return put_s, get_s, e2e_s


def raw_seconds(name: str, size: int, repeats: int, config: dict) -> list[float] | None:
    """Times of the raw library moving `size` bytes, or None for connectors without a raw baseline."""
    target = RAW_BASELINES.get(name)
    if target is None:
        return None
    module_name, _, attr = target.partition(":")
    function: Callable[..., list[float]] = getattr(importlib.import_module(module_name), attr)
    if name == "YuanrongConnector":  # the raw client talks to the same worker as the connector
        # The connector's own parsing, so a config that relies on its default host or port works too.
        parsed = parse_config(connector_class(name).config_class, config, owner=name)
        return function(size, repeats, parsed.host, parsed.port)
    return function(size, repeats)


def measure_size(
    name: str,
    config: dict,
    consumer: ConsumerProcess,
    size: int,
    *,
    raw: bool,
    device: str = "cpu",
    zero_copy: bool = False,
) -> SizeResult:
    """The connector, the memcpy reference and, where there is one, the raw library, in alternating
    rounds.

    The machines drift (other tenants, frequency): alternating the sides and taking medians over all
    samples keeps a slow minute from landing on one side of a ratio only.
    """
    repeats = repeats_for(size)
    put_s: list[float] = []
    get_s: list[float] = []
    e2e_s: list[float] = []
    raw_s: list[float] = []
    memcpy_s: list[float] = []
    has_raw = raw and name in RAW_BASELINES and device == "cpu"  # the raw baselines move host bytes
    if has_raw:
        # Untimed: warm the backend (a datasystem worker's arena faults its pages in on first use)
        # so that neither side of the comparison pays for that and the other does not.
        raw_seconds(name, size, 2, config)
    rounds = 4
    # One connector for all rounds, as a stage keeps one for its lifetime: a fresh one per round would
    # pay its client's first-touch costs (mappings, connections) inside the timings.
    connector = create_connector(name, config)
    try:
        grown_before, fallbacks_before = pool_counters(connector)
        measure(connector, consumer, size, 0, device, -1, zero_copy=zero_copy, warm_ups=1)  # the first put
        _, fallbacks_first = pool_counters(connector)
        for round_ in range(rounds):
            puts, gets, e2es = measure(
                connector, consumer, size, max(3, repeats // rounds), device, round_, zero_copy=zero_copy
            )
            put_s += puts
            get_s += gets
            e2e_s += e2es
            memcpy_s += memcpy_seconds(size, len(puts), device)
            if has_raw:
                raw_s += raw_seconds(name, size, max(3, repeats // rounds), config) or []
        grown_after, fallbacks_after = pool_counters(connector)
        encryption = connector.health().get("encryption")
    finally:
        connector.close()
    result = summarize(size, put_s, get_s, e2e_s, raw_s, memcpy_s)
    result.pool_grown = grown_after - grown_before
    result.fallbacks = fallbacks_after - fallbacks_before
    result.fallbacks_after_first = fallbacks_after - fallbacks_first
    result.encryption = encryption
    return result


def run(
    name: str,
    config: dict,
    sizes: list[int],
    *,
    raw: bool = True,
    device: str = "cpu",
    zero_copy: bool = False,
) -> dict[str, Any]:
    """Measure `sizes` with the connector built from `config` as given (its defaults for what it omits)."""
    results = []
    consumer = ConsumerProcess(name, config)
    try:
        for size in sizes:
            results.append(
                measure_size(name, config, consumer, size, raw=raw, device=device, zero_copy=zero_copy)
            )
    finally:
        consumer.close()
    small = statistics.median(in_process_seconds(name, config, 4096, 2000))
    return {
        "connector": name,
        "config": config,
        "device": device,
        "zero_copy": zero_copy,
        # Side channels (ZmqConnector, the transfer engines) run CURVE when the environment holds
        # mesh keys (OMNI_MESH_CURVE_PUBLIC_KEY/_SECRET_KEY or OMNI_MESH_KEYS_DIR; the consumer
        # process inherits them): the same command measures both, the header says which ran.
        "mesh_keys": mesh_keys() is not None,
        "sizes": [asdict(r) for r in results],
        "inproc_4k_s": small,
    }


def parse_sizes(text: str | None) -> list[int]:
    items = text.split(",") if text else DEFAULT_SIZES
    return [parse_size(item.strip(), what="--sizes") for item in items if item.strip()]


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--consumer":
    sys.exit(consumer_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
