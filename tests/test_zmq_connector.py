"""ZmqConnector: put/get across processes and across two network namespaces, a producer that dies,
expiry of unconsumed payloads, cleanup by request, and the pool's fallback for oversized payloads.

Peers are real separate processes running this file as a script (`python test_zmq_connector.py peer
NAME CONFIG`): they build a connector and answer put/get requests read line by line from stdin. The
payload and the checks on what arrives are defined here once (`make_payload`, `assert_same`) and
reused by tests/test_yuanrong.py.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from omni_mesh.connectors import ConnectorConfigError, ConnectorError, create_connector
from omni_mesh.connectors.zmq import ZmqConnector

HERE = os.path.abspath(__file__)
LOCAL = {"host": "127.0.0.1"}


# --------------------------------------------------------------------------- payload


def make_payload() -> dict[Any, Any]:
    """Every kind of value a stage hands a connector, built the same way in every process."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(6, 8, generator=gen)
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "f64": base.double(),
        "i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "zero_d": torch.tensor(3.5),
        "zero_d_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 5),
        "empty_i32": torch.empty(3, 0, dtype=torch.int32),
        "transposed": base.t(),
        "strided": base[:, ::3],
        "big": torch.randn(1 << 20, generator=gen),  # 4 MiB
        "np_f64": np.arange(10, dtype=np.float64).reshape(2, 5),
        "np_i16": np.array([1, -2, 3], dtype=np.int16),
        "np_fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "np_empty": np.zeros((0, 2), dtype=np.uint16),
        "np_scalar": np.float32(1.5),
        "bytes_small": b"\x00\x01hi",
        "bytes_big": bytes(range(256)) * 40,
        "str": "héllo wörld ✓",
        "int": 2**62,
        "neg": -7,
        "float": 0.1,
        "true": True,
        "none": None,
        1: "an int key",
        "list": [1, "two", torch.ones(2, dtype=torch.float16), [None, 3.0]],
        "tuple": (torch.zeros(3, dtype=torch.int32), ("nested", 1.5), ()),
        "nested": {"a": {"b": [torch.arange(3), {"c": (b"x" * 600,)}]}},
    }


