"""Connectors whose backends cannot run on this machine: YuanrongTransferEngineConnector (Ascend NPUs
only) and MoriTransferEngineConnector (AMD MORI: no CPython 3.11 wheel, needs ROCm 7 and RDMA/XGMI).

Construction must fail fast and say what is missing, and config errors must be named even where the
backend is missing. MORI's data path is exercised here ONLY against a fake `mori.io` module that this
file injects into sys.modules: it records every call the connector makes and "transfers" bytes with
memmove between pools registered in the same process. It checks the connector's use of MORI's
published API and its own bookkeeping (side channel, pools, claims, releases, expiry), not MORI.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import time
import types
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch
from support.meshkit import wait_until
from support.payloads import assert_same, payload

from omni_mesh.connectors import ConnectorConfigError, ConnectorError, ConnectorUnavailable, create_connector
from omni_mesh.connectors.yuanrong_transfer_engine import ascend_runtime_missing

FAST_S = 5.0


@pytest.fixture(autouse=True)
def client_logs(tmp_path, monkeypatch):
    """The datasystem client (imported by the Yuanrong connectors) logs here, not in a shared dir."""
    monkeypatch.setenv("DATASYSTEM_CLIENT_LOG_DIR", str(tmp_path))


def timed_failure(name: str, config: dict, error: type[Exception]) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(error) as caught:
        create_connector(name, config)
    return str(caught.value), time.monotonic() - started


# --------------------------------------------------------------------------- Yuanrong transfer engine


def test_yuanrong_transfer_engine_names_the_missing_ascend_runtime_and_the_alternatives():
    assert ascend_runtime_missing() is not None  # this machine has no Ascend CANN runtime
    message, elapsed = timed_failure("YuanrongTransferEngineConnector", {}, ConnectorUnavailable)
    assert elapsed < FAST_S
    assert "YuanrongTransferEngineConnector" in message and "libascendcl.so" in message
    assert "set_env.sh" in message and "ZmqConnector" in message and "YuanrongConnector" in message


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"zmq_prot": 1}, "unknown config key 'zmq_prot'"),
        ({"memory_pool_device": "cpu"}, "memory_pool_device must be 'auto' or 'npu:N'"),
        ({"rpc_port": -1}, "rpc_port must be 0"),
    ],
)
def test_yuanrong_transfer_engine_config_errors_come_first(config, message):
    text, elapsed = timed_failure("YuanrongTransferEngineConnector", config, ConnectorConfigError)
    assert message in text and elapsed < 2


# --------------------------------------------------------------------------- Mori without the library


def test_mori_without_the_library_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mori", None)  # `import mori` raises ImportError, as on this machine
    message, elapsed = timed_failure("MoriTransferEngineConnector", {}, ConnectorUnavailable)
    assert elapsed < FAST_S
    assert "MoriTransferEngineConnector" in message and "pip install amd-mori" in message
    assert "3.10 and 3.12" in message and "ROCm 7" in message and "ZmqConnector" in message


def test_mori_with_rocm_missing_reports_the_loader_error(monkeypatch):
    def no_rocm(name: str) -> Any:
        raise OSError("libhsa-runtime64.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr("omni_mesh.connectors.mori.importlib.import_module", no_rocm)
    message, _ = timed_failure("MoriTransferEngineConnector", {}, ConnectorUnavailable)
    assert "libhsa-runtime64.so.1" in message and "ROCm 7" in message


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"device": "mlx5_0"}, "unknown config key 'device'"),
        ({"backend_type": "tcp"}, "backend_type must be one of rdma, xgmi"),
        ({"backend_type": "xgmi"}, "set memory_pool_device to cuda"),
        ({"qp_per_transfer": 0}, "qp_per_transfer must be at least 1"),
        ({"poll_cq_mode": "busy"}, "poll_cq_mode must be one of"),
        ({"memory_pool_size": "big"}, "memory_pool_size"),
    ],
)
def test_mori_config_errors_come_before_the_missing_library(monkeypatch, config, message):
    monkeypatch.setitem(sys.modules, "mori", None)
    text, elapsed = timed_failure("MoriTransferEngineConnector", config, ConnectorConfigError)
    assert message in text and elapsed < 2


# --------------------------------------------------------------------------- Mori against a recording fake


def make_fake_mori() -> types.ModuleType:
    """A stand-in for `mori.io` with the published API's names; records calls in `io.calls`."""
    io = types.ModuleType("mori.io")
    io.calls = []
    io.registered = {}  # MemoryDesc id -> MemoryDesc
    io.read_failure = None  # set to a message: reads fail with it
    io.stall = False  # True: reads stay in progress (no bytes move) until finish_stalled()
    io.stalled = []
    ids = itertools.count(1)

    def record(method: str, **details: Any) -> None:
        io.calls.append((method, details))

    io.BackendType = SimpleNamespace(RDMA="RDMA", XGMI="XGMI")
    io.PollCqMode = SimpleNamespace(POLLING="POLLING", EVENT="EVENT")

    class IOEngineConfig:
        def __init__(self, host: str = "", port: int = 0) -> None:
            self.host, self.port = host, port

    class RdmaBackendConfig:
        def __init__(
            self, qp_per_transfer=1, post_batch_size=-1, num_worker_threads=-1, poll_cq_mode="POLLING"
        ):
            self.options = dict(
                qp_per_transfer=qp_per_transfer,
                post_batch_size=post_batch_size,
                num_worker_threads=num_worker_threads,
                poll_cq_mode=poll_cq_mode,
            )

    class XgmiBackendConfig:
        def __init__(self, num_streams=64, num_events=64):
            self.options = dict(num_streams=num_streams, num_events=num_events)

    class EngineDesc:
        def __init__(self, key: str, host: str, port: int) -> None:
            self.key, self.host, self.port = key, host, port

        def pack(self) -> bytes:
            return msgpack.packb([self.key, self.host, self.port])

        @staticmethod
        def unpack(data: bytes) -> EngineDesc:
            return EngineDesc(*msgpack.unpackb(data))

    class MemoryDesc:
        def __init__(self, engine_key: str, id: int, data: int, size: int) -> None:
            self.engine_key, self.id, self.data, self.size = engine_key, id, data, size

        def pack(self) -> bytes:
            return msgpack.packb([self.engine_key, self.id, self.data, self.size])

        @staticmethod
        def unpack(data: bytes) -> MemoryDesc:
            return MemoryDesc(*msgpack.unpackb(data))

    class TransferStatus:
        def __init__(self, code: str = "SUCCESS", message: str = "") -> None:
            self.code, self.message = code, message

        def InProgress(self) -> bool:
            return self.code == "IN_PROGRESS"

        def Succeeded(self) -> bool:
            return self.code == "SUCCESS"

        def Failed(self) -> bool:
            return self.code.startswith("ERR")

        def Message(self) -> str:
            return self.message

        def Code(self) -> str:
            return self.code

        def WaitFor(self, timeout_ms: int = -1) -> str:
            record("WaitFor", timeout_ms=timeout_ms)
            return self.code

    class IOEngine:
        def __init__(self, key: str, config: IOEngineConfig) -> None:
            record("IOEngine", key=key, host=config.host, port=config.port)
            self.key, self.config, self.remotes = key, config, {}
            self.uids = itertools.count()

        def get_engine_desc(self) -> EngineDesc:
            return EngineDesc(self.key, self.config.host, self.config.port)

        def create_backend(self, backend_type: str, config: Any) -> None:
            record("create_backend", type=backend_type, **config.options)

        def register_torch_tensor(self, tensor: torch.Tensor) -> MemoryDesc:
            record(
                "register_torch_tensor", device=tensor.device.type, dtype=tensor.dtype, numel=tensor.numel()
            )
            assert tensor.is_contiguous()
            desc = MemoryDesc(self.key, next(ids), tensor.data_ptr(), tensor.numel() * tensor.element_size())
            io.registered[desc.id] = desc
            return desc

        def deregister_memory(self, desc: MemoryDesc) -> None:
            record("deregister_memory", id=desc.id)
            io.registered.pop(desc.id)

        def register_remote_engine(self, desc: EngineDesc) -> None:
            record("register_remote_engine", engine=self.key, remote=desc.key)
            self.remotes[desc.key] = desc

        def deregister_remote_engine(self, desc: EngineDesc) -> None:
            record("deregister_remote_engine", engine=self.key, remote=desc.key)
            self.remotes.pop(desc.key)

        def allocate_transfer_uid(self) -> int:
            return next(self.uids)

        def read(self, local, local_offset, remote, remote_offset, size, uid) -> TransferStatus:
            record("read", engine=self.key, local=local.id, local_offset=local_offset, remote=remote.id,
                   remote_offset=remote_offset, size=size, uid=uid)  # fmt: skip
            if remote.engine_key not in self.remotes:
                return TransferStatus("ERR_NOT_FOUND", f"engine {remote.engine_key} is not registered")
            if local.id not in io.registered or remote.id not in io.registered:
                return TransferStatus("ERR_INVALID_ARGS", "memory is not registered")
            if local_offset + size > local.size or remote_offset + size > remote.size:
                return TransferStatus("ERR_INVALID_ARGS", "out of bounds")
            if io.read_failure:
                return TransferStatus("ERR_RDMA_OP", io.read_failure)
            if io.stall:
                status = TransferStatus("IN_PROGRESS")
                io.stalled.append((status, local.data + local_offset, remote.data + remote_offset, size))
                return status
            ctypes.memmove(local.data + local_offset, remote.data + remote_offset, size)
            return TransferStatus()

    def finish_stalled() -> None:
        for status, dest, src, size in io.stalled:
            ctypes.memmove(dest, src, size)
            status.code = "SUCCESS"
        io.stalled.clear()

    for cls in (IOEngineConfig, RdmaBackendConfig, XgmiBackendConfig, EngineDesc, MemoryDesc, IOEngine):
        setattr(io, cls.__name__, cls)
    io.finish_stalled = finish_stalled
    return io


