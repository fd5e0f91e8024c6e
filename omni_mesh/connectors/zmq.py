"""ZmqConnector: payloads served straight from the producer's memory (cross-host, nothing to deploy).

A put writes the payload once into a slot of a reused (already faulted-in) memory pool and returns
metadata {"endpoint", "key", "token", "size"}; a get asks the producer for it on a ZeroMQ side
channel (CURVE with mesh keys) and gets it in the answer, or, with mesh keys, from 256 KiB on, on the
producer's bulk socket: a plain TCP port, not ZeroMQ (the name is the one users' configs know),
sealed with a key its request carried (`encryption`, `served.seal`). It then tells the producer the
payload arrived (DONE), and the producer lets go of it. Both ends import `served.zmq_wire`'s requests
and answers and `served.bulk_wire`'s bulk format.

A thin adapter over what it composes: the producer's memory (the pool, one-off buffers past its
ceiling, `empty()` outputs) is a `served.producer_pool.ProducerPool`, its answers a
`served.zmq_wire.Serving`'s, the bulk socket `served.bulk_server` / `served.bulk_client`; the side
channel, the held-payload table and health() are `served.connector.ServedConnector`'s. A payload
is kept until its consumer confirms it arrived (served again to a get asked again after its
connection broke), or freed after `ttl_s` or by `cleanup()`. A dead producer or cut network fails a
get with a ConnectorError naming endpoint and key; altered, replayed or cut-short bytes fail naming
edge and key, never wrong data. `encryption: none` sends the payload bytes IN CLEAR
(docs/security.md). `host`: see omni_mesh.connectors._addresses (`0.0.0.0` binds every interface and
advertises the `auto` address).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_mesh.codec import FrameError, plan
from omni_mesh.connectors.config import ZmqConfig
from omni_mesh.connectors.errors import ConnectorError
from omni_mesh.connectors.keys import edge_key
from omni_mesh.connectors.pools import growth, outputs
from omni_mesh.connectors.pools.held import Gone, Held
from omni_mesh.connectors.pools.slots import SlotPool
from omni_mesh.connectors.served import seal, zmq_wire
from omni_mesh.connectors.served.bulk_client import BulkError, BulkLinks, pull
from omni_mesh.connectors.served.bulk_server import BulkServer
from omni_mesh.connectors.served.channel import Handler
from omni_mesh.connectors.served.confirms import Confirms
from omni_mesh.connectors.served.connector import ServedConnector
from omni_mesh.connectors.served.producer_pool import ProducerPool
from omni_mesh.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch

__all__ = ["ZmqConfig", "ZmqConnector"]


class ZmqConnector(ServedConnector):
    """Cross-host payloads over ZeroMQ, served from the producer's own memory pool (module docstring)."""

    config_class = ZmqConfig
    scope = "network"
    counter_names = (*ServedConnector.counter_names, "oneoff", "pool_grown", "pool_released")

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._pool = ProducerPool(
            self._slots, self.config.pool_idle_release_s, self._counters, self._reap_sent
        )
        # Payload bytes off CURVE (with mesh keys only: the session key needs CURVE to travel secretly).
        self._algorithm = seal.resolve(self.config.encryption)
        self._serving = zmq_wire.Serving(self._held, self._pool, self._algorithm)
        self._bulk: BulkServer | None = None
        self._bulk_links = BulkLinks() if self._keys is not None else None
        self._confirms = Confirms(self._dealers, self._name)  # payloads that arrived, told their producers

    def _new_slots(self, cfg: Any) -> SlotPool:
        return SlotPool(
            cfg.memory_pool_size,
            ceiling=growth.ceiling(cfg.memory_pool_size, cfg.max_pool_size, growth.ram()),
        )

    def _serving_handlers(self) -> dict[bytes, Handler]:
        self._pool.open()
        if self._keys is not None:
            self._bulk = self._serving.bulk = BulkServer(self._bind_host, self._name, self.config.bulk_port)
            self._bulk.start()
        return {b"GET": self._serving.serve, b"DONE": self._serving.confirmed}

    # ---- producer side

    def _put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[int, dict | None]:
        if self._server is None or self._closed:
            self._start_server()
        key = edge_key(from_stage, to_stage, put_key)
        pool = self._pool
        if pool.unsent and type(data) is dict:  # empty() outputs alone: nothing planned or copied
            taken = pool.take_outputs(data)
            if taken is not None:
                size, parts, regions = taken
                return size, self._metadata(key, self._hold_later(key, put_key, size, parts, regions), size)
        frame = plan(data)
        resident = pool.take_resident(frame) if pool.unsent else None
        if resident is not None:  # empty() outputs among other leaves: sent from where they lie
            size, parts, regions = resident
            try:
                held = self._hold(key, put_key, size, None, parts, regions=regions)
            except BaseException:
                pool.unsend(regions)
                raise
            return size, self._metadata(key, held.token, size)
        offset, buffer = pool.write(frame)
        held = self._hold(key, put_key, frame.nbytes, offset, buffer)
        return frame.nbytes, self._metadata(key, held.token, frame.nbytes)

    def _metadata(self, key: str, token: str, size: int) -> dict:
        return {"endpoint": self.endpoint, "key": key, "token": token, "size": size}

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in a pool slot: returned in a put's payload, it is sent from there
        (module docstring). Do not write into it after the put."""
        shape = tuple(int(n) for n in shape)
        nbytes = outputs.nbytes_of(shape, dtype)
        if nbytes < outputs.MIN_BYTES:  # copying it costs less than a slot
            return import_torch().empty(shape, dtype=dtype)
        self._start_server()  # the pool comes with it
        return self._pool.empty(shape, dtype, nbytes)

    def _release(self, held: Held) -> None:
        self._serving.release(held)  # once no reply is sent from it

    def cleanup(self, key: str) -> None:
        # Served payloads too (claimed until confirmed): a reply still sent from one frees it after.
        for held in self._held.pop_matching(key, retire_claimed=False):
            self._release(held)

    # ---- consumer side

    def _fetch(
        self, endpoint: str, key: str, metadata: dict, timeout_s: float, where: str, *, poll: bool = False
    ) -> tuple[Any, int]:
        """GET key token [offer] -> the payload, decoded as views over what arrived; then DONE, queued."""
        if self._confirms.taken(endpoint, key):  # we have it already; the producer hears so soon
            raise Gone(f"{where}: no payload under this key: already consumed (by this consumer)")
        token = str(metadata.get("token", ""))
        session = None
        if self._bulk_links is not None:  # a large payload may come sealed on the bulk socket
            # A poll's request still waiting for its answer is resumed, not sent again: its session
            # is the one its answer was sealed for. Every new request offers a fresh one.
            session = self._late.session(key, endpoint) or seal.Session.fresh()
        late = (
            f"no answer within {timeout_s:.3g}s; the producing process is gone, its host is unreachable, "
            "or the payload is still in transit (raise get_timeout_s)"
        )
        # The answer carries the payload: a poll that gives up keeps waiting for it in the background.
        parts = zmq_wire.request(key, token, session)
        reply = self._ask(
            endpoint, parts, timeout_s, where, late, late_key=key, keep_late=poll, late_session=session,
            again_if_broken=True,
        )
        sealed = zmq_wire.sealed(reply)
        try:
            if sealed is None:
                got = zmq_wire.read_reply(reply)
            else:  # the payload left the producer: wait for it
                buffers = self._pull(
                    endpoint, key, session, sealed[0], max(timeout_s, self.config.get_timeout_s), where
                )
                got = zmq_wire.read_pulled(buffers, sealed[1])
        except FrameError as exc:
            self._error()
            raise ConnectorError(f"{where}: corrupt frame: {exc}") from None
        self._confirms.add(endpoint, key, token)
        return got

    def _pull(
        self, endpoint: str, key: str, session: seal.Session | None, desc: bytes, timeout_s: float, where: str
    ) -> list[Any]:
        """The buffers of the payload the producer answered SEALED for: pulled from its bulk socket, opened."""
        if session is None or self._bulk_links is None:  # a late answer to an old request of the key
            self._error()
            raise ConnectorError(f"{where}: a sealed answer to a request that offered no session")
        try:
            return pull(self._bulk_links, endpoint, session, key, desc, timeout_s)
        except BulkError as exc:
            self._error()
            raise ConnectorError(
                f"{where}: refused the payload's bytes: {exc}; nothing was returned"
            ) from None
        except Exception as exc:
            raise self._dealer_failure(
                exc, f"{where} (bulk socket)", "the payload's bytes stopped coming"
            ) from None

    # ---- lifecycle

    def health(self) -> dict:
        report = super().health()
        report.update(self._pool.health(), in_flight=self._serving.in_flight, confirms_pending=self._confirms.pending)
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
        self._pool.close()
