"""`omni-mesh bench connector --handoff`: the steady-state hand-off of one payload size (1 MiB by
default: a thinker's hidden states for a request), against the limit measured in the same run.

A hand-off is what a stage pair does per request: the producer puts the payload, sends the metadata
to the consumer process, which gets it, lets go of it (its slot goes back) and answers. The producer
times the whole of it. The limit is what no connector can beat between the same two processes: one
memcpy of the bytes (`connector.memcpy_seconds`) plus the round trip of an empty message over the same
sockets, each timed alone (their medians summed: `limit`) and one after the other as a single step
(`in_sequence`: the round trip then starts from a process that just worked, as a hand-off's does;
on a loaded machine waking the sockets' I/O threads costs more then). Hand-offs, empty round trips and
memcpys alternate in rounds, so that a slow minute of a loaded machine lands on both sides of a ratio.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import struct
import sys
import time
from typing import Any

import msgpack
import torch

from omni_mesh import codec
from omni_mesh.bench.connector import (
    EDGE,
    make_payload,
    memcpy_seconds,
    payload,
    pool_counters,
)
from omni_mesh.bench.peer import PeerProcess, consumer_socket
from omni_mesh.connectors import create_connector

HANDOFFS = 600
WARM_UPS = 100
ROUNDS = 6
_SECONDS = struct.Struct("<d")


class HandoffConsumer(PeerProcess):
    """The consumer process: gets each payload by its metadata, drops it, answers with its own time."""

    def __init__(self, name: str, config: dict) -> None:
        super().__init__("omni_mesh.bench.handoff", name, config)

    def ask(self, message: bytes) -> bytes:
        reply = self.exchange(message, "hand-off consumer")
        if reply[:1] == b"!":
            raise RuntimeError(f"hand-off consumer: {reply[1:].decode(errors='replace')}")
        return reply

    def close(self) -> None:  # type: ignore[override]
        super().close(b"stop")


def consumer_main(name: str, config_json: str, port: int) -> int:
    ctx, socket = consumer_socket(port)
    connector = create_connector(name, json.loads(config_json))
    try:
        while True:
            message = socket.recv()
            if message == b"stop":
                return 0
            if not message:  # the empty round trip of the limit
                socket.send(b"")
                continue
            started = time.perf_counter()
            try:
                key, metadata = msgpack.unpackb(message, raw=False)
                result = connector.get_with_deadline(*EDGE, key, metadata, deadline=time.monotonic() + 60)
                del result  # as a handler done with its input: the slot goes back now
            except Exception as exc:
                socket.send(b"!" + f"{type(exc).__name__}: {exc}".encode())
                continue
            socket.send(_SECONDS.pack(time.perf_counter() - started))
    finally:
        connector.close()
        socket.close(0)
        ctx.term()


def run_handoff(
    name: str, config: dict, size: int, count: int = HANDOFFS, *, zero_copy: bool = False
) -> dict[str, Any]:
    """Medians of `count` steady-state hand-offs of `size` bytes (after WARM_UPS), of the put alone and
    of the consumer's get and release, and the limit (memcpy + empty round trip) of the same run.
    `zero_copy`: each payload is made in `connector.empty()` memory first (untimed), as a handler that
    computes its output there: the put then copies nothing."""
    connector = create_connector(name, config)
    consumer = HandoffConsumer(name, config)
    source = payload(size)
    handoff_s: list[float] = []
    put_s: list[float] = []
    get_s: list[float] = []
    rtt_s: list[float] = []
    memcpy_s: list[float] = []
    sequence_s: list[float] = []
    copy = _Copy(size)
    try:
        per_round = max(1, count // ROUNDS)
        for i in range(WARM_UPS):
            _handoff(connector, consumer, f"handoff/warm/{i}", make_payload(connector, source, zero_copy))
        grown_before, fallbacks_before = pool_counters(connector)
        for round_ in range(ROUNDS):
            for i in range(per_round):
                data = make_payload(connector, source, zero_copy)
                total, put, get = _handoff(connector, consumer, f"handoff/{round_}/{i}", data)
                del data
                handoff_s.append(total)
                put_s.append(put)
                get_s.append(get)
            for _ in range(per_round):
                started = time.perf_counter()
                consumer.ask(b"")
                rtt_s.append(time.perf_counter() - started)
            memcpy_s += memcpy_seconds(size, per_round)
            for _ in range(per_round):
                started = time.perf_counter()
                copy.run()
                consumer.ask(b"")
                sequence_s.append(time.perf_counter() - started)
        grown_after, fallbacks_after = pool_counters(connector)
    finally:
        consumer.close()
        connector.close()
    median = statistics.median
    limit = median(memcpy_s) + median(rtt_s)
    return {
        "connector": name,
        "config": config,
        "zero_copy": zero_copy,
        "size": size,
        "handoffs": len(handoff_s),
        "handoff_s": median(handoff_s),
        "put_s": median(put_s),
        "get_release_s": median(get_s),
        "memcpy_s": median(memcpy_s),
        "round_trip_s": median(rtt_s),
        "limit_s": limit,
        "ratio_limit": median(handoff_s) / limit,
        "in_sequence_s": median(sequence_s),
        "ratio_in_sequence": median(handoff_s) / median(sequence_s),
        "pool_grown": grown_after - grown_before,
        "fallbacks": fallbacks_after - fallbacks_before,
    }


class _Copy:
    """One memcpy of `size` bytes between pre-faulted buffers, placed as memcpy_seconds places them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.src = torch.ones(size, dtype=torch.uint8)
        self.room = torch.zeros(size + 2 * codec.PAGE, dtype=torch.uint8)
        page = codec.PAGE
        self.dst = (self.room.data_ptr() // page + 1) * page + (self.src.data_ptr() - codec.ALIGN) % page

    def run(self) -> None:
        ctypes.memmove(self.dst, self.src.data_ptr(), self.size)


def _handoff(connector: Any, consumer: HandoffConsumer, key: str, data: Any) -> tuple[float, float, float]:
    started = time.perf_counter()
    _, metadata = connector.put_or_raise(*EDGE, key, data)  # a failure raises, saying why
    put_done = time.perf_counter()
    reply = consumer.ask(msgpack.packb((key, metadata), use_bin_type=True))
    return time.perf_counter() - started, put_done - started, _SECONDS.unpack(reply)[0]


def report(result: dict[str, Any]) -> str:
    us = 1e6
    return "\n".join(
        [
            f"connector {result['connector']}  config {json.dumps(result['config'])}",
            f"{result['size'] >> 10} KiB hand-off (put, metadata to the consumer process, its get and release, "
            f"its answer), steady state, medians of {result['handoffs']}"
            + (", payloads made in connector.empty() (--zero-copy):" if result.get("zero_copy") else ":"),
            f"  hand-off {result['handoff_s'] * us:.1f} us  (put {result['put_s'] * us:.1f} us, consumer get + "
            f"release {result['get_release_s'] * us:.1f} us)",
            f"  limit    {result['limit_s'] * us:.1f} us  (memcpy {result['memcpy_s'] * us:.1f} us + empty round "
            f"trip {result['round_trip_s'] * us:.1f} us, same run)",
            f"  in sequence {result['in_sequence_s'] * us:.1f} us  (the memcpy, then the empty round trip, timed "
            f"as one step): {result['ratio_in_sequence']:.2f}x",
            f"  ratio    {result['ratio_limit']:.2f}x the limit   pool grown {result['pool_grown']}, "
            f"fallbacks {result['fallbacks']}",
        ]
    )


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--consumer":
    sys.exit(consumer_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