@pytest.fixture
def fake_mori(monkeypatch):
    io = make_fake_mori()
    package = types.ModuleType("mori")
    package.io = io
    monkeypatch.setitem(sys.modules, "mori", package)
    monkeypatch.setitem(sys.modules, "mori.io", io)
    monkeypatch.delenv("MORI_RDMA_DEVICES", raising=False)
    return io


MORI = {"host": "127.0.0.1", "memory_pool_size": "16MiB"}


@pytest.fixture
def mori_pair(fake_mori):
    producer = create_connector(
        "MoriTransferEngineConnector", {**MORI, "qp_per_transfer": 2, "num_worker_threads": 4}
    )
    consumer = create_connector("MoriTransferEngineConnector", MORI)
    yield producer, consumer
    producer.close()
    consumer.close()


def calls(io: types.ModuleType, method: str) -> list[dict]:
    return [details for name, details in io.calls if name == method]


def test_mori_engine_setup_follows_the_published_api(fake_mori, monkeypatch):
    connector = create_connector(
        "MoriTransferEngineConnector",
        {**MORI, "port": 7500, "device_name": "mlx5_0", "poll_cq_mode": "event"},
    )
    try:
        (engine,) = calls(fake_mori, "IOEngine")
        assert engine["host"] == "127.0.0.1" and engine["port"] == 7500
        (backend,) = calls(fake_mori, "create_backend")
        assert backend == {"type": "RDMA", "qp_per_transfer": 1, "post_batch_size": -1, "num_worker_threads": 1,
                           "poll_cq_mode": "EVENT"}  # fmt: skip
        (pool,) = calls(fake_mori, "register_torch_tensor")
        assert pool == {"device": "cpu", "dtype": torch.uint8, "numel": 16 << 20}
        assert __import__("os").environ["MORI_RDMA_DEVICES"] == "mlx5_0"
    finally:
        connector.close()
    assert len(calls(fake_mori, "deregister_memory")) == 1


