"""ZmqConnector: payloads served straight from the producer's memory (cross-host, nothing to deploy).

Requests travel on a ZeroMQ side channel (CURVE with mesh keys); with mesh keys, payloads from 256 KiB
on travel sealed on a plain TCP port (the bulk socket, `served.bulk_wire`), not over ZeroMQ: the
name is the one users' configs know.

Data path of one payload:

    put   plan(data).write_into(pool slot)      one copy, into a reused (already faulted-in) memory pool
          -> metadata {"endpoint", "key", "token", "size"}
    get   DEALER ["GET", key, token, offer] over the side channel (CURVE with mesh keys), answered with
          the payload itself (small ones; every one without mesh keys), or, with mesh keys, from 256 KiB
          on, streamed on the producer's bulk socket (plain TCP) in chunks sealed with a key the offer carried
          (AES-256-GCM / ChaCha20-Poly1305, `encryption`), opened by the consumer as they arrive;
          then DEALER ["DONE", key, token]: it arrived, the producer lets go of it

The producer's memory (the pool, one-off buffers past its ceiling, `empty()` outputs sent from where
they lie) is `served.producer_pool`'s; the requests and replies are `served.zmq_wire`'s; the sealing is
`served.seal`'s, the bulk socket `served.bulk_server` / `served.bulk_client`. A payload served is
kept until its consumer confirms it arrived (served again to a get asked again after its connection
broke); payloads nobody asks for or confirms are freed after `ttl_s` or by `cleanup()`. A consumer whose
producer died (or whose network is cut) gets a ConnectorError naming the endpoint and key at its
deadline, and one whose bytes were altered, replayed or cut short in transit an error naming the
edge and key, never wrong data.

`encryption: none` keeps the peers authenticated but sends the payload bytes IN CLEAR: anyone on the
path reads them. Only for networks you trust (docs/security.md).

`host` is the address to bind and advertise; `auto` (the default) follows the rule in
omni_mesh.connectors._addresses, and `0.0.0.0` binds every interface and advertises the `auto` address.
The side channel, the held-payload table and health() are ServedConnector's (omni_mesh.connectors.served.connector).
"""

from __future__ import annotations

from typing import Any

from omni_mesh.connectors.config import ZmqConfig
from omni_mesh.connectors.served import seal
from omni_mesh.connectors.served.bulk_client import BulkLinks
from omni_mesh.connectors.served.bulk_server import BulkServer
from omni_mesh.connectors.served.channel import Handler
from omni_mesh.connectors.served.confirms import Confirms
from omni_mesh.connectors.served.connector import ServedConnector
from omni_mesh.connectors.served.producer_pool import PoolProducer
from omni_mesh.connectors.served.zmq_wire import ZmqWire

__all__ = ["ZmqConfig", "ZmqConnector"]


class ZmqConnector(ZmqWire, PoolProducer, ServedConnector):
    """Cross-host payloads over ZeroMQ, served from the producer's own memory pool (module docstring)."""

    config_class = ZmqConfig
    scope = "network"
    port_field = "port"
    counter_names = (*ServedConnector.counter_names, "oneoff", "pool_grown", "pool_released")

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._init_pool(self.config)
        # Payload bytes off CURVE (with mesh keys only: the session key needs CURVE to travel secretly).
        self._algorithm = seal.resolve(self.config.encryption)
        self._bulk: BulkServer | None = None
        self._bulk_links = BulkLinks() if self._keys is not None else None
        self._late_sessions: dict[str, seal.Session] = {}  # of polls left waiting (ZmqWire._fetch)
        self._confirms = Confirms(self._dealers, self._name)  # payloads that arrived, told their producers

    def _serving_handlers(self) -> dict[bytes, Handler]:
        self._open_pool()
        if self._keys is not None:
            self._bulk = BulkServer(self._bind_host, self._name, self.config.bulk_port)
            self._bulk.start()
        return {b"GET": self._serve, b"DONE": self._confirmed}

    def health(self) -> dict:
        report = super().health()
        report.update(self._pool_health())
        report.update(encryption=self._algorithm if self._keys is not None else "curve-off")
        report["bulk_transfers"] = self._bulk.pulled if self._bulk is not None else 0
        if self._bulk is not None:
            report["bulk_port"] = self._bulk.port
            report["refused_peers"] += self._bulk.refused.count
            if self._bulk.error is not None:  # its thread stopped: large payloads cannot leave
                report.update(status="unhealthy", error=f"bulk socket thread stopped: {self._bulk.error}")
        return report

    def close(self) -> None:
        self._confirms.close()  # what is queued goes first, while the dealers are open
        if self._bulk is not None:  # its connections close before the context ends
            self._bulk.stop()
        if self._bulk_links is not None:
            self._bulk_links.close()
        super().close()

    def _close_backend(self) -> None:
        self._close_pool()
