"""Helpers for tests/test_mooncake.py: a deterministic payload catalogue, a deep comparison, and a
peer process that drives a real connector on commands from the test.

The peer runs this file as a script (`python tests/mooncake_fixtures.py`), optionally inside a
network namespace. Commands and replies are JSON lines; replies carry a marker so the library's own
output never gets mistaken for one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

MARK = "@@peer "
REPLY_TIMEOUT_S = 60.0
MiB = 1 << 20


# --------------------------------------------------------------------------- payloads


def _mixed() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    return {
        "hidden": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, generator=g).half(),
        "ids": torch.randint(0, 1000, (17,), generator=g, dtype=torch.int64),
        "mask": torch.rand(6, generator=g) > 0.5,
        "bytes_tensor": torch.arange(256, dtype=torch.uint8),
        "complex": torch.randn(3, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.arange(24.0).reshape(4, 6).t(),
        "strided": torch.arange(100, dtype=torch.int32)[::3],
        "array": np.arange(12, dtype=np.float64).reshape(3, 4),
        "array_f16": np.linspace(0, 1, 5, dtype=np.float16),
        "array_strided": np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2],
        "array_empty": np.zeros((2, 0), dtype=np.int8),
        "np_scalar": np.float32(2.5),
        "blob": bytes(range(256)) * 4,
        "small_blob": b"abc",
        "text": "héllo wörld",
        "big_int": 2**40,
        "negative": -7,
        "ratio": 1.25,
        "flag": True,
        "nothing": None,
        "nested": [{"a": (1, "x", None)}, [torch.ones(2)], (), {}],
        "pair": (torch.zeros(2, dtype=torch.float64), "t"),
        7: "int key",
    }


PAYLOADS: dict[str, Callable[[], Any]] = {
    "mixed": _mixed,
    "none": lambda: None,
    "bytes": lambda: b"\x00\xff" * 3000,
    "str": lambda: "plain text " * 10,
    "int": lambda: 123456789,
    "float": lambda: 3.14159,
    "bool": lambda: False,
    "tensor": lambda: torch.arange(1000, dtype=torch.float32).reshape(10, 100),
    "bf16_0d": lambda: torch.tensor(1.5, dtype=torch.bfloat16),
    "ndarray": lambda: np.arange(64, dtype=np.uint32).reshape(8, 8),
    "list": lambda: [1, "two", 3.0, None, [torch.ones(3, dtype=torch.int8)]],
    "tuple": lambda: (torch.full((2, 2), 9, dtype=torch.int16), b"x" * 600),
    "8mib": lambda: {"audio": torch.arange(2 * MiB, dtype=torch.float32), "sr": 24000},
    "16mib": lambda: torch.ones(16 * MiB, dtype=torch.uint8),
}


def payload(name: str) -> Any:
    return PAYLOADS[name]()


def mismatch(expected: Any, got: Any, path: str = "payload") -> str | None:
    """Where and how `got` differs from `expected` (types, dtypes, shapes and values), or None."""
    both_tensors = isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
    if type(expected) is not type(got) and not both_tensors:
        return f"{path}: type {type(got).__name__}, expected {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        if (expected.dtype, expected.shape) != (got.dtype, got.shape):
            return f"{path}: {got.dtype}{tuple(got.shape)}, expected {expected.dtype}{tuple(expected.shape)}"
        return None if torch.equal(expected, got) else f"{path}: tensor values differ"
    if isinstance(expected, np.ndarray):
        if (expected.dtype, expected.shape) != (got.dtype, got.shape):
            return f"{path}: {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
        return None if np.array_equal(expected, got) else f"{path}: array values differ"
    if isinstance(expected, dict):
        if list(expected) != list(got):
            return f"{path}: keys {list(got)}, expected {list(expected)}"
        for key in expected:
            found = mismatch(expected[key], got[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(got):
            return f"{path}: {len(got)} items, expected {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            found = mismatch(e, g, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if expected == got else f"{path}: {got!r}, expected {expected!r}"


# --------------------------------------------------------------------------- peer process


class Peer:
    """A separate process owning one connector; `ask` sends a command and returns its reply."""

    def __init__(
        self,
        connector: str,
        config: dict[str, Any],
        *,
        wrap: list[str] | None = None,
        log: Path,
        env: dict[str, str] | None = None,
    ):
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        argv = [sys.executable, str(Path(__file__).resolve()), connector, json.dumps(config)]
        env = dict(os.environ, MC_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1", **(env or {}))
        self.process = subprocess.Popen(
            [*(wrap or []), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.info = self.read(REPLY_TIMEOUT_S)

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def ask(self, timeout_s: float = REPLY_TIMEOUT_S, **command: Any) -> dict[str, Any]:
        self.send(**command)
        return self.read(timeout_s)

    def read(self, timeout_s: float) -> dict[str, Any]:
        result: list[dict[str, Any]] = []
        reader = threading.Thread(target=self._read_into, args=(result,), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result:
            self.close()
            raise AssertionError(f"peer gave no reply within {timeout_s}s; log:\n{self.log_tail()}")
        return result[0]

    def _read_into(self, result: list[dict[str, Any]]) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):
                result.append(json.loads(line[len(MARK) :]))
                return

    def log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-3000:].decode(errors="replace")

    def close(self) -> None:
        """Close the connector and end the process (killed if it does not exit in time)."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                assert self.process.stdin is not None
                self.process.stdin.close()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """HOST:PORT on loopback whose listen queue is full: connects to it hang instead of failing."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
            fillers.append(filler)
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def pack(metadata: Any) -> str:
    """Metadata as text for the peer's JSON lines: msgpack (what the control plane carries), base64."""
    return base64.b64encode(msgpack.packb(metadata, use_bin_type=True)).decode()


def unpack(text: str) -> Any:
    return msgpack.unpackb(base64.b64decode(text), raw=False)


def _serve(connector_name: str, config: dict[str, Any]) -> None:
    from omni_mesh.connectors import create_connector

    def reply(message: dict[str, Any]) -> None:
        print(MARK + json.dumps(message), flush=True)

    connector = create_connector(connector_name, config)
    reply({"pid": os.getpid(), "host": getattr(connector, "host", "")})
    held: list[Any] = []
    try:
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            try:
                if op == "put":
                    ok, size, metadata = connector.put(
                        command["from"], command["to"], command["key"], payload(command["payload"])
                    )
                    try:
                        reply({"ok": ok, "size": size, "metadata": metadata})
                    except TypeError:  # bytes in the metadata: it travels as msgpack, as on the control plane
                        reply({"ok": ok, "size": size, "packed": pack(metadata)})
                elif op == "get":
                    metadata = unpack(command["packed"]) if "packed" in command else command.get("metadata")
                    result = connector.get(command["from"], command["to"], command["key"], metadata)
                    assert result is not None, "get returned None"
                    data, size = result
                    if command.get("hold"):
                        held.append(data)
                    reply({"size": size, "mismatch": mismatch(payload(command["expect"]), data)})
                    del data, result  # views over the pool: let the region go back now
                elif op == "release":
                    held.clear()
                    reply({"released": True})
                elif op == "health":
                    reply(connector.health())
                else:
                    reply({"error": f"unknown op {op!r}"})
            except Exception as exc:  # the test wants to see the error text
                reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        held.clear()
        connector.close()


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
