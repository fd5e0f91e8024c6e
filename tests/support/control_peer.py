"""A member of a mesh's control plane played by a test: a DEALER with no keys, a key pair of its own,
or the mesh keys, and where to find the coordinator's control endpoint of an `omni-mesh up`."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

import msgpack
import zmq

from omni_mesh.procinfo import descendants
from omni_mesh.security import MeshKeys, secure_client
from support.meshkit import Mesh

SEND_TIMEOUT_MS = 2000  # a peer's send never blocks the test for ever


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def control_endpoint(mesh: Mesh) -> tuple[str, int]:
    """(the coordinator's control endpoint, the coordinator's pid), from its command line."""
    for pid in descendants(mesh.process.pid):
        argv = _cmdline(pid)
        if "coordinator" in argv and "--control" in argv:
            return argv[argv.index("--control") + 1], pid
    raise AssertionError("no coordinator process found")


class Peer:
    """A DEALER on the control endpoint: no keys, a key pair of its own, or the mesh keys."""

    def __init__(
        self, endpoint: str, keys: MeshKeys | None, *, own_pair: bool = False, routing_id: bytes | None = None
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id or secrets.token_hex(16).encode())
        if keys is not None and own_pair:
            public, secret = zmq.curve_keypair()
            self.sock.curve_serverkey = keys.public
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        else:
            secure_client(self.sock, keys)
        self.sock.connect(endpoint)

    def send(self, message: dict, *extra: bytes) -> None:
        try:
            self.sock.send_multipart([msgpack.packb(message), *extra])
        except zmq.Again:
            raise AssertionError(
                f"a {message.get('type')!r} message was not queued within {SEND_TIMEOUT_MS} ms: "
                "the coordinator did not take this member's connection"
            ) from None

    def offer(self, message: dict) -> None:
        """Queue without waiting, or drop: a refused handshake leaves the DEALER no pipe, and a plain
        send would then block forever."""
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart([msgpack.packb(message)], flags=zmq.NOBLOCK)

    def receive(self, timeout_s: float = 2.0) -> dict | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return msgpack.unpackb(self.sock.recv_multipart()[0])

    def messages(self, timeout_s: float) -> list[dict]:
        out, deadline = [], time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left)
            if message is not None:
                out.append(message)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def register_message(mesh: Mesh, stage: str, replica: str, **more: object) -> dict:
    edges = {e["label"]: e["connector_name"] for e in mesh.client.get("/v1/topology").json()["edges"]}
    return {
        "type": "register", "stage": stage, "replica": replica, "pid": os.getpid(), "host": "attacker",
        "max_inflight": 8, "edges": edges, **more,
    }


def health(mesh: Mesh) -> dict:
    """The coordinator's control-plane counters (in /v1/stats: /health says only "ok")."""
    return mesh.client.get("/v1/stats").json()["control"]