def test_mori_moves_every_payload_kind_and_frees_both_pools(fake_mori, mori_pair):
    producer, consumer = mori_pair
    value = payload("every_kind")
    ok, size, metadata = producer.put("thinker", "talker", "req-1/0", value)
    assert ok and set(metadata) == {"endpoint", "key", "token", "offset", "size", "engine", "mem"}
    metadata = msgpack.unpackb(msgpack.packb(metadata))  # it crosses the control plane as msgpack
    obj, got = consumer.get("thinker", "talker", "req-1/0", metadata)
    assert got == size
    assert_same(obj, value)
    (read,) = calls(fake_mori, "read")
    assert read["remote_offset"] == metadata["offset"] and read["size"] == size
    assert wait_until(lambda: producer.health()["held"] == 0 and producer.health()["pool_used_bytes"] == 0)
    assert consumer.health()["pool_used_bytes"] == 0
    # The producer's engine is registered with the consumer's once, however many gets follow.
    _, _, second = producer.put("thinker", "talker", "req-2/0", {"x": 1})
    assert consumer.get("thinker", "talker", "req-2/0", second)[0] == {"x": 1}
    assert len(calls(fake_mori, "register_remote_engine")) == 1
    consumer.close()
    assert len(calls(fake_mori, "deregister_remote_engine")) == 1