def assert_same(got: Any, want: Any, path: str = "payload") -> None:
    """Exact equality of type, dtype, shape and values, recursively."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got)} is not a tensor"
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (
            f"{path}: {got.dtype} {got.shape}"
        )
        assert torch.equal(got, want), f"{path}: values differ"
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, f"{path}: {type(got)} is not an ndarray"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{path}: {got.dtype} {got.shape}"
        assert np.array_equal(got, want), f"{path}: values differ"
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), f"{path}: keys {list(got)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{path}: {type(got)} of {len(got)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


# --------------------------------------------------------------------------- peer processes


def pack(obj: Any) -> str:
    return msgpack.packb(obj, use_bin_type=True).hex()


def unpack(line: str) -> Any:
    return msgpack.unpackb(bytes.fromhex(line.strip()), raw=False, strict_map_key=False)


class Peer:
    """A connector in another process, driven one request line at a time over its stdin/stdout."""

    def __init__(self, name: str, config: dict, *, popen=subprocess.Popen, env: dict | None = None) -> None:
        argv = [sys.executable, HERE, "peer", name, json.dumps(config)]
        self.proc = popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, timeout: float = 90.0, **request: Any) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(pack(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"peer gave no answer to {request['op']} within {timeout}s"
        line = self.proc.stdout.readline()
        assert line, f"peer exited (code {self.proc.poll()}) while answering {request['op']}"
        return unpack(line)

    def put(self, key: str, **extra: Any) -> dict:
        reply = self.ask(op="put", key=key, **extra)
        assert reply["ok"], reply["error"]
        return reply["metadata"]

    def get(self, key: str, metadata: dict | None, **extra: Any) -> dict:
        return self.ask(op="get", key=key, metadata=metadata, **extra)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _peer_main(name: str, config: dict) -> None:
    connector = create_connector(name, config)
    for line in sys.stdin:
        request = unpack(line)
        started = time.monotonic()
        try:
            reply = _peer_answer(connector, request)
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["elapsed"] = time.monotonic() - started
        print(pack(reply), flush=True)
    connector.close()


def _peer_answer(connector: Any, request: dict) -> dict:
    edge = (request.get("from", "thinker"), request.get("to", "talker"))
    if request["op"] == "put":
        nbytes = request.get("nbytes")
        data = torch.ones(nbytes, dtype=torch.uint8) if nbytes else make_payload()
        ok, size, metadata = connector.put(*edge, request["key"], data)
        return {"ok": ok, "size": size, "metadata": metadata}
    if request["op"] == "get":
        wait = request.get("timeout_s") or connector.config.get_timeout_s
        obj, size = connector.get_with_deadline(
            *edge, request["key"], request["metadata"], deadline=time.monotonic() + wait
        )
        if request.get("nbytes"):
            assert obj.numel() == request["nbytes"]
        else:
            assert_same(obj, make_payload())
        return {"ok": True, "size": size}
    if request["op"] == "health":
        return {"ok": True, "health": connector.health()}
    raise ValueError(f"unknown op {request['op']!r}")


# --------------------------------------------------------------------------- helpers


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def producer():
    connector = ZmqConnector(LOCAL)
    yield connector
    connector.close()


@pytest.fixture
def consumer():
    connector = ZmqConnector(LOCAL)
    yield connector
    connector.close()


# --------------------------------------------------------------------------- tests


def test_across_two_network_namespaces():
    from netns import TwoHosts

    with TwoHosts() as hosts:
        producer = Peer("ZmqConnector", {"host": "auto"}, popen=hosts.a.popen)
        consumer = Peer("ZmqConnector", {"host": "auto"}, popen=hosts.b.popen)
        try:
            metadata = producer.put("req-7/0")
            assert metadata["endpoint"].startswith(f"tcp://{hosts.a.ip}:")  # `auto` found the veth address
            reply = consumer.get("req-7/0", metadata)
            assert reply["ok"], reply["error"]
            # With the link cut the consumer fails at its deadline, naming the producer's endpoint.
            metadata = producer.put("req-8/0")
            hosts.cut()
            reply = consumer.get("req-8/0", metadata, timeout_s=1.5)
            assert (
                not reply["ok"] and metadata["endpoint"] in reply["error"] and "'req-8/0'" in reply["error"]
            )
            assert reply["elapsed"] < 3
            hosts.restore()
        finally:
            producer.close()
            consumer.close()


def test_killed_producer_fails_the_get_before_its_deadline(consumer, producer):
    peer = Peer("ZmqConnector", LOCAL)
    try:
        metadata = peer.put("req-9/0", nbytes=32 << 20)
    finally:
        peer.kill()
    started = time.monotonic()
    with pytest.raises(ConnectorError) as caught:
        consumer.get_with_deadline("thinker", "talker", "req-9/0", metadata, deadline=time.monotonic() + 2.0)
    assert time.monotonic() - started < 3.0
    message = str(caught.value)
    assert metadata["endpoint"] in message and "'req-9/0'" in message and "thinker->talker" in message
    # The timed-out socket was discarded; the same consumer still works with a live producer.
    _, _, live = producer.put("thinker", "talker", "req-10/0", {"x": torch.arange(4)})
    obj, _ = consumer.get("thinker", "talker", "req-10/0", live)
    assert torch.equal(obj["x"], torch.arange(4))
    assert consumer.health()["errors"] == 1


def test_get_from_an_address_nobody_serves_times_out_clearly(consumer):
    metadata = {"endpoint": "tcp://127.0.0.1:9", "key": "a->b/r/0", "token": "00", "size": 10}
    started = time.monotonic()
    with pytest.raises(ConnectorError, match=r"tcp://127\.0\.0\.1:9.*no answer within 0\.\d+s"):
        consumer.get_with_deadline("a", "b", "r/0", metadata, deadline=started + 0.5)
    assert time.monotonic() - started < 1.5
    assert consumer.get("a", "b", "r/0", metadata) is None  # the poll: nobody answered within a second


def test_unconsumed_payloads_are_freed_after_ttl(consumer):
    producer = ZmqConnector({**LOCAL, "ttl_s": 0.3})
    try:
        _, _, metadata = producer.put("a", "b", "r1/0", torch.ones(1 << 20))
        producer.put("a", "b", "r2/0", b"x" * 5000)
        assert producer.health()["held"] == 2 and producer.health()["pool_used_bytes"] > 0
        assert wait_until(lambda: producer.health()["held"] == 0, timeout=3)
        health = producer.health()
        assert health["pool_used_bytes"] == 0 and health["expired"] == 2
        assert consumer.get("a", "b", "r1/0", metadata) is None
    finally:
        producer.close()


def test_a_payload_larger_than_the_pool_uses_a_one_off_buffer(consumer):
    producer = ZmqConnector({**LOCAL, "memory_pool_size": "1MiB"})
    try:
        data = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB
        _, size, metadata = producer.put("a", "b", "big/0", data)
        assert producer.health()["oneoff"] == 1 and producer.health()["pool_used_bytes"] == 0
        obj, got = consumer.get("a", "b", "big/0", metadata)
        assert got == size and torch.equal(obj, data)
    finally:
        producer.close()


def test_a_second_put_of_a_key_replaces_the_first(producer, consumer):
    _, _, first = producer.put("a", "b", "r/0", "first")
    _, _, second = producer.put("a", "b", "r/0", "second")
    assert consumer.get("a", "b", "r/0", first) is None  # another put's token: not this payload
    assert consumer.get("a", "b", "r/0", second)[0] == "second"


def test_get_checks_its_metadata(consumer):
    assert consumer.get("a", "b", "r/0", None) is None  # no producer named anywhere: not there
    metadata = {"endpoint": "tcp://127.0.0.1:9", "key": "x->y/r/0", "token": "00", "size": 1}
    with pytest.raises(ConnectorError, match="metadata is for 'x->y/r/0'"):
        consumer.get("a", "b", "r/0", metadata)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hots": "x"}, "unknown config key 'hots'"),
        ({"port": 70000}, "port must be 0"),
        ({"ttl_s": -1}, "ttl_s must not be negative"),
        ({"get_timeout_s": 0}, "get_timeout_s must be positive"),
        ({"memory_pool_size": "lots"}, "memory_pool_size"),
    ],
)
def test_bad_config_is_named(config, message):
    with pytest.raises(ConnectorConfigError, match=message):
        create_connector("ZmqConnector", config)
    with pytest.raises(ConnectorConfigError, match=message):
        ZmqConnector.validate_config(config)


def test_a_port_in_use_is_reported_with_the_address(producer):
    producer.put("a", "b", "r/0", 1)
    port = int(producer.endpoint.rsplit(":", 1)[1])
    other = ZmqConnector({**LOCAL, "port": port, "memory_pool_size": "256MiB"})
    try:
        assert other.put("a", "b", "r/0", 1) == (False, 0, None)
        assert re.search(rf"cannot serve on tcp://127\.0\.0\.1:{port}", other.put_error("a", "b", "r/0"))
    finally:
        other.close()


if __name__ == "__main__" and sys.argv[1:2] == ["peer"]:
    _peer_main(sys.argv[2], json.loads(sys.argv[3]))
