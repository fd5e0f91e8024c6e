"""The consumer process of a connector benchmark: spawned with the connector's name and config, it
builds the same connector and answers over a PAIR socket on loopback (`bench connector`, `--handoff`)."""

from __future__ import annotations

import json
import subprocess
import sys

import zmq

#: How long a benchmark waits for its consumer's answer before it calls the run failed.
REPLY_TIMEOUT_MS = 120_000


class PeerProcess:
    """`python -m MODULE --consumer NAME CONFIG PORT`, and the socket this process talks to it on."""

    def __init__(self, module: str, name: str, config: dict) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "--consumer", name, json.dumps(config), str(port)]
        )

    def exchange(self, message: bytes, who: str) -> bytes:
        """Send `message`, wait for the answer (a RuntimeError naming `who` past REPLY_TIMEOUT_MS)."""
        self.socket.send(message, copy=False)
        if not self.socket.poll(REPLY_TIMEOUT_MS):
            raise RuntimeError(
                f"{who} did not answer within {REPLY_TIMEOUT_MS / 1000:g} s (exit {self.process.poll()})"
            )
        return self.socket.recv()

    def close(self, stop: bytes) -> None:
        """Ask the consumer to stop with `stop`; kill it if it does not within 10 s."""
        try:
            if self.process.poll() is None:
                self.socket.send(stop)
                self.process.wait(10)
        except (subprocess.TimeoutExpired, zmq.ZMQError):
            self.process.kill()
            self.process.wait()
        self.socket.close(0)
        self.ctx.term()


def consumer_socket(port: int) -> tuple[zmq.Context, zmq.Socket]:
    """The consumer's end: a PAIR socket connected to the benchmark on `port`."""
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://127.0.0.1:{port}")
    return ctx, socket
