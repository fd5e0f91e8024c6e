"""The far side of tests/test_shared_memory.py: a SharedMemoryConnector in a separate process.

    python tests/support/shm_consumer.py CONFIG_HEX      # CONFIG_HEX: the connector's config, msgpack, hex

Commands arrive on stdin and answers leave on stdout, each a msgpack map behind a 4-byte little-endian
length. Payloads travel back re-encoded with the codec, so the test compares what this process saw.
Everything else on the wire (metadata included) is plain msgpack, as on the real control plane.
"""

from __future__ import annotations

import gc
import os
import struct
import sys
from typing import Any

import msgpack
import torch

from omni_mesh import codec
from omni_mesh.connectors import create_connector

LENGTH = struct.Struct("<I")


def send(stream: Any, message: dict) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    stream.write(LENGTH.pack(len(data)) + data)
    stream.flush()


def receive(stream: Any) -> dict | None:
    head = stream.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    return msgpack.unpackb(stream.read(LENGTH.unpack(head)[0]), raw=False, strict_map_key=False)


def shm_mappings() -> list[str]:
    """Paths of the omni-mesh segments this process has mapped (deleted ones included)."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split(None, 5)[5].strip() for line in maps if "/omnimesh_" in line})


def cuda_leaves(value: Any) -> int:
    """How many tensors of the payload this process sees on a CUDA device (mapped by IPC handle)."""
    if isinstance(value, torch.Tensor):
        return int(value.is_cuda)
    if isinstance(value, dict):
        return sum(cuda_leaves(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(cuda_leaves(v) for v in value)
    return 0


def main() -> None:
    config = msgpack.unpackb(bytes.fromhex(sys.argv[1])) if len(sys.argv) > 1 else {}
    connector = create_connector("SharedMemoryConnector", config)
    held: dict[str, Any] = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    send(stdout, {"pid": os.getpid()})
    while (command := receive(stdin)) is not None:
        op = command.pop("op")
        try:
            if op == "get":
                hold = command.pop("hold", None)
                summary = command.pop("summary", False)  # answer the size only, not the payload
                result = connector.get(**command)
                if result is None:
                    reply: dict = {"none": True}
                else:
                    data, size = result
                    reply = {"size": size} if summary else {"frame": bytes(codec.encode(data)), "size": size}
                    reply["cuda_leaves"] = cuda_leaves(data)
                    if hold is not None:
                        held[hold] = data
                    del data, result
            elif op == "check":
                reply = {"frame": bytes(codec.encode(held[command["hold"]]))}
            elif op == "drop":
                del held[command["hold"]]
                gc.collect()
                reply = {}
            elif op == "put":
                data = codec.decode(command.pop("frame"), copy=True)
                ok, size, metadata = connector.put(data=data, **command)
                reply = {"ok": ok, "size": size, "metadata": metadata}
            elif op == "cleanup":
                connector.cleanup(command["key"])
                reply = {}
            elif op == "health":
                reply = connector.health()
            elif op == "maps":
                reply = {"maps": shm_mappings()}
            elif op == "close":
                connector.close()
                reply = {}
            else:
                reply = {"error": "ValueError", "message": f"unknown op {op!r}"}
        except Exception as exc:  # the test asserts on the type and message
            reply = {"error": type(exc).__name__, "message": str(exc)}
        send(stdout, reply)


if __name__ == "__main__":
    main()
