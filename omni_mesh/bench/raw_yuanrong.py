"""Raw openYuanrong datasystem baseline: `KVClient.set` + `KVClient.get` of bytes already in memory.

`kv_seconds(size, repeats, host, port)` times set + get of the same `size` bytes through the worker
at host:port, from this process; YuanrongConnector's put + get against the same worker is compared
with these times. The key is deleted afterwards (outside the timings).
"""

from __future__ import annotations

import os
import time

import numpy as np

from omni_mesh.connectors import backends
from omni_mesh.connectors.yuanrong import client_log_dir


def kv_seconds(size: int, repeats: int, host: str, port: int, warmup: int = 1) -> list[float]:
    """Wall time of each of `repeats` set+get round trips (after `warmup` untimed ones)."""
    client_log_dir()
    KVClient = backends.load("yr.datasystem", "raw_yuanrong").KVClient  # noqa: N806

    client = KVClient(host, int(port), connect_timeout_ms=3000)
    client.init()
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = f"omni-mesh-bench-raw-{os.getpid()}"
    times = []
    try:
        for i in range(warmup + repeats):
            started = time.perf_counter()
            client.set(key, data)
            value = client.get([key])[0]
            elapsed = time.perf_counter() - started
            if len(value) != size:
                raise RuntimeError(f"raw_yuanrong: got {len(value)} bytes back, expected {size}")
            del value
            if i >= warmup:
                times.append(elapsed)
    finally:
        client.delete([key])
    return times