def test_mori_failed_read_keeps_the_payload_for_a_retry(fake_mori, mori_pair):
    producer, consumer = mori_pair
    _, _, metadata = producer.put("a", "b", "r/0", {"t": torch.arange(10)})
    fake_mori.read_failure = "RDMA op failed: remote access error"
    with pytest.raises(ConnectorError, match="remote access error") as caught:
        consumer.get("a", "b", "r/0", metadata)
    assert "MoriTransferEngineConnector" in str(caught.value) and "'r/0'" in str(caught.value)
    fake_mori.read_failure = None
    assert torch.equal(consumer.get("a", "b", "r/0", metadata)[0]["t"], torch.arange(10))
    assert consumer.health()["pool_used_bytes"] == 0


def test_mori_read_past_the_deadline_parks_its_slot_until_the_engine_is_done(fake_mori, mori_pair):
    producer, consumer = mori_pair
    _, _, metadata = producer.put("a", "b", "r/0", torch.ones(1000))
    fake_mori.stall = True
    with pytest.raises(ConnectorError, match="did not finish by the deadline"):
        consumer.get_with_deadline("a", "b", "r/0", metadata, deadline=time.monotonic() + 0.3)
    assert consumer.health()["pool_used_bytes"] > 0  # the engine may still write there
    fake_mori.stall = False
    fake_mori.finish_stalled()
    assert torch.equal(consumer.get("a", "b", "r/0", metadata)[0], torch.ones(1000))
    assert consumer.health()["pool_used_bytes"] == 0


def test_mori_cleanup_expiry_and_a_dead_producer(fake_mori):
    producer = create_connector("MoriTransferEngineConnector", {**MORI, "ttl_s": 0.3})
    consumer = create_connector("MoriTransferEngineConnector", MORI)
    try:
        metas = {k: producer.put("a", "b", k, k)[2] for k in ("r1/0", "r1/1", "r2/0")}
        producer.cleanup("r1")
        assert consumer.get("a", "b", "r1/0", metas["r1/0"]) is None  # cleaned up: not there any more
        assert wait_until(lambda: producer.health()["held"] == 0, timeout_s=3)
        assert producer.health()["expired"] == 1 and producer.health()["pool_used_bytes"] == 0
        assert consumer.get("a", "b", "r2/0", metas["r2/0"]) is None  # expired
        producer.close()
        started = time.monotonic()
        with pytest.raises(ConnectorError, match=rf"{metas['r2/0']['endpoint']}.*no answer to CLAIM"):
            consumer.get_with_deadline("a", "b", "r2/0", metas["r2/0"], deadline=time.monotonic() + 0.5)
        assert time.monotonic() - started < 1.5
    finally:
        producer.close()
        consumer.close()


def test_mori_full_pool_is_a_clear_put_error(fake_mori):
    producer = create_connector("MoriTransferEngineConnector", {**MORI, "memory_pool_size": "1MiB"})
    try:
        with pytest.raises(ConnectorError, match="memory pool is full.*raise memory_pool_size"):
            producer.put_or_raise("a", "b", "r/0", torch.ones(1 << 20))
    finally:
        producer.close()
