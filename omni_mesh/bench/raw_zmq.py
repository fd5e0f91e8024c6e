"""Raw pyzmq baseline: `size` bytes already in memory crossing TCP loopback with ZeroMQ, zero-copy.

`zmq_seconds(size, repeats)` starts a second process that holds the bytes (faulted in once) and
sends them zero-copy on each request; this process receives them zero-copy (`copy=False`) and times
each request -> reply. A connector's put+get between the same two kinds of process is compared with
these times (the request round trip is in both).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import zmq

_REPLY_TIMEOUT_MS = 120_000


def zmq_seconds(size: int, repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of each of `repeats` transfers of `size` bytes (after `warmup` untimed ones)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "omni_mesh.bench.raw_zmq", str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        line = server.stdout.readline() if server.stdout else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"raw_zmq: the sending process did not start (exit code {server.poll()})")
        sock.connect(f"tcp://127.0.0.1:{int(line)}")
        times = []
        for i in range(warmup + repeats):
            started = time.perf_counter()
            sock.send(b"go")
            if not sock.poll(_REPLY_TIMEOUT_MS):
                raise RuntimeError(f"raw_zmq: no reply within {_REPLY_TIMEOUT_MS / 1000:g}s")
            frame = sock.recv(copy=False)
            elapsed = time.perf_counter() - started
            if len(frame.buffer) != size:
                raise RuntimeError(f"raw_zmq: received {len(frame.buffer)} bytes, expected {size}")
            del frame
            if i >= warmup:
                times.append(elapsed)
        sock.send(b"stop")
        return times
    finally:
        sock.close(linger=0)
        ctx.term()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _serve(size: int) -> None:
    """The sending process: bind, print the port, answer each request with the same bytes."""
    data = np.full(size, 7, dtype=np.uint8)  # faulted in now, like a payload a stage already holds
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # never outlive the benchmark
            if not sock.poll(1000):
                continue
            identity, request = sock.recv_multipart()
            if request == b"stop":
                break
            sock.send_multipart([identity, memoryview(data)], copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
