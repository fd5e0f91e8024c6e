"""Raw Mooncake baselines: `size` bytes already in registered memory, moved by bare library calls.

`transfer_engine_seconds(size, repeats)` starts a second process whose engine registers a receive
buffer; this process's engine writes `size` registered bytes into it with one `transfer_sync_write`
per transfer (the direction MooncakeTransferEngineConnector moves payloads in) and times each call.

`store_seconds(size, repeats)` starts a `mooncake_master` and a second process; both mount a store
segment and register a buffer. Each transfer is this process's `put_from` plus the other's
`get_into` of the same key (both timed, the key removed afterwards untimed), like a connector put+get.

Both run `warmup` untimed transfers first (the TCP handshake and the peer's first-touch page faults),
keep all traffic on 127.0.0.1, and stop every process they start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from omni_mesh.connectors.mooncake_store import RegisteredPool, import_mooncake
from omni_mesh.local_services.mooncake_master import MooncakeMaster

_HOST = "127.0.0.1"
_REPLY_TIMEOUT_S = 120.0


def transfer_engine_seconds(size: int, repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of each of `repeats` engine writes of `size` bytes to another process."""
    engine_module = import_mooncake("mooncake.engine", "raw_mooncake")
    with _Peer(["te-target", str(size)]) as peer:
        target = peer.ready()
        engine = engine_module.TransferEngine()
        _check(engine.initialize(_HOST, "P2PHANDSHAKE", "tcp", ""), "TransferEngine.initialize")
        source = RegisteredPool(size, prefault=True)
        try:
            source.array[:size] = 7
            _check(engine.register_memory(source.address, source.size), "register_memory")
            times = []
            for i in range(warmup + repeats):
                started = time.perf_counter()
                rc = engine.transfer_sync_write(target["segment"], source.address, target["addr"], size)
                elapsed = time.perf_counter() - started
                _check(rc, f"transfer_sync_write #{i}")
                if i >= warmup:
                    times.append(elapsed)
            if peer.ask({"op": "checksum"})["checksum"] != 7 * size:
                raise RuntimeError("raw_mooncake: the target's buffer does not hold the bytes written")
            engine.unregister_memory(source.address)
            return times
        finally:
            del engine  # about a second of engine teardown


def store_seconds(size: int, repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of each of `repeats` store transfers (put_from here + get_into there) of `size` bytes."""
    store_module = import_mooncake("mooncake.store", "raw_mooncake")
    segment = 2 * size + (64 << 20)  # room for one object wherever the master places it
    with MooncakeMaster() as master, _Peer(["store-reader", str(size), master.address, str(segment)]) as peer:
        peer.ready()
        store = store_module.MooncakeDistributedStore()
        _check(store.setup(_HOST, "P2PHANDSHAKE", segment, 0, "tcp", "", master.address), "store.setup")
        source = RegisteredPool(size, prefault=True)
        try:
            source.array[:size] = 7
            _check(store.register_buffer(source.address, source.size), "register_buffer")
            times = []
            for i in range(warmup + repeats):
                key = f"raw-bench/{i}"
                started = time.perf_counter()
                rc = store.put_from(key, source.address, size)
                put_s = time.perf_counter() - started
                _check(rc, f"put_from #{i}")
                get_s = peer.ask({"op": "get", "key": key})["seconds"]
                if i >= warmup:
                    times.append(put_s + get_s)
            if peer.ask({"op": "checksum"})["checksum"] != 7 * size:
                raise RuntimeError("raw_mooncake: the reader's buffer does not hold the bytes put")
            store.unregister_buffer(source.address)
            return times
        finally:
            store.close()


class _Peer:
    """The second process: JSON lines on its stdin/stdout, its stderr kept for error messages."""

    def __init__(self, argv: list[str]) -> None:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in __exit__
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omni_mesh.bench.raw_mooncake", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def __enter__(self) -> _Peer:
        return self

    def ready(self) -> dict[str, Any]:
        return self._read()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # the library may print lines of its own
            if line.startswith("{"):
                reply = json.loads(line)
                if "error" in reply:
                    raise RuntimeError(f"raw_mooncake peer: {reply['error']}")
                return reply
        self._log.seek(0)
        tail = self._log.read()[-2000:].decode(errors="replace")
        raise RuntimeError(f"raw_mooncake: the peer exited (code {self.process.wait()}):\n{tail}")

    def __exit__(self, *exc: object) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # EOF: the peer cleans up and exits
        try:
            self.process.wait(_REPLY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"raw_mooncake: {what} returned {rc}")


def _reply(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def _te_target(size: int) -> None:
    engine = import_mooncake("mooncake.engine", "raw_mooncake").TransferEngine()
    _check(engine.initialize(_HOST, "P2PHANDSHAKE", "tcp", ""), "TransferEngine.initialize")
    buffer = RegisteredPool(size, prefault=True)
    _check(engine.register_memory(buffer.address, buffer.size), "register_memory")
    _reply({"segment": f"{_HOST}:{engine.get_rpc_port()}", "addr": buffer.address})
    for line in sys.stdin:
        if json.loads(line)["op"] == "checksum":
            _reply({"checksum": int(buffer.array[:size].sum(dtype="uint64"))})
    engine.unregister_memory(buffer.address)


def _store_reader(size: int, master: str, segment: int) -> None:
    store = import_mooncake("mooncake.store", "raw_mooncake").MooncakeDistributedStore()
    _check(store.setup(_HOST, "P2PHANDSHAKE", segment, 0, "tcp", "", master), "store.setup")
    buffer = RegisteredPool(size, prefault=True)
    _check(store.register_buffer(buffer.address, buffer.size), "register_buffer")
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "checksum":
            _reply({"checksum": int(buffer.array[:size].sum(dtype="uint64"))})
            continue
        started = time.perf_counter()
        got = store.get_into(request["key"], buffer.address, size)
        elapsed = time.perf_counter() - started
        store.remove(request["key"], True)
        _reply({"seconds": elapsed} if got == size else {"error": f"get_into returned {got}"})
    store.unregister_buffer(buffer.address)
    store.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "te-target":
        _te_target(int(args[0]))
    elif role == "store-reader":
        _store_reader(int(args[0]), args[1], int(args[2]))
    else:
        raise SystemExit(f"raw_mooncake: unknown role {role!r}")
